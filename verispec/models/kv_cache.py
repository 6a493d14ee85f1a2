"""Preallocated key/value cache.

Invariant: for each sequence b, slots [0, lengths[b]) hold exactly the keys and values of the
committed tokens of b, in order; everything at or after lengths[b] is scratch. A forward pass
writes its new tokens at slots lengths[b] ... lengths[b] + T - 1 without moving `lengths`;
`commit` then keeps a prefix of them. Rolling back rejected tokens is therefore O(1): they are
simply never committed, and the next forward overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WritePlan:
    """Where one forward's new tokens go: worked out once per forward and shared by every layer's write.

    Holds the committed lengths as Python ints, so layers need no tensor op or sync to place keys.
    """

    lengths: tuple[int, ...]  # committed tokens per row when the forward started
    num_new: int  # T, new tokens per row
    end: int  # max(lengths) + T: writes return views over slots [0, end)
    slots: torch.Tensor | None  # (B, T) slot of each new token when rows differ in length; None when uniform
    rows: torch.Tensor | None  # (B, 1) row indices to pair with slots; None when uniform

    @property
    def uniform(self) -> bool:
        """Every row has the same committed length, so the new tokens fill one slice of slots."""
        return self.slots is None

    @property
    def start(self) -> int:
        """First new slot of every row (uniform plans)."""
        return self.lengths[0] if self.lengths else 0


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]  # (B, H_kv, S, D)
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]  # (B, H_kv, S, D)
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # (B,) committed tokens per row
        self.capacity = capacity

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def plan_write(self, num_new: int) -> WritePlan:
        """Where `num_new` tokens per row go in the next forward's writes (raises if they do not fit)."""
        lengths = tuple(self.lengths.tolist())
        end = max(lengths, default=0) + num_new
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens > capacity {self.capacity}")
        if len(set(lengths)) <= 1:
            return WritePlan(lengths, num_new, end, None, None)
        slots = self.lengths[:, None] + torch.arange(num_new)  # (B, T)
        rows = torch.arange(len(lengths))[:, None]  # (B, 1)
        return WritePlan(lengths, num_new, end, slots, rows)

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, plan: WritePlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys/values after each row's committed prefix.

        keys, values: (B, H_kv, T, D). plan: from plan_write(T), made once per forward; computed
        here when None. Returns views over slots [0, max(lengths) + T), (B, H_kv, S', D).
        """
        if plan is None:
            plan = self.plan_write(keys.shape[2])
        elif plan.num_new != keys.shape[2]:
            raise ValueError(f"the write plan is for {plan.num_new} new tokens, got {keys.shape[2]}")
        k_cache, v_cache = self.keys[layer], self.values[layer]
        if plan.uniform:
            k_cache[:, :, plan.start : plan.end] = keys
            v_cache[:, :, plan.start : plan.end] = values
        else:
            k_cache[plan.rows, :, plan.slots] = keys.transpose(1, 2)  # indexed view is (B, T, H_kv, D)
            v_cache[plan.rows, :, plan.slots] = values.transpose(1, 2)
        return k_cache.narrow(2, 0, plan.end), v_cache.narrow(2, 0, plan.end)

    def commit(self, num_tokens: torch.Tensor | int) -> None:
        """Append the first num_tokens[b] tokens written by the last forward to row b's prefix."""
        self.lengths += num_tokens
        if int(self.lengths.max()) > self.capacity:
            raise RuntimeError("committed past the KV cache capacity")

    def truncate(self, lengths: torch.Tensor | int) -> None:
        """Roll rows back to their first `lengths` committed tokens (O(1): nothing is copied)."""
        new = torch.as_tensor(lengths, dtype=torch.long).expand_as(self.lengths)
        if bool((new > self.lengths).any()):
            raise ValueError("truncate can only shorten the committed prefix")
        self.lengths.copy_(new)  # in place: a view from `rows` shares this tensor

    def rows(self, start: int, stop: int) -> "KVCache":
        """A cache over rows [start, stop) that shares this one's storage (a forward on it writes here)."""
        view = KVCache.__new__(KVCache)
        view.keys = [k[start:stop] for k in self.keys]
        view.values = [v[start:stop] for v in self.values]
        view.lengths = self.lengths[start:stop]
        view.capacity = self.capacity
        return view

    def move_row(self, source: int, destination: int) -> None:
        """Copy row `source`'s committed prefix into row `destination` (to keep active rows contiguous)."""
        self.copy_prefix(source, destination, int(self.lengths[source]))

    def copy_prefix(self, source: int, destination: int, length: int) -> None:
        """Row `destination` becomes the first `length` committed tokens of row `source` (a shared prompt)."""
        if length > int(self.lengths[source]):
            raise ValueError(f"row {source} holds {int(self.lengths[source])} committed tokens, not {length}")
        for k, v in zip(self.keys, self.values):
            k[destination, :, :length] = k[source, :, :length]
            v[destination, :, :length] = v[source, :, :length]
        self.lengths[destination] = length
