"""Keys and values of prompt prefixes that requests share (a system prompt, a chat history), kept for reuse.

A prompt's prefix is cut into blocks of PREFILL_CHUNK tokens. A block is known by its parent block
and its own tokens (exact: no hashes that could collide), so a block is found only after the very
same tokens at the very same positions. The target prefills in chunks that end on these block
boundaries (Transformer.prefill), so a block's keys and values are those a prefill of the prompt
would compute: reusing them changes no bit of the output.

A server that drafts with a draft head keeps each block's last hidden states of the target too (the head's input:
a prompt found here was never computed again), where the prompt's are all known.

Memory is bounded: past `max_bytes`, the least recently used blocks that no other block extends
are dropped first (a dropped parent would strand its children).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import torch

from verispec.models.kv_cache import KVCache
from verispec.models.transformer import PREFILL_CHUNK

BlockKey = tuple[int, tuple[int, ...]]  # (parent block id, 0 for the first block; the block's tokens)


@dataclass
class _Block:
    id: int
    key: BlockKey
    parent: BlockKey | None
    keys: list[torch.Tensor]  # per layer (H_kv, PREFILL_CHUNK, D)
    values: list[torch.Tensor]  # per layer (H_kv, PREFILL_CHUNK, D)
    hidden: torch.Tensor | None = None  # (PREFILL_CHUNK, C) the target's last hidden states, for a draft head
    children: int = 0

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys + self.values + ([self.hidden] if self.hidden is not None else []))


def _span(hidden: torch.Tensor | None, start: int, size: int) -> torch.Tensor | None:
    """A block's copy of hidden[start : start + size], or None where hidden does not reach its end."""
    if hidden is None or len(hidden) < start + size:
        return None
    return hidden[start : start + size].clone()


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class PrefixCacheStats:
    hit_tokens: int = 0  # prompt tokens whose keys and values came from the cache
    missed_tokens: int = 0  # prompt tokens prefilled (the last prompt token is never looked up)
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, max_bytes: int, block_size: int = PREFILL_CHUNK) -> None:
        if max_bytes < 0:
            raise ValueError(f"the prefix cache's size must be >= 0 bytes, got {max_bytes}")
        if block_size % PREFILL_CHUNK:
            raise ValueError(f"blocks must end on prefill chunk boundaries (multiples of {PREFILL_CHUNK})")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.nbytes = 0
        self.stats = PrefixCacheStats()
        self._blocks: collections.OrderedDict[BlockKey, _Block] = collections.OrderedDict()  # oldest use first
        self._ids = itertools.count(1)

    def clear(self) -> None:
        """Drop every block (their keys came from weights no longer loaded); the counts in `stats` stay."""
        self._blocks.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def _chain(self, token_ids: list[int]) -> list[_Block]:
        """The cached blocks that start token_ids, in order."""
        chain: list[_Block] = []
        parent = 0
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            block = self._blocks.get((parent, tuple(token_ids[start : start + self.block_size])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        return chain

    def load(self, token_ids: list[int], cache: KVCache) -> int:
        """Copy the longest cached prefix of token_ids into an empty one-row cache; returns its length."""
        if int(cache.lengths[0]) != 0:
            raise ValueError("the prefix goes into an empty cache row")
        chain = self._chain(token_ids)
        for index, block in enumerate(chain):
            span = slice(index * self.block_size, (index + 1) * self.block_size)
            for layer, (keys, values) in enumerate(zip(block.keys, block.values)):
                cache.keys[layer][0, :, span] = keys
                cache.values[layer][0, :, span] = values
            self._blocks.move_to_end(block.key)
        reused = len(chain) * self.block_size
        cache.lengths[0] = reused
        self.stats.hit_tokens += reused
        self.stats.missed_tokens += len(token_ids) - reused
        return reused

    def hidden_states(self, token_ids: list[int], length: int) -> torch.Tensor | None:
        """The last hidden states (length, C) the cached blocks of token_ids' first `length` tokens hold (what
        `load` gave), or None where a block lacks them."""
        chain = self._chain(token_ids)[: length // self.block_size]
        if not chain or any(block.hidden is None for block in chain):
            return None
        return torch.cat([block.hidden for block in chain])

    def store(self, token_ids: list[int], cache: KVCache, hidden: torch.Tensor | None = None) -> None:
        """Keep the whole blocks of token_ids that a one-row cache holds committed and this cache lacks; with
        hidden ((T, C), the target's last hidden states of token_ids' first T tokens), theirs too, and a block
        kept without them gets them."""
        if self.max_bytes == 0:
            return
        committed = min(int(cache.lengths[0]), len(token_ids))
        parent_key: BlockKey | None = None
        parent = 0
        for start in range(0, committed - self.block_size + 1, self.block_size):
            key = (parent, tuple(token_ids[start : start + self.block_size]))
            block = self._blocks.get(key)
            if block is None:
                span = slice(start, start + self.block_size)
                keys, values = [k[0, :, span] for k in cache.keys], [v[0, :, span] for v in cache.values]
                if _nbytes(keys + values) > self.max_bytes:
                    return  # a block larger than the whole budget: nothing is copied
                block = _Block(
                    next(self._ids), key, parent_key, [k.clone() for k in keys], [v.clone() for v in values],
                    _span(hidden, start, self.block_size),
                )
                self._blocks[key] = block
                self.nbytes += block.nbytes
                self.stats.stored_blocks += 1
                if parent_key is not None:
                    self._blocks[parent_key].children += 1
                self._evict(keep=key)
                if key not in self._blocks:
                    return
            else:
                self._blocks.move_to_end(key)
                if block.hidden is None and (states := _span(hidden, start, self.block_size)) is not None:
                    block.hidden = states
                    self.nbytes += _nbytes([states])
                    self._evict(keep=key)
                    if key not in self._blocks:
                        return
            parent_key, parent = key, block.id

    def _evict(self, keep: BlockKey) -> None:
        """Drop least recently used leaf blocks (never `keep` or its ancestors) until within max_bytes."""
        protected: set[BlockKey] = set()
        key: BlockKey | None = keep
        while key is not None:
            protected.add(key)
            key = self._blocks[key].parent
        while self.nbytes > self.max_bytes:
            victim = next((k for k, b in self._blocks.items() if b.children == 0 and k not in protected), None)
            if victim is None:  # only the chain being stored is left: drop its newest block
                victim = keep
            block = self._blocks.pop(victim)
            self.nbytes -= block.nbytes
            self.stats.evicted_blocks += 1
            if block.parent is not None and block.parent in self._blocks:
                self._blocks[block.parent].children -= 1
            if victim == keep:
                return
