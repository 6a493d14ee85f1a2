"""What one step did, as data: the record the scheduler hands to whoever observes its steps.

A step drafts for some rows, runs one target forward over every row's pending token and drafts (and, where a
prompt is being admitted, a chunk of that prompt), verifies each row and commits what was accepted. Metrics,
the library's results and the benchmarks read these records; nothing needs to wrap the step to see it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RowStep:
    """One decoding row's part of a step."""

    source: str | None  # who proposed its drafts ("draft-model", "suffix-index", ...); None: it drafted nothing
    drafted: int  # draft tokens the forward verified for it
    accepted: int  # of those, accepted; -1: the row faulted and committed nothing


@dataclass(frozen=True)
class StepRecord:
    """One step of the batch: rows in batch order, its drafting, its target forward and its length."""

    rows: tuple[RowStep, ...]
    draft_seconds: dict[str, float]  # source -> seconds the batch spent drafting with it (catch-ups included)
    forward_tokens: int  # the rows' tokens in the target forward: each row's pending token and its drafts
    chunk_tokens: int  # prompt tokens of a sequence being admitted that the same forward carried
    forward_seconds: float  # the target forward, verification and commit
    seconds: float  # the whole step, from choosing k to streaming its tokens

    @property
    def deepest(self) -> int:
        """The most draft tokens any row verified."""
        return max((row.drafted for row in self.rows), default=0)

    @property
    def drafted_by_position(self) -> list[int]:
        """[i]: rows that drafted position i."""
        return [sum(row.drafted > i and row.accepted >= 0 for row in self.rows) for i in range(self.deepest)]

    @property
    def accepted_by_position(self) -> list[int]:
        """[i]: rows whose draft at position i was accepted."""
        return [sum(row.accepted > i for row in self.rows) for i in range(self.deepest)]


class StepMetrics(Protocol):
    """What the scheduler reports as it runs (the server's Prometheus metrics implement it)."""

    def step(self, record: StepRecord) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def token_latency(self, seconds_per_token: float, tokens: int) -> None: ...
    def tokens_generated(self, count: int) -> None: ...
    def request_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None: ...
    def prefix_lookup(self, hit_tokens: int, missed_tokens: int, cache_bytes: int) -> None: ...
    def set_queue(self, active: int, waiting: int) -> None: ...
