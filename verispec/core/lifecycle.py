"""A request's life after submit: cancels, deadlines, faults of its own, its events, and its row when it leaves."""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from verispec.core.requests import Sequence, SequenceEvent
from verispec.sampling import TokenLogprob

log = logging.getLogger("verispec.scheduler")


class Lifecycle:
    """The scheduler's room for ending sequences (a mixin of Scheduler): one request's failure ends that request
    alone (`_try`, `_guarded`); a finished one streams its last event and leaves its row, and the rows left move
    down to 0 .. n-1 (`_retire`)."""

    def _end_overdue(self, now: float) -> None:
        """Sequences past their deadline end as if max_new_tokens were reached, with what they generated."""
        def overdue(sequence: Sequence) -> bool:
            return sequence.deadline is not None and now >= sequence.deadline

        self._retire([s for s in self.active if overdue(s)], "length")
        if self._prefilling is not None and overdue(self._prefilling):
            self._finish(self._prefilling, "length")
            self._prefilling = None
        with self._lock:
            ended = [s for s in self._waiting if overdue(s)]
            if ended:
                self._waiting = collections.deque(s for s in self._waiting if not overdue(s))
        for sequence in ended:
            self._finish(sequence, "length")

    def _fail_all(self, message: str) -> None:
        self._fail_active(message)
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for sequence in waiting:
            sequence.handle._put(SequenceEvent("", [], "error", sequence.stats.snapshot(), message))
        self._report_queue()

    def _drop_cancelled_waiting(self) -> None:
        with self._lock:
            cancelled = [s for s in self._waiting if s.handle.cancelled.is_set()]
            if cancelled:
                self._waiting = collections.deque(s for s in self._waiting if not s.handle.cancelled.is_set())
        for sequence in cancelled:
            self._finish(sequence, "cancelled")

    def _fail_active(self, message: str) -> None:
        """End every active sequence (and the prompt going in) with an error event; their rows are simply reused."""
        for sequence in self.active + ([self._prefilling] if self._prefilling is not None else []):
            sequence.handle._put(SequenceEvent("", [], "error", sequence.stats.snapshot(), message))
            if self.metrics is not None:
                self.metrics.request_finished("error", sequence.stats.prompt_tokens, sequence.stats.completion_tokens)
        self.active, self._prefilling = [], None
        self._report_queue()

    def _try(self, sequence: Sequence, work: Callable, *args, default=None):
        """work(*args) on behalf of an active sequence; if it raises, the sequence is marked faulty (it takes no
        further part in this step and ends alone after it) and `default` is returned, as it is for a faulty one."""
        if sequence.fault is not None:
            return default
        try:
            return work(*args)
        except Exception as error:  # noqa: BLE001 - one request's failure is its own
            sequence.fault = error
            return default

    def _guarded(self, sequence: Sequence, work: Callable, *args) -> bool:
        """Run work(*args) on behalf of a sequence not yet in `active` (see _try); if it raises, end that
        sequence alone with an error event and return False."""
        self._try(sequence, work, *args)
        if sequence.fault is not None:
            self._end_with_fault(sequence, sequence.fault)
            return False
        return True

    def _end_with_fault(self, sequence: Sequence, error: BaseException) -> None:
        """Log a sequence's failure with its traceback and end it with an error event naming its request id
        (no internals in the message)."""
        log.error(
            "request %s failed: %s: %s", sequence.handle.request_id, type(error).__name__, error,
            exc_info=(type(error), error, error.__traceback__),
        )
        message = f"generation failed for request {sequence.handle.request_id} ({type(error).__name__}); see the server log"
        self._finish(sequence, "error", message, error)

    def _emit(
        self, sequence: Sequence, tokens: list[int], now: float, logprobs: list[TokenLogprob] | None = None
    ) -> str | None:
        """Stream one step's tokens of a sequence; the finish reason when it is done (eos, stop, length)."""
        text = sequence.text
        before = sequence.generated
        finish_reason = text.add_step(tokens, sequence.eos, sequence.config.max_new_tokens)
        added = text.token_ids[before:]
        stats = sequence.stats
        if added and stats.time_to_first_token is None:
            stats.time_to_first_token = now - sequence.submitted
            if self.metrics is not None:
                self.metrics.first_token(stats.time_to_first_token)
        elif added and self.metrics is not None:
            self.metrics.token_latency((now - sequence.last_emit) / len(added), len(added))
        if added:
            sequence.last_emit = now
            if self.metrics is not None:
                self.metrics.tokens_generated(len(added))
        stats.new_tokens = sequence.generated
        if finish_reason is not None:
            stats.total_seconds = now - sequence.submitted
        released = text.release(final=finish_reason is not None)
        kept = None if logprobs is None else logprobs[: len(added)]  # tokens past max_tokens or eos are dropped
        sequence.handle._put(SequenceEvent(released, added, finish_reason, stats.snapshot(), logprobs=kept))
        return finish_reason

    def _retire(self, sequences: list[Sequence], reason: str, emitted: bool = False) -> None:
        """Remove finished or cancelled sequences and move the survivors down to rows 0 .. n-1."""
        if not sequences:
            return
        leaving = {id(s) for s in sequences}
        for sequence in sequences:
            if sequence.fault is not None:
                self._end_with_fault(sequence, sequence.fault)
            elif not emitted:
                self._finish(sequence, reason)
            elif self.metrics is not None:
                stats = sequence.stats
                self.metrics.request_finished(reason, stats.prompt_tokens, stats.completion_tokens)
        survivors = [s for s in self.active if id(s) not in leaving]
        rows = {id(s): row for row, s in enumerate(self.active)}
        for row, sequence in enumerate(survivors):
            old = rows[id(sequence)]
            if old != row:
                self.cache.move_row(old, row)
                for proposer in (self.draft, self.own):
                    if proposer is not None:
                        proposer.move(old, row)
        if self._prefilling is not None and len(survivors) != len(self.active):  # its row follows the active ones
            self.cache.move_row(len(self.active), len(survivors))
        self.active = survivors
        self._report_queue()

    def _finish(
        self, sequence: Sequence, reason: str, error: str | None = None, exception: BaseException | None = None
    ) -> None:
        """End a sequence that has not sent its final event yet (cancelled, or "error" with a message)."""
        stats = sequence.stats
        stats.total_seconds = time.perf_counter() - sequence.submitted
        rest = sequence.text.release(final=True) if reason == "length" else ""  # a deadline: the text held back
        sequence.handle._put(SequenceEvent(rest, [], reason, stats.snapshot(), error, exception=exception))
        if self.metrics is not None:
            self.metrics.request_finished(reason, stats.prompt_tokens, stats.completion_tokens)

    def _report_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(len(self.active), self.num_waiting)
