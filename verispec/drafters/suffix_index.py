"""Suffix index: propose the continuation with the most support in everything seen so far.

The index is a depth-bounded suffix tree (a suffix trie cut at `depth` tokens) whose nodes count
how often their string occurred. Appending a token touches at most `depth` nodes, and proposing a
token looks at most `depth` nodes, so the cost stays constant however long the text grows (unlike
a rescan, which is linear in the text per step). Counts let a proposal follow the most frequent
continuation of the longest matching context rather than merely the latest one.

The request's own text (prompt plus generated) is indexed as it grows; a corpus the user supplies
(files or a directory, e.g. their code base) is indexed once and shared by all requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.sampling import SamplingParams


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.count = 0  # occurrences of the string this node spells


class SuffixTrie:
    """All substrings of up to `depth` tokens of the indexed sequences, with occurrence counts."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node()
        self.tokens_indexed = 0

    def add_sequence(self, tokens: Iterable[int]) -> None:
        active = [self.root]
        for token in tokens:
            active = self.extend(active, token)

    def extend(self, active: list[Node], token: int) -> list[Node]:
        """Insert `token` after the suffixes `active` (index = suffix length); return the new suffixes."""
        grown = [self.root]
        for node in active[: self.depth]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
            child.count += 1
            grown.append(child)
        self.tokens_indexed += 1
        return grown

    def follow(self, active: list[Node], token: int) -> list[Node]:
        """Track the context's suffixes in this trie without inserting (for a read-only corpus)."""
        grown = [self.root]
        for node in active[: self.depth]:
            child = node.children.get(token)
            if child is None:
                break  # longer suffixes cannot match either
            grown.append(child)
        return grown


def best_continuation(trie: SuffixTrie, active: list[Node], k: int, min_match: int) -> tuple[list[int], int]:
    """Up to k tokens, each the most supported successor of the longest recurring context suffix.

    After each proposed token the context's suffixes are advanced in the trie (read-only), so a
    proposal is not cut short by the depth bound. Returns (tokens, length of the first match);
    ([], 0) when no suffix of at least min_match tokens has occurred with a continuation.
    """
    proposal: list[int] = []
    first_match = 0
    while len(proposal) < k:
        matched = next(
            (length for length in range(len(active) - 1, min_match - 1, -1) if active[length].children), None
        )
        if matched is None:
            break
        first_match = first_match or matched
        token = max(active[matched].children.items(), key=lambda item: item[1].count)[0]
        proposal.append(token)
        active = trie.follow(active, token)
    return proposal, first_match


def _has_continuation(active: list[Node], min_match: int) -> bool:
    """Whether a context suffix of at least min_match tokens has occurred with a continuation."""
    return any(node.children for node in active[min_match:])


def corpus_token_stream(paths: list[Path], encode: Callable[[str], list[int]]) -> Iterable[list[int]]:
    """Token ids of every text file under the given files or directories (binary files skipped)."""
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"corpus path {path} does not exist")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield encode(text)


class SuffixIndexDrafter(Drafter):
    source = "suffix-index"
    tells_if_it_proposes = True

    def __init__(self, depth: int = 16, min_match: int = 2, corpus: SuffixTrie | None = None) -> None:
        if depth < 2 or not 1 <= min_match < depth:
            raise ValueError(f"suffix index needs depth >= 2 and 1 <= min_match < depth, got {depth}, {min_match}")
        self.depth, self.min_match = depth, min_match
        self.corpus = corpus
        self.trie = SuffixTrie(depth)
        self.active: list[Node] = [self.trie.root]
        self.corpus_active: list[Node] = [corpus.root] if corpus else []
        self.seen = 0  # tokens of the request already indexed

    @classmethod
    def with_corpus(cls, paths: list[Path], encode: Callable[[str], list[int]], depth: int = 16, min_match: int = 2):
        corpus = SuffixTrie(depth)
        for tokens in corpus_token_stream(paths, encode):
            corpus.add_sequence(tokens)
        return cls(depth, min_match, corpus)

    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        self.trie = SuffixTrie(self.depth)
        self.active = [self.trie.root]
        self.corpus_active = [self.corpus.root] if self.corpus else []
        self.seen = 0

    def _index(self, tokens: list[int]) -> None:
        """Add the committed tokens not indexed yet (they are final, so the index only ever grows)."""
        for token in tokens[self.seen:]:
            self.active = self.trie.extend(self.active, token)
            if self.corpus is not None:
                self.corpus_active = self.corpus.follow(self.corpus_active, token)
        self.seen = len(tokens)

    def can_propose(self, tokens: list[int]) -> bool:
        """Whether propose(tokens, ...) would find a recurring context (cheap: at most depth nodes)."""
        self._index(tokens)
        return any(
            _has_continuation(active, self.min_match) for active in (self.active, self.corpus_active) if active
        )

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        self._index(tokens)
        own, own_length = best_continuation(self.trie, self.active, k, self.min_match)
        found = own
        if self.corpus is not None:
            shared, shared_length = best_continuation(self.corpus, self.corpus_active, k, self.min_match)
            if shared_length > own_length:
                found = shared
        return Proposal(torch.tensor([found], dtype=torch.long).reshape(1, -1), None, 0, self.source)
