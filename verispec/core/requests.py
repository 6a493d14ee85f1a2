"""A request as the step sees it: its limits, its events to the caller, and its state while it decodes."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import torch

from verispec.config import GenerationConfig
from verispec.grammar import Grammar
from verispec.sampling import TokenLogprob
from verispec.stats import GenerationStats
from verispec.stopping import TextAssembler


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int = 16  # sequences decoded together; later requests wait in a queue
    max_waiting: int = 256  # queued requests beyond this are refused (HTTP 429)
    max_context: int = 4096  # prompt + max_new_tokens per sequence (each KV cache row holds this many)
    prefix_cache_bytes: int = 1 << 30  # keys and values of shared prompt prefixes kept for reuse; 0: none


class QueueFullError(RuntimeError):
    """Too many requests waiting: the client should retry later."""


@dataclass
class SequenceEvent:
    text: str  # newly released text, possibly ""
    token_ids: list[int]  # newly generated token ids
    finish_reason: str | None = None  # None while running; "stop", "length", "cancelled" or "error"
    stats: GenerationStats = field(default_factory=GenerationStats)  # a snapshot; final when finish_reason is set
    error: str | None = None  # message when finish_reason == "error"
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked for them
    exception: BaseException | None = field(default=None, repr=False)  # what failed (in-process callers re-raise it)


class RequestHandle:
    """The caller's side of one request: its events, and a way to cancel it."""

    _ids = itertools.count(1)

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.request_id = f"req-{next(self._ids)}"
        self.cancelled = threading.Event()
        self._loop = loop
        self._async_queue: asyncio.Queue[SequenceEvent] | None = asyncio.Queue() if loop is not None else None
        self._sync_queue: queue.Queue[SequenceEvent] = queue.Queue()

    def cancel(self) -> None:
        """Thread-safe; the scheduler frees the sequence's row before its next step."""
        self.cancelled.set()

    def _put(self, event: SequenceEvent) -> None:  # called from the scheduler thread
        if self._async_queue is None:
            self._sync_queue.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._async_queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel()

    async def events(self) -> AsyncIterator[SequenceEvent]:
        """Events until (and including) the one with finish_reason set. Needs submit() from this loop."""
        if self._async_queue is None:
            raise RuntimeError("events() needs the request submitted from a running event loop; use iter_events()")
        while True:
            event = await self._async_queue.get()
            yield event
            if event.finish_reason is not None:
                return

    def iter_events(self) -> Iterator[SequenceEvent]:
        """Blocking version of events(), for requests submitted outside an event loop."""
        while True:
            event = self._sync_queue.get()
            yield event
            if event.finish_reason is not None:
                return


@dataclass
class Sequence:
    handle: RequestHandle
    prompt_ids: list[int]
    config: GenerationConfig
    tokens: list[int]  # every committed token; the last one is pending (not yet in the target cache)
    generator: torch.Generator
    text: TextAssembler
    eos: frozenset[int]
    submitted: float
    grammar: Grammar | None = None  # structured output: the tokens its JSON schema allows, at the committed state
    stats: GenerationStats = field(default_factory=GenerationStats)
    last_emit: float = 0.0
    prefilled: int = 0  # prompt tokens in the target cache (all but the last, once decoding)
    chunk_credit: float = 0.0  # seconds of the streams' steps saved up for its next packed chunk (prompt_chunk)
    deadline: float | None = None  # time.perf_counter(): then it ends as if max_new_tokens were reached
    prompt_source: "Sequence | None" = None  # another choice of the same request: its prompt's cache rows are copied
    # Per-sequence k: by drafter source, how often each draft position was reached and accepted.
    position_hits: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    fault: BaseException | None = None  # what went wrong on this sequence's behalf this step: it ends alone
    # A draft head's input: the target's hidden states of its prompt, (position, (T, C)) per forward, until it decodes.
    prompt_features: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.text.token_ids)

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - (len(self.tokens) - len(self.prompt_ids))

    @property
    def draft_cap(self) -> int:
        """The most draft tokens this sequence may take in a step: its request's cap, and what it can still use."""
        cap = self.config.max_draft_tokens
        return self.remaining - 1 if cap is None else min(cap, self.remaining - 1)
