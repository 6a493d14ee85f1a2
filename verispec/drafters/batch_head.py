"""Chain drafting with a draft head (draft_head.HeadLayer) for a whole batch: one head step per draft position.

The head reads the target's own hidden states, which only the target's forwards compute: the step hands
each row the hidden states of the tokens it committed (`observe`: a prompt's as it goes in, then each
verify pass's accepted positions), and the row feeds them to its head cache lazily, at its next proposal,
as the batched draft model feeds committed tokens. Row b's head cache holds one entry per position t
whose next token x_{t+1} is committed: (f_t, x_{t+1}); the last gives the first draft, and each draft
position adds a speculative entry (the head's own prediction, its draft) that the next proposal drops.

A row sees the hidden states from the first position it was handed on (a prompt found in the prefix
cache was never computed, so its head starts after it); verification is exact either way, and a
shorter context costs acceptance at most. The propose loop, sampling, grammar and per-row faults are
the batched draft model's too (`ChainDrafter.propose`).
"""

from __future__ import annotations

import time

import torch

from verispec.drafters.base import LONG_TAIL
from verispec.drafters.batch_draft import PAD_TOKEN, ChainDrafter
from verispec.drafters.draft_head import HeadLayer


class BatchedDraftHead(ChainDrafter):
    source = "draft-head"
    needs_hidden_states = True

    def __init__(self, head: HeadLayer, target_vocab_size: int, max_batch_size: int, capacity: int) -> None:
        super().__init__(head, target_vocab_size)
        self.keys, self.values = head.new_cache(max_batch_size, capacity)  # (B, H, capacity, D) each
        # Committed entries (the target's features) per row, as Python ints: observe runs for every row of every
        # step, and a tensor op there is a GIL hand-off a served step waits on, once per row.
        self.lengths = [0] * max_batch_size
        self.first = [0] * max_batch_size  # position of entry 0
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(max_batch_size)]  # features (T_i, C) not fed
        self.pending_count = [0] * max_batch_size  # positions in each row's pending features
        self.written = torch.zeros(max_batch_size, dtype=torch.long)  # entries in the cache now, drafts' included
        self._inputs: list[torch.Tensor | None] = [None] * max_batch_size  # features of each row's next feed
        self._first_feed = True  # the next _feed is a proposal's first: the target's hidden states, not predictions

    # -- the rows ---------------------------------------------------------------------------------

    def add(self, row: int, prompt_ids: list[int], max_length: int) -> None:
        """Start a new sequence in `row`; its prompt's hidden states come by `observe`."""
        self._clear(row, 0)

    def _clear(self, row: int, first: int) -> None:
        self.lengths[row] = 0
        self.written[row] = 0
        self.first[row] = first
        self.pending[row] = []
        self.pending_count[row] = 0
        self._inputs[row] = None

    def observe(self, row: int, position: int, features: torch.Tensor) -> None:
        """The target's hidden states (T, C or F C) at positions position .. position + T - 1 of the row's sequence.
        Not where the row's own ones end (positions it never saw): the row starts again from `position`."""
        count = features.shape[0]
        if not count:
            return
        expected = self.first[row] + self.lengths[row] + self.pending_count[row]
        if position != expected or (self.lengths[row] == 0 and not self.pending[row]):
            self._clear(row, position)
        self.pending[row].append(features)
        self.pending_count[row] += count

    def share_prompt(self, source: int, destination: int, prompt_length: int) -> None:
        """Start `destination` with what row `source` holds of the same prompt (its first prompt_length - 1 tokens)."""
        end = prompt_length - 1 - self.first[source]  # entries wanted, from the source's first position
        self._clear(destination, self.first[source])
        kept = min(self.lengths[source], max(end, 0))
        self.keys[destination, :, :kept] = self.keys[source, :, :kept]
        self.values[destination, :, :kept] = self.values[source, :, :kept]
        self.lengths[destination] = self.written[destination] = kept
        pending = torch.cat(self.pending[source]) if self.pending[source] else None
        if pending is not None and end > kept:
            self.pending[destination] = [pending[: end - kept]]
            self.pending_count[destination] = len(self.pending[destination][0])

    def restart_window(self, row: int, tokens: list[int], window: int) -> None:
        """Keep only the last `window` positions not fed yet: the next proposal feeds those, not the whole backlog."""
        if self.pending_count[row] <= window:
            return
        pending = torch.cat(self.pending[row])[-window:]
        self._clear(row, len(tokens) - 1 - len(pending))
        self.pending[row] = [pending]
        self.pending_count[row] = len(pending)

    def behind(self, row: int, tokens: list[int]) -> int:
        """Positions the row has been handed and not fed to its head yet."""
        return self.pending_count[row]

    def move(self, source: int, destination: int) -> None:
        entries = int(self.written[source])  # only what the row holds: its rows span the whole context's capacity
        self.keys[destination, :, :entries] = self.keys[source, :, :entries]
        self.values[destination, :, :entries] = self.values[source, :, :entries]
        self.lengths[destination] = self.lengths[source]
        self.written[destination] = self.written[source]
        self.first[destination] = self.first[source]
        self.pending[destination] = self.pending[source]
        self.pending_count[destination] = self.pending_count[source]
        self._inputs[destination] = None

    # -- ChainDrafter.propose's parts -------------------------------------------------------------

    def _sync(self, row: int, tokens: list[int]) -> list[int] | None:
        """Drop the row's draft entries; return the next tokens of the positions it has to feed (None: it cannot
        draft, its hidden states do not reach the newest committed token)."""
        self.written[row] = self.lengths[row]
        self._first_feed = True
        start = self.first[row] + self.lengths[row]
        end = start + self.pending_count[row]
        if end == start or end != len(tokens) - 1:
            return None
        self._inputs[row] = torch.cat(self.pending[row]) if len(self.pending[row]) > 1 else self.pending[row][0]
        return tokens[start + 1 : end + 1]

    def _catch_up(self, row: int, tail: list[int] | None, limit: int | None) -> list[int] | None:
        """Feed all but the last of a long backlog to the row alone (one head step over them: cheap, so `limit`,
        a draft model's catch-up budget, does not bind it); the last goes with the batch."""
        if tail is None or len(tail) <= LONG_TAIL:
            return tail
        fed = len(tail) - 1
        features = self._inputs[row]
        self._step(row, row + 1, features[None, :fed], torch.tensor([tail[:fed]]), normalized=False)
        self.lengths[row] += fed
        self.written[row] = self.lengths[row]
        self.catch_up_tokens += fed
        self._inputs[row] = features[fed:]
        return tail[fed:]

    def _feed(self, inputs: list[list[int] | None]) -> torch.Tensor:
        """One head step over each row's next inputs (ragged; None = a pad row whose entries are never committed):
        the first call of a proposal feeds the target's hidden states, the next ones each row's own prediction
        and draft. Returns scores at each row's last input, (n, V')."""
        n = len(inputs)
        width = max(len(row) for row in inputs if row is not None)
        feeding_targets, self._first_feed = self._first_feed, False
        template = next(self._inputs[b] for b, row in enumerate(inputs) if row is not None)
        features = template.new_zeros(n, width, template.shape[-1])  # (n, T, C)
        ids = torch.full((n, width), PAD_TOKEN, dtype=torch.long)  # (n, T)
        counts = torch.zeros(n, dtype=torch.long)
        for b, row in enumerate(inputs):
            if row is not None:
                features[b, : len(row)] = self._inputs[b][: len(row)]
                ids[b, : len(row)] = torch.tensor(row)
                counts[b] = len(row)
        predicted = self._step(0, n, features, ids, normalized=not feeding_targets)  # (n, T, C)
        last = predicted[torch.arange(n), (counts - 1).clamp(min=0)]  # (n, C)
        for b, row in enumerate(inputs):
            if row is not None:
                if feeding_targets:
                    self.lengths[b] += len(row)
                    self.pending[b] = []
                    self.pending_count[b] = 0
                self.written[b] += len(row)
                self._inputs[b] = last[b : b + 1]
        return self.model.logits(last)  # (n, V')

    def _step(self, first: int, last: int, features: torch.Tensor, ids: torch.Tensor, normalized: bool) -> torch.Tensor:
        """HeadLayer.step over rows first .. last - 1, after each row's written entries."""
        rows = slice(first, last)
        written = self.written[rows]
        positions = torch.tensor(self.first[rows])[:, None] + written[:, None] + torch.arange(ids.shape[1])  # (b, T)
        return self.model.step(features, ids, positions, self.keys[rows], self.values[rows], written, normalized)

    def timed_costs(self, repeats: int = 20) -> tuple[float, float]:
        """Seconds of one draft position for one row, and of a catch-up per position (a feed of up to 256): what the
        controller starts from before any step (the head's share of step_costs)."""
        head = self.model
        row, positions = 0, min(256, self.keys.shape[2] - 1)
        self._clear(row, 0)
        features = torch.randn(1, positions, head.feature_width, dtype=head.dtype)  # the target's: fused ones wider
        drafted = torch.randn(1, 1, head.width)  # (1, 1, C) the head's own normalized prediction, as a draft feeds it
        ids = torch.randint(0, len(head.vocab), (1, positions))
        timings = {"position": [], "catch_up": []}
        for _ in range(repeats):
            self.written[row] = 0
            started = time.perf_counter()
            self._step(row, row + 1, features, ids, normalized=False)
            timings["catch_up"].append((time.perf_counter() - started) / positions)
            self.written[row] = positions - 1
            started = time.perf_counter()
            head.logits(self._step(row, row + 1, drafted, ids[:, :1], normalized=True)[:, -1])
            timings["position"].append(time.perf_counter() - started)
        self._clear(row, 0)
        return tuple(sorted(t)[len(t) // 2] for t in (timings["position"], timings["catch_up"]))
