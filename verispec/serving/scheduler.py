"""Continuous batching: every active request advances by one speculative step per batched target forward.

One thread owns the models. Each iteration it
  1. admits waiting requests into free cache rows (after the longest prefix of each prompt whose keys and
     values the prefix cache holds; with chunked_prefill, one prompt at a time, in chunks that take the
     prompts' share of each step while others decode (a short one at once): inside the step's own forward where the target is
     batch-invariant, else by forwards of their own) and drops cancelled ones,
  2. asks the controller for k given the batch size and the drafter (with k_per_sequence, refined row by
     row by each sequence's own acceptance), drafts for every active sequence (one batched draft forward
     per position, or each sequence's model-free drafter; composite: each sequence's suffix index where
     its context recurs, the batched draft model for the rest),
  3. verifies all drafts in ONE target forward: ragged prefixes are handled by per-row cache lengths and
     positions; a batch-invariant target packs each row's [pending, drafts...] as it is, beside the
     prompt chunk (Transformer.forward_packed), any other pads rows to the longest draft (padding is
     never committed),
  4. accepts/rejects per sequence with `verify` (its own sampling settings and generator), commits,
     streams text, and retires finished sequences, compacting rows so active ones stay at 0 .. n-1.

The target cache invariant is the engine's: each row holds its committed tokens except the newest
(pending) one, which is the first input of the next verify pass. Greedy output is therefore the
target's own argmax chain, the same tokens a single request gets through the library.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator

import torch

from verispec.drafters import CrossTokenizerDrafter, composite_lookup, make_drafter, quantize_draft
from verispec.drafters.draft_format import replace_format
from verispec.drafters.base import LONG_TAIL, BatchedProposer, Drafter, Proposal, as_drafter, cut_to_grammar
from verispec.config import GenerationConfig
from verispec.core.step_record import RowStep, StepRecord
from verispec.grammar import Grammar, SchemaError, compiler_for, constraint_for
from verispec.models.forward_cost import step_costs
from verispec.models.loading import LoadedModel, load_model
from verispec.models.machine import forget_choice
from verispec.models.transformer import PREFILL_CHUNK, Transformer
from verispec.policy import (
    AdaptiveController, ControllerSettings, estimated_forward_seconds, moving_average, prompt_chunk,
)
from verispec.sampling import TokenHistory, TokenLogprob, logits_to_probs, token_logprobs
from verispec.drafters.batch_draft import PAD_TOKEN, BatchedDraftModel
from verispec.drafters.batch_head import BatchedDraftHead
from verispec.drafters.draft_head import HeadLayer
from verispec.serving.prefix_cache import PrefixCache
from verispec.stats import GenerationStats
from verispec.stopping import TextAssembler
from verispec.verify import verify, verify_greedy

if TYPE_CHECKING:
    from verispec.serving.metrics import ServerMetrics

log = logging.getLogger("verispec.scheduler")

SERVED_DRAFTERS = ("draft-model", "prompt-lookup", "suffix-index", "composite", "cross-tokenizer", "none")
# Drafters with a (batched) draft model; composite asks each sequence's suffix index first.
MODEL_DRAFTERS = ("draft-model", "composite")


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
class _Sequence:
    handle: RequestHandle
    prompt_ids: list[int]
    config: GenerationConfig
    tokens: list[int]  # every committed token; the last one is pending (not yet in the target cache)
    generator: torch.Generator
    text: TextAssembler
    eos: frozenset[int]
    submitted: float
    drafter: Drafter | None = None  # a model-free drafter of its own (the draft model is shared, batched)
    grammar: Grammar | None = None  # structured output: the tokens its JSON schema allows, at the committed state
    stats: GenerationStats = field(default_factory=GenerationStats)
    last_emit: float = 0.0
    prefilled: int = 0  # prompt tokens in the target cache (all but the last, once decoding)
    chunk_credit: float = 0.0  # seconds of the streams' steps saved up for its next packed chunk (prompt_chunk)
    deadline: float | None = None  # time.perf_counter(): then it ends as if max_new_tokens were reached
    prompt_source: "_Sequence | None" = None  # another choice of the same request: its prompt's cache rows are copied
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


class Scheduler:
    def __init__(
        self,
        target: LoadedModel,
        draft_model: Transformer | HeadLayer | None = None,
        drafter: str = "none",
        k: int | str = "auto",
        k_max: int = 8,
        limits: SchedulerLimits = SchedulerLimits(),
        metrics: "ServerMetrics | None" = None,
        chunked_prefill: bool = False,
        k_per_sequence: bool = False,
        sequence_drafter: Callable[[], Drafter] | None = None,
        controller: AdaptiveController | None = None,
        synchronous: bool = False,
    ) -> None:
        """draft_model: a same-tokenizer draft model, or a draft head over the target's hidden states (draft_head).
        drafter: one of SERVED_DRAFTERS, or with `sequence_drafter` (a library's own drafter, made for each
        sequence) the name its statistics go by: "composite" when a draft model drafts where it finds nothing.
        controller: one that measured this machine and model pair before (the library keeps one across requests).
        synchronous: requests are submitted and run_once driven by one thread that reads its events itself.
        """
        if sequence_drafter is None and drafter not in SERVED_DRAFTERS:
            raise ValueError(f"the server's drafter must be one of {', '.join(SERVED_DRAFTERS)}, got {drafter!r}")
        if drafter in MODEL_DRAFTERS and draft_model is None:
            raise ValueError(f"drafter {drafter!r} needs a draft model")
        if drafter == "cross-tokenizer" and sequence_drafter is None:
            raise ValueError("drafter 'cross-tokenizer' needs each sequence's drafter (sequence_drafter)")
        if drafter not in MODEL_DRAFTERS and draft_model is not None:
            raise ValueError(f"drafter {drafter!r} uses no draft model; only {' and '.join(MODEL_DRAFTERS)} do")
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"k must be 'auto' or an integer >= 0, got {k!r}")
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        for name in ("max_batch_size", "max_waiting", "max_context"):
            if getattr(limits, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(limits, name)}")
        if limits.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {limits.prefix_cache_bytes}")
        model_context = target.model.config.max_position_embeddings
        if limits.max_context > model_context:
            raise ValueError(
                f"max_context {limits.max_context} exceeds the target's context of {model_context} tokens"
            )
        self.target = target
        self.drafter = drafter
        self.k = k if drafter != "none" else 0
        self.k_max = k_max if k == "auto" else max(int(k), 1)
        self.limits = limits
        self.metrics = metrics
        self.step_observers: list[Callable[[StepRecord], None]] = []  # each called with every step's record
        self.chunked_prefill = chunked_prefill  # False: every waiting prompt goes in whole before the next step
        # With k auto: each sequence its own k, by its own acceptance (AdaptiveController.choose_row_ks); else one per source.
        self.k_per_sequence = k_per_sequence and k == "auto"
        # A batch-invariant target takes a prompt's chunks inside the decoding step's own forward (the chunk's keys
        # get the bits of a whole prefill either way); any other gets them by forwards of their own, on boundaries.
        self.packs_prefill = chunked_prefill and target.model.batch_invariant
        self._packed_seconds: dict[int, float] = {}  # tokens in all -> seconds of a forward that carried a chunk
        self.controller = controller or AdaptiveController(ControllerSettings(k_max=self.k_max))
        self.synchronous = synchronous
        # Each sequence's own drafter (model-free lookups; composite: its suffix index beside the batched model).
        self.new_drafter: Callable[[], Drafter] | None = sequence_drafter
        if sequence_drafter is None and drafter in ("prompt-lookup", "suffix-index", "composite"):
            self.new_drafter = composite_lookup if drafter == "composite" else lambda: make_drafter(drafter, target)
        # Room for the verify pass's draft tokens after the longest sequence.
        capacity = limits.max_context + self.k_max + 2
        self.cache = target.model.new_cache(limits.max_batch_size, capacity)
        self.prefix_cache = PrefixCache(limits.prefix_cache_bytes) if limits.prefix_cache_bytes else None
        self.draft: BatchedProposer | None = None
        if isinstance(draft_model, HeadLayer):
            self.draft = BatchedDraftHead(draft_model, target.model.vocab_size, limits.max_batch_size, capacity)
        elif draft_model is not None:
            self.draft = BatchedDraftModel(draft_model, target.model.vocab_size, limits.max_batch_size, capacity)
        self.batched_source = self.draft.source if self.draft is not None else BatchedDraftModel.source
        # The target's forwards hand on their hidden states (a draft head's input).
        self.feeds_head = self.draft is not None and self.draft.needs_hidden_states
        self.draft_format_replacements = 0  # how often a draft format found slow while drafting was replaced
        self.target_format_replacements = 0  # how often a target format found slow while serving was replaced
        self._remembered_costs: str | None = None  # the remembered step costs' kind, until a step checked them
        if self.k == "auto" and not self.controller.verify_cost:
            # The first steps choose by the forwards' costs (remembered per machine), not by trying: where no draft
            # can pay, the first request does not pay for learning it (a prompt's catch-up, a k of first_k).
            costs = step_costs(target, None if self.feeds_head else draft_model)
            if self.feeds_head:  # a few milliseconds to time: not remembered
                costs["draft"], costs["catch_up_per_token"] = self.draft.timed_costs()
            drafts = {self.batched_source: costs["draft"]} if costs["draft"] is not None else {}
            self.controller.seed(costs["verify"], drafts, costs["catch_up_per_token"])
            self._remembered_costs = costs["remembered"]
        self.active: list[_Sequence] = []  # active[i] lives in cache row i
        self._prefilling: _Sequence | None = None  # the prompt going in, in row len(active)
        self._step_seconds: float | None = None  # moving average of a decoding step
        # The share of rows whose lookup could propose when the lookups were last asked (None: never asked yet)
        self._lookup_share: float | None = None
        self._steps_since_lookups = 0  # steps since the lookups were last asked
        self._prefill_token_seconds: float | None = None  # moving average of a prompt token's prefill
        self._waiting: collections.deque[_Sequence] = collections.deque()  # submitted, not yet admitted
        self._lock = threading.Lock()  # guards _waiting and the admission check
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    # -- the caller's side ------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        """Requests holding a cache row: decoding, or their prompt going in."""
        return len(self.active) + (self._prefilling is not None)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a row (cancelled ones no longer count)."""
        return sum(not s.handle.cancelled.is_set() for s in list(self._waiting))

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="verispec-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, prompt_ids: list[int], config: GenerationConfig) -> RequestHandle:
        """Queue a request; its events arrive on the returned handle.

        Raises ValueError for a request that can never run (empty, longer than max_context, a JSON schema
        the grammar engine cannot compile: SchemaError), QueueFullError when max_waiting requests already
        wait beyond the free batch rows, and RuntimeError once the scheduler was stopped or its loop died.
        """
        return self.submit_choices(prompt_ids, [config])[0]

    def submit_choices(
        self, prompt_ids: list[int], configs: list[GenerationConfig], request_id: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None, deadline: float | None = None,
    ) -> list[RequestHandle]:
        """Queue n sequences of one prompt (OpenAI's n), all or none; one handle each, in order.

        The prompt is prefilled once: the other choices copy its keys and values (target and draft) when
        they get a row, while the first one still decodes (else the prefix cache, else a prefill).
        Errors as for submit; a request with more choices than max_batch_size is a ValueError.
        request_id names the request in the log (else one is made); loop: the event loop its events go to
        (default: the running one, if any); deadline (time.perf_counter()): a sequence still queued or decoding
        then ends as if it had reached its max_new_tokens (finish_reason "length").
        """
        if len(configs) > self.limits.max_batch_size:
            raise ValueError(f"{len(configs)} choices exceed the batch of {self.limits.max_batch_size} sequences")
        if self._stopping.is_set() or self.failure is not None:
            raise RuntimeError("the scheduler is not running")
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        if loop is None and not self.synchronous:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
        sequences = [self._new_sequence(prompt_ids, config, loop) for config in configs]
        for index, choice in enumerate(sequences):
            choice.deadline = deadline
            if request_id is not None:
                choice.handle.request_id = request_id if len(sequences) == 1 else f"{request_id}/{index}"
        for choice in sequences[1:]:
            choice.prompt_source = sequences[0]
        with self._lock:
            free_rows = self.limits.max_batch_size - self.num_active
            if self.num_waiting + len(sequences) > self.limits.max_waiting + max(free_rows, 0):
                raise QueueFullError(f"{self.limits.max_waiting} requests are already waiting; retry later")
            self._waiting.extend(sequences)
        self._report_queue()
        self._wakeup.set()
        return [sequence.handle for sequence in sequences]

    def _new_sequence(
        self, prompt_ids: list[int], config: GenerationConfig, loop: asyncio.AbstractEventLoop | None = None
    ) -> _Sequence:
        total = len(prompt_ids) + config.max_new_tokens
        if total > self.limits.max_context:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({config.max_new_tokens}) = {total} exceeds the "
                f"server's context of {self.limits.max_context} tokens; shorten the prompt or lower max_tokens"
            )
        eos = config.eos_token_ids if config.eos_token_ids is not None else self.target.eos_token_ids
        grammar = constraint_for(self.target, config.json_schema, config.lark_grammar, eos)
        return _Sequence(
            handle=RequestHandle(loop),
            prompt_ids=list(prompt_ids),
            config=config,
            tokens=list(prompt_ids),
            generator=torch.Generator().manual_seed(config.seed),
            text=TextAssembler(self.target.decode, config.stop_strings),
            eos=frozenset(eos),
            submitted=time.perf_counter(),
            grammar=grammar,
            stats=GenerationStats(prompt_tokens=len(prompt_ids), controller=self.controller),
        )

    # -- the model thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self.run_once():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
            except Exception as error:  # noqa: BLE001 - a batched forward failed: fail the batch, keep serving
                log.exception("a decoding step failed for every sequence in it")
                self._fail_active(f"decoding failed ({type(error).__name__}); see the server log")
            except BaseException as error:  # a dead model thread must show in /health, and no caller may hang
                self.failure = error
                self._fail_all(f"the decoding loop stopped: {type(error).__name__}")
                raise
        self._fail_all("the server is shutting down")

    def run_once(self) -> bool:
        """One turn of the model thread's loop: drop cancelled requests, admit prompts, one decoding step.
        False when nothing is left to do: no row decoding, no prompt going in and none waiting (a step that
        ends every row leaves the waiting prompts for the next turn, at once). (Tests call it directly, to
        place requests at exact steps.)"""
        self._retire([s for s in self.active if s.handle.cancelled.is_set()], "cancelled")
        self._drop_cancelled_waiting()
        if self._prefilling is not None and self._prefilling.handle.cancelled.is_set():
            self._finish(self._prefilling, "cancelled")
            self._prefilling = None
        self._end_overdue(time.perf_counter())
        if not self.active and self._prefilling is None and self.num_waiting == 0:
            self._replace_slow_target()
        self._admit()
        if self.active:
            self._step()
        return bool(self.active) or self._prefilling is not None or self.num_waiting > 0

    def _end_overdue(self, now: float) -> None:
        """Sequences past their deadline end as if max_new_tokens were reached, with what they generated."""
        def overdue(sequence: _Sequence) -> bool:
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

    def _admit(self) -> None:
        """Prompts go in one at a time, first come first served, in row len(active) (chunked prefill).

        With nothing decoding, a prompt goes in whole. Else it gets the prompts' share of this step
        (see prefill_budget) and the rest in later steps, so the active streams keep flowing while a
        long prompt goes in, and a request starts decoding (its first token comes with the next
        step) as soon as its own prompt is in. Without chunked_prefill, every waiting prompt goes in
        whole before the next step. A prompt with nothing left to feed (one token, all of it in the
        prefix cache, another choice's copy) decodes at once. A failure on one prompt's behalf ends
        that request alone.
        """
        while True:
            if self._prefilling is None:
                if len(self.active) >= self.limits.max_batch_size:
                    break
                with self._lock:
                    if not self._waiting:
                        break
                    sequence = self._waiting.popleft()
                if sequence.handle.cancelled.is_set():
                    self._finish(sequence, "cancelled")
                    continue
                if not self._guarded(sequence, self._start_prefill, sequence):
                    continue
            sequence = self._prefilling
            decoding = len(self.active)
            if decoding and self.packs_prefill and sequence.prefilled < len(sequence.prompt_ids) - 1:
                break  # its chunks go in with the decoding steps' own forwards (_step)
            if not self._guarded(sequence, self._prefill_some, sequence, decoding):
                self._prefilling = None
                continue
            if sequence.prefilled < len(sequence.prompt_ids) - 1:
                break  # the rest after the next step
            self._prefilling = None
            if not self._guarded(sequence, self._begin_decoding, decoding, sequence):
                continue
            if decoding and self.chunked_prefill:
                break  # one prompt per step while others decode
        self._report_queue()

    def _prefill_some(self, sequence: _Sequence, row: int) -> None:
        """Feed the prompt going in (row `row`): all of it, or this step's budget of it while others decode."""
        prompt = sequence.prompt_ids[:-1]
        if sequence.prefilled >= len(prompt):
            return
        started = time.perf_counter()
        hidden: list[torch.Tensor] | None = [] if self.feeds_head else None
        fed = self.target.model.prefill(
            prompt[sequence.prefilled :], self.cache.rows(row, row + 1),
            self._prefill_budget(sequence) if row and self.chunked_prefill else None, hidden_out=hidden,
        )
        if hidden:
            sequence.prompt_features.append((sequence.prefilled, torch.cat(hidden)))
        seconds = time.perf_counter() - started
        sequence.stats.prefill_seconds += seconds
        if fed:
            self._prefill_token_seconds = moving_average(self._prefill_token_seconds, seconds / fed, COST_SMOOTHING)
        sequence.prefilled += fed

    def _guarded(self, sequence: _Sequence, work: Callable, *args) -> bool:
        """Run work(*args) on behalf of a sequence not yet in `active` (see _try); if it raises, end that
        sequence alone with an error event and return False."""
        self._try(sequence, work, *args)
        if sequence.fault is not None:
            self._end_with_fault(sequence, sequence.fault)
            return False
        return True

    def _end_with_fault(self, sequence: _Sequence, error: BaseException) -> None:
        """Log a sequence's failure with its traceback and end it with an error event naming its request id
        (no internals in the message)."""
        log.error(
            "request %s failed: %s: %s", sequence.handle.request_id, type(error).__name__, error,
            exc_info=(type(error), error, error.__traceback__),
        )
        message = f"generation failed for request {sequence.handle.request_id} ({type(error).__name__}); see the server log"
        self._finish(sequence, "error", message, error)

    def _prefill_budget(self, sequence: _Sequence) -> int:
        """Prompt tokens to feed this step while others decode: prefill_budget's, on chunk boundaries where
        the model is not batch-invariant (see Transformer.prefill)."""
        tokens = prefill_budget(
            self._step_seconds, self._prefill_token_seconds, 1 + self.num_waiting, len(self.active),
            len(sequence.prompt_ids) - 1 - sequence.prefilled,
        )
        if not self.target.model.batch_invariant:  # end on a chunk boundary
            end = -(-(sequence.prefilled + tokens) // PREFILL_CHUNK) * PREFILL_CHUNK
            tokens = end - sequence.prefilled
        return tokens

    def _start_prefill(self, sequence: _Sequence) -> None:
        """Give the sequence row len(active), holding the longest prefix of its prompt the prefix cache has."""
        row = len(self.active)
        self.cache.lengths[row] = 0
        source = self._row_of(sequence.prompt_source)
        if source is not None:  # another choice of this request decodes: its prompt is in the cache
            sequence.prefilled = len(sequence.prompt_ids) - 1
            self.cache.copy_prefix(source, row, sequence.prefilled)
            sequence.stats.cached_prompt_tokens = sequence.prefilled
        elif self.prefix_cache is not None:
            view = self.cache.rows(row, row + 1)
            sequence.prefilled = self.prefix_cache.load(sequence.prompt_ids[:-1], view)
            sequence.stats.cached_prompt_tokens = sequence.prefilled
            if self.feeds_head and sequence.prefilled:  # the head's input for what was not computed again
                hidden = self.prefix_cache.hidden_states(sequence.prompt_ids[:-1], sequence.prefilled)
                if hidden is not None:
                    sequence.prompt_features.append((0, hidden))
        self._prefilling = sequence

    def _begin_decoding(self, row: int, sequence: _Sequence) -> None:
        """The prompt is in (all but its last token): offer it to the prefix cache, set up drafting, decode."""
        prompt = sequence.prompt_ids
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt[:-1], self.cache.rows(row, row + 1), self._prompt_hidden(sequence))
            if self.metrics is not None:
                reused = sequence.stats.cached_prompt_tokens
                self.metrics.prefix_lookup(reused, len(prompt) - 1 - reused, self.prefix_cache.nbytes)
        if self.draft is not None:
            source = self._row_of(sequence.prompt_source)
            if source is not None:
                self.draft.share_prompt(source, row, len(prompt))
            else:
                self.draft.add(row)  # filled when the sequence first drafts
                for position, features in sequence.prompt_features if self.feeds_head else ():
                    self.draft.observe(row, position, features)
        sequence.prompt_features = []
        sequence.prompt_source = None  # copied or not, it is needed no more
        if self.new_drafter is not None:  # lookup state is per sequence
            started = time.perf_counter()
            sequence.drafter = as_drafter(self.new_drafter())
            sequence.drafter.begin(prompt, len(prompt) + sequence.config.max_new_tokens + self.k_max + 1)
            sequence.stats.prefill_seconds += time.perf_counter() - started
        self.active.append(sequence)

    @staticmethod
    def _prompt_hidden(sequence: _Sequence) -> torch.Tensor | None:
        """The target's last hidden states of the whole prompt but its last token, where a draft head was handed
        them all from the first position on (else None)."""
        if not sequence.prompt_features or sequence.prompt_features[0][0] != 0:
            return None
        parts, end = [], 0
        for position, features in sequence.prompt_features:
            if position != end:
                return None
            parts.append(features)
            end += len(features)
        return torch.cat(parts)

    def _row_of(self, sequence: _Sequence | None) -> int | None:
        """The cache row of an active sequence (by identity); None when it is not decoding."""
        return next((row for row, active in enumerate(self.active) if active is sequence), None)

    def _sources(self) -> list[str | None]:
        """Which drafter proposes for each active row this step (composite: lookup where the context recurs; a
        library's own drafter: what it says it will use, None where it cannot tell)."""
        return [self._try(s, self._source_of, s, default=self.drafter) for s in self.active]

    def _lookups_may_draft(self, batch_size: int) -> bool:
        """Whether a composite's lookups could draft this step, by the controller's plan for them with as many rows
        as found a recurring context when they were last asked (every row before they were); else every row goes to
        the batched drafter and no lookup is asked. Asking costs each row an index update over its newest tokens:
        a busy server where nothing recurs would pay it every step for nothing, and one planned as if every row
        drafted would index every row's backlog to serve the few that do."""
        if self.k != "auto" or self.draft is None or self.new_drafter is None:
            return True
        lookup = next((s.drafter.source or None for s in self.active if s.drafter is not None), None)
        if lookup is None:
            return True
        stale = self._lookup_share is None or self._steps_since_lookups >= LOOKUP_SHARE_STEPS
        rows = None if stale else max(1, round(self._lookup_share * batch_size))
        return self.controller.planned_k(batch_size, lookup, rows) > 0

    def _source_of(self, sequence: _Sequence) -> str | None:
        own = sequence.drafter
        if own is None:
            return self.batched_source if self.draft is not None else self.drafter
        if self.draft is not None:  # composite: the sequence's lookup where it finds something, else the draft model
            return own.source if own.can_propose(sequence.tokens) else self.batched_source
        return own.next_source(sequence.tokens)

    def _try(self, sequence: _Sequence, work: Callable, *args, default=None):
        """work(*args) on behalf of an active sequence; if it raises, the sequence is marked faulty (it takes no
        further part in this step and ends alone after it) and `default` is returned, as it is for a faulty one."""
        if sequence.fault is not None:
            return default
        try:
            return work(*args)
        except Exception as error:  # noqa: BLE001 - one request's failure is its own
            sequence.fault = error
            return default

    def _choose_k(self, batch_size: int, source: str | None, rows: int) -> tuple[int, bool]:
        """k for the `rows` rows `source` drafts for, and whether it is a probe (k = 1 to re-measure acceptance)."""
        if self.drafter == "none":
            return 0, False
        if self.k != "auto":
            return int(self.k), False
        return self.controller.choose_k(batch_size, source, rows), self.controller.probing

    def _k_per_sequence(
        self, k_per_row: list[int], sources: list[str], choices: dict[str, tuple[int, bool]]
    ) -> list[int]:
        """Each source's k (chosen for all its rows, > 0 and not a probe) refined row by row by the rows' own acceptance."""
        k_per_row = list(k_per_row)
        for source, (k, probe) in choices.items():
            rows = [b for b, s in enumerate(sources) if s == source and k_per_row[b] > 0]
            if k == 0 or probe or not rows:
                continue
            acceptance = []
            for b in rows:
                hits, reached = self.active[b].position_hits.get(source, ([0] * self.k_max, [0] * self.k_max))
                acceptance.append(self.controller.row_acceptance(source, hits, reached))
            others = sum(1 + k for b, k in enumerate(k_per_row) if b not in rows)
            caps = [min(self.k_max, self.active[b].draft_cap) for b in rows]
            refined = self.controller.choose_row_ks(len(self.active), source, acceptance, others, caps)
            if refined is not None:
                for b, row_k in zip(rows, refined):
                    k_per_row[b] = row_k
        return k_per_row

    def _draft(
        self, k_per_row: list[int], sources: list[str], probing: bool
    ) -> tuple[list[Proposal], dict[str, float]]:
        """Each row's proposal (trimmed to its k), and the seconds each source spent drafting (catch-up excluded)."""
        active = self.active
        proposals = [Proposal(torch.empty(1, 0, dtype=torch.long), None) for _ in active]
        seconds: dict[str, float] = {}
        model = self.batched_source
        drafting = [k > 0 and source == model and self.draft is not None for k, source in zip(k_per_row, sources)]
        if self.draft is not None and any(drafting) and probing:
            # A probe asks only rows whose draft cache is current (else the first drafting row).
            current = [
                wants and self.draft.behind(row, s.tokens) <= LONG_TAIL
                for row, (wants, s) in enumerate(zip(drafting, active))
            ]
            first = drafting.index(True)
            drafting = current if any(current) else [row == first for row in range(len(active))]
            if not any(current) and self.draft.behind(first, active[first].tokens) > PROBE_WINDOW:
                # A probe is there to measure acceptance, which the latest tokens show as well as all of them; a
                # whole catch-up would cost many plain steps on a slow CPU, and grows with the text.
                self.draft.restart_window(first, active[first].tokens, PROBE_WINDOW)
        if self.draft is not None and self.k == "auto" and not probing:
            # A probe catches its row up whatever the estimates say: it is how wrong estimates get corrected (else a
            # cold first measurement could keep a server from ever drafting again).
            kept = self._worth_catching_up(drafting, k_per_row)
            drafting = self.controller.rows_left_pay(model, drafting, kept, k_per_row)
        if self.draft is not None and any(drafting):
            started = time.perf_counter()
            k_step = max(k for k, wants in zip(k_per_row, drafting) if wants)
            batched = self.draft.propose(
                [s.tokens for s in active], k_step,
                [s.config.sampling for s in active], [s.generator for s in active], drafting,
                self._catch_up_limit(), [s.grammar for s in active], [len(s.prompt_ids) for s in active],
            )
            seconds[model] = time.perf_counter() - started - self.draft.catch_up_seconds
            if sum(drafting) == 1:
                self._check_draft_format(seconds[model] / k_step)
            for row, error in self.draft.faults.items():  # a row's own sampling or grammar failed while drafting
                active[row].fault = error
            self.controller.observe_catch_up(self.draft.catch_up_seconds, self.draft.catch_up_tokens)
            proposals = [p if wants else proposal for p, wants, proposal in zip(batched, drafting, proposals)]
        for row, (sequence, k, source) in enumerate(zip(active, k_per_row, sources)):
            own = source != model or self.draft is None  # else the batched draft model drafts for it, or nothing does
            if k > 0 and own and sequence.drafter is not None and sequence.fault is None:
                started = time.perf_counter()
                proposals[row] = self._try(sequence, self._own_proposal, sequence, k, default=proposals[row])
                spent = time.perf_counter() - started - proposals[row].catch_up_seconds  # a backlog fed is not drafting
                name = proposals[row].source or self.drafter
                seconds[name] = seconds.get(name, 0.0) + spent
        trimmed = []  # a row near its max_tokens keeps only drafts it can still use
        for proposal, k in zip(proposals, k_per_row):
            if proposal.num_tokens > k:
                probs = proposal.probs[:, :k] if proposal.probs is not None else None
                proposal = Proposal(proposal.token_ids[:, :k], probs, proposal.forwards, proposal.source)
            trimmed.append(proposal)
        return trimmed, seconds

    def _check_draft_format(self, forward_seconds: float) -> None:
        """Feed one one-row draft forward to the draft's format check; where another format is remembered as
        MARGIN faster, time the formats again and draft with the new choice (its rows' caches stay: any draft
        is verified exactly, so old keys from another format cost acceptance at most)."""
        check = getattr(self.draft.model, "format_check", None)
        if check is not None and check.observe(forward_seconds):
            self.draft.model = replace_format(self.draft.model)
            self.draft_format_replacements += 1

    def _check_target_format(self, forward_seconds: float) -> None:
        """Feed one plain one-token target forward to the target's format check (target_format.ServingCheck)."""
        check = getattr(self.target.model, "target_format_check", None)
        if check is not None and check.observe(forward_seconds):
            log.warning("the target's remembered format %s runs MARGIN slower than another format's estimate here; "
                        "it is timed again and replaced when the server is next idle", check.kept["format"])

    def _replace_slow_target(self) -> None:
        """With no request in flight, load the target again where its format check found it slow: the formats are
        timed again (the remembered choice was forgotten), and the prefix cache, whose keys the old weights
        computed, is emptied."""
        check = getattr(self.target.model, "target_format_check", None)
        if check is None or not check.stale:
            return
        replacement = load_model(check.directory, check.dtype, quantize="auto")
        self.target.model, self.target.format = replacement.model, replacement.format
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.target_format_replacements += 1

    @staticmethod
    def _own_proposal(sequence: _Sequence, k: int) -> Proposal:
        """A sequence's own drafter's proposal (a lookup, or a library's drafter), cut where its grammar forbids a
        draft; a drafter that drafts under a grammar (drafts_under_grammar) is handed it."""
        drafter, grammar = sequence.drafter, sequence.grammar
        args = (sequence.tokens, k, sequence.config.sampling, sequence.generator)
        if grammar is not None and drafter.drafts_under_grammar:
            return cut_to_grammar(drafter.propose(*args, grammar), grammar)
        return cut_to_grammar(drafter.propose(*args), grammar)

    def _catch_up_limit(self) -> int | None:
        """Tokens the rows far behind in the draft cache may catch up by in all this step: with others decoding,
        what fits in PREFILL_MIN_SHARE of a step (as measured; one chunk until measured), so that feeding new
        prompts to the draft model slows the streams no more than their prefill does. Alone: everything."""
        if not self.chunked_prefill or len(self.active) < 2:
            return None
        per_token = self.controller.catch_up_per_token
        if per_token is None or self._step_seconds is None:
            return PREFILL_CHUNK
        return max(LONG_TAIL + 1, int(self._step_seconds * PREFILL_MIN_SHARE / per_token))

    def _worth_catching_up(self, drafting: list[bool], k_per_row: list[int]) -> list[bool]:
        """The drafting rows, less those far behind in the draft cache that drafting would not win their catch-up
        back for (AdaptiveController.catch_up_rows)."""
        behind = [self.draft.behind(row, sequence.tokens) for row, sequence in enumerate(self.active)]
        remaining = [sequence.remaining for sequence in self.active]
        return self.controller.catch_up_rows(self.batched_source, drafting, behind, remaining, k_per_row, LONG_TAIL)

    def _step(self) -> None:
        active = self.active
        n = len(active)
        started = time.perf_counter()
        if self._lookups_may_draft(n):
            sources = self._sources()
            self._lookup_share = sum(source not in (self.batched_source, None) for source in sources) / n
            self._steps_since_lookups = 0
        else:
            sources = [self.batched_source] * n
            self._steps_since_lookups += 1
        rows = collections.Counter(source for s, source in zip(active, sources) if s.draft_cap > 0)  # drafting rows
        choices = {source: self._choose_k(n, source, rows[source]) for source in rows}  # source -> (k, probe)
        k_per_row = [max(0, min(choices.get(source, (0, False))[0], s.draft_cap)) for s, source in zip(active, sources)]
        if self.k_per_sequence:
            k_per_row = self._k_per_sequence(k_per_row, sources, choices)
        proposals, draft_seconds = self._draft(k_per_row, sources, choices.get(self.batched_source, (0, False))[1])
        verifying = time.perf_counter()
        width = 1 + max(p.num_tokens for p in proposals)
        row_tokens = [[s.tokens[-1], *p.token_ids[0].tolist()] for s, p in zip(active, proposals)]
        verify_tokens = sum(len(tokens) for tokens in row_tokens)
        prefilling = self._prefilling if self.packs_prefill else None
        chunk: list[int] = []  # prompt tokens of the row being admitted (row n), carried by this forward
        if prefilling is not None:
            chunk = self._packed_chunk(prefilling, verify_tokens, verifying - started)
        hidden: list[torch.Tensor | None] | None = [] if self.feeds_head else None  # per row (T_b, C), chunk's too
        if self.target.model.batch_invariant:
            # One packed forward over every row's [pending, drafts...] and the chunk: each row as wide as it is.
            row_logits = self.target.model.forward_packed(
                row_tokens + ([chunk] if chunk else []), self.cache.rows(0, n + bool(chunk)),
                [True] * n + [False] * bool(chunk), hidden_out=hidden,
            )  # (1 + k_b, V) per row
        else:
            # One target forward over every row's [pending, drafts...], right-padded to the longest.
            inputs = torch.full((n, width), PAD_TOKEN, dtype=torch.long)  # (n, 1 + k)
            for b, tokens in enumerate(row_tokens):
                inputs[b, : len(tokens)] = torch.tensor(tokens)
            padded_hidden = [] if hidden is not None else None
            logits = self.target.model.forward(inputs, self.cache.rows(0, n), hidden_out=padded_hidden)  # (n, 1 + k, V)
            row_logits = [logits[b, : len(tokens)] for b, tokens in enumerate(row_tokens)]
            if hidden is not None:
                hidden = [padded_hidden[0][b, : len(tokens)] for b, tokens in enumerate(row_tokens)]
            verify_tokens = n * width

        # A faulty row (-1 accepted) commits nothing and leaves after the step.
        verified = [
            self._try(sequence, self._verify_row, sequence, proposal, logits, default=(-1, []))
            for sequence, proposal, logits in zip(active, proposals, row_logits)
        ]
        accepted = [num_accepted for num_accepted, _ in verified]
        new_tokens = [tokens for _, tokens in verified]
        self.cache.rows(0, n).commit(torch.tensor(accepted) + 1)
        finished_at = time.perf_counter()
        forward_seconds = finished_at - verifying
        if not chunk:  # a forward that carried a chunk says nothing of what verifying costs
            self.controller.observe_forward(verify_tokens, forward_seconds, rows=n)
            if self.controller.stale_seed is not None and self._remembered_costs is not None:
                forget_choice(self._remembered_costs)  # timed in a loaded moment: the next start times them again
                self._remembered_costs = None
        if not chunk and verify_tokens == 1:  # a plain one-token forward: what the target's format check compares
            self._check_target_format(forward_seconds)
        if chunk:  # what carrying it cost, to size the next chunk (_packed_chunk)
            total = verify_tokens + len(chunk)
            self._packed_seconds[total] = moving_average(self._packed_seconds.get(total), forward_seconds, COST_SMOOTHING)

        deepest = max((p.num_tokens for p in proposals if p.source == self.batched_source), default=0)
        done: list[tuple[_Sequence, str]] = []
        for b, (sequence, proposal, num_accepted, tokens) in enumerate(zip(active, proposals, accepted, new_tokens)):
            if sequence.fault is not None:
                continue
            drafted = proposal.num_tokens
            stats = sequence.stats
            source = proposal.source or self.drafter
            stats.record_step(drafted, num_accepted, source)
            stats.draft_forwards += proposal.forwards
            stats.draft_seconds += verifying - started
            stats.verify_seconds += finished_at - verifying
            if drafted and self.k_per_sequence:
                hits, reached = sequence.position_hits.setdefault(source, ([0] * self.k_max, [0] * self.k_max))
                for position in range(min(drafted, num_accepted + 1, self.k_max)):
                    reached[position] += 1
                    hits[position] += position < num_accepted
            spent = draft_seconds.get(source, 0.0)
            if source == self.batched_source and drafted:  # the batch drafted `deepest` positions, this row fewer
                spent *= drafted / deepest
            self.controller.observe(source, drafted, num_accepted, spent, verify_tokens, None, batch_size=n)
            if hidden is not None:  # the positions it committed: its pending token's and the accepted drafts'
                committed = hidden[b] if hidden[b].shape[0] == num_accepted + 1 else hidden[b][: num_accepted + 1]
                self.draft.observe(b, len(sequence.tokens) - 1, committed)
            sequence.tokens.extend(tokens)
            finish_reason = self._try(sequence, self._commit_row, sequence, tokens, row_logits[b], finished_at)
            if finish_reason is not None:
                done.append((sequence, finish_reason))
        if not chunk:  # the streams' steady step, which a chunk may lengthen by its share (see _packed_chunk)
            self._step_seconds = moving_average(self._step_seconds, finished_at - started, COST_SMOOTHING)
            drafters = {p.source or self.drafter for p in proposals if p.num_tokens}
            if len(drafters) <= 1:  # a whole step, one source's or plain (a draft model's catch-up is weighed apart)
                batched = self.draft is not None and self.batched_source in drafters
                catch_up = self.draft.catch_up_seconds if batched else 0.0
                self.controller.observe_step(
                    next(iter(drafters), None), n, time.perf_counter() - started - catch_up,
                    sum(draft_seconds.values()) + forward_seconds,
                )
        record = StepRecord(
            tuple(RowStep((p.source or self.drafter) if p.num_tokens else None, p.num_tokens, a)
                  for p, a in zip(proposals, accepted)),
            draft_seconds, verify_tokens, len(chunk), forward_seconds, time.perf_counter() - started,
        )
        if self.metrics is not None:
            self.metrics.step(record)
        for observe in self.step_observers:
            observe(record)
        if chunk:
            self.cache.rows(n, n + 1).commit(len(chunk))
            if hidden is not None:
                prefilling.prompt_features.append((prefilling.prefilled, hidden[n]))
            prefilling.prefilled += len(chunk)
            if prefilling.prefilled == len(prefilling.prompt_ids) - 1:  # in: it decodes from the next step (row n)
                self._prefilling = None
                self._guarded(prefilling, self._begin_decoding, n, prefilling)
                self._report_queue()
        faulty = [sequence for sequence in active if sequence.fault is not None]
        for sequence, reason in done:
            self._retire([sequence], reason, emitted=True)
        self._retire(faulty, "error")

    def _verify_row(
        self, sequence: _Sequence, proposal: Proposal, logits: torch.Tensor
    ) -> tuple[int, list[int]]:
        """Accept/reject one row's drafts against its target scores (1 + k_b, V): (accepted drafts, new tokens)."""
        params = sequence.config.sampling
        if params.greedy and not params.transforms_scores and sequence.grammar is None and proposal.probs is None:
            return verify_greedy(proposal.token_ids[0], logits)  # the same tokens, without one-hot rows of V
        allowed = None  # (1, 1 + k_b, V) under a grammar: its mask at every verified position
        if sequence.grammar is not None:
            allowed = sequence.grammar.masks_along(proposal.token_ids[0].tolist())[None]
        history = None  # penalties: the tokens before each verified position
        if params.penalized:
            history = TokenHistory(sequence.tokens + proposal.token_ids[0].tolist(), len(sequence.prompt_ids))
        p = logits_to_probs(logits[None], params, allowed, history)  # (1, 1 + k_b, V)
        result = verify(proposal.token_ids, proposal.probs, p, sequence.generator)
        num_accepted = int(result.num_accepted[0])
        return num_accepted, result.token_ids[0, : num_accepted + 1].tolist()

    def _commit_row(self, sequence: _Sequence, tokens: list[int], logits: torch.Tensor, now: float) -> str | None:
        """Advance a row's grammar over its new tokens and stream them; its finish reason when it is done."""
        if sequence.grammar is not None:
            sequence.grammar.advance(tokens)
        logprobs = None
        if sequence.config.logprobs is not None:  # the target's scores at each emitted token
            logprobs = token_logprobs(logits, tokens, sequence.config.logprobs)
        return self._emit(sequence, tokens, now, logprobs)

    def _packed_chunk(self, sequence: _Sequence, verify_tokens: int, draft_seconds: float) -> list[int]:
        """The prompt tokens the step's forward over `verify_tokens` tokens carries for the sequence being admitted.

        The rest of the prompt where carrying it lengthens the step by WHOLE_PROMPT_STEPS steps at most. Else
        the prompts' share of the streams' time (as in prefill_budget: max(prompts / decoding, PREFILL_MIN_SHARE)
        of each step's drafting and its forward without the chunk), on average over steps, in chunks that are
        efficient by the measured cost of forwards of each size (prompt_chunk: none in some steps, so that a chunk
        pays for a kernel's jump); until a whole prefill was timed, PACKED_FIRST_CHUNK.
        """
        prompt = sequence.prompt_ids[:-1]
        left = len(prompt) - sequence.prefilled
        most = min(left, PACKED_MAX_CHUNK)
        if self._prefill_token_seconds is None:
            return prompt[sequence.prefilled : sequence.prefilled + min(most, PACKED_FIRST_CHUNK)]
        costs = {**self.controller.verify_cost, **self._packed_seconds}
        if most == left:  # a short prompt: at once, if that holds the streams up by WHOLE_PROMPT_STEPS steps at most
            step = draft_seconds + estimated_forward_seconds(costs, verify_tokens, self._prefill_token_seconds)
            carrying = draft_seconds + estimated_forward_seconds(costs, verify_tokens + left, self._prefill_token_seconds)
            if carrying <= (1 + WHOLE_PROMPT_STEPS) * step:
                return prompt[sequence.prefilled :]
        share = max((1 + self.num_waiting) / len(self.active), PREFILL_MIN_SHARE)
        size, sequence.chunk_credit = prompt_chunk(
            costs, verify_tokens, share, draft_seconds, self._prefill_token_seconds, most, sequence.chunk_credit,
            WHOLE_PROMPT_STEPS,
        )
        return prompt[sequence.prefilled : sequence.prefilled + size]

    def _emit(
        self, sequence: _Sequence, tokens: list[int], now: float, logprobs: list[TokenLogprob] | None = None
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

    def _retire(self, sequences: list[_Sequence], reason: str, emitted: bool = False) -> None:
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
                if self.draft is not None:
                    self.draft.move(old, row)
        if self._prefilling is not None and len(survivors) != len(self.active):  # its row follows the active ones
            self.cache.move_row(len(self.active), len(survivors))
        self.active = survivors
        self._report_queue()

    def _finish(
        self, sequence: _Sequence, reason: str, error: str | None = None, exception: BaseException | None = None
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


COST_SMOOTHING = 0.2  # weight of the newest step or prefill timing in the scheduler's moving averages
# While others decode, a step's prefill lasts at least this many of their decoding steps: a long prompt
# among streams makes their tokens at most 1.75x slower and goes in at 1 / 1.75 of its speed alone.
PREFILL_MIN_SHARE = 0.75
# A prompt whose rest goes in within this many of the streams' steps goes in at once: small chunks cost far more per
# prompt token than a prefill (the first tokens beside the streams cross the matrix kernels' small-row paths), and a
# pause of a few steps is brief. A prompt of thousands of tokens still goes in by chunks.
WHOLE_PROMPT_STEPS = 8
PACKED_FIRST_CHUNK = 8  # prompt tokens a decoding step carries before any prefill was timed
PACKED_MAX_CHUNK = 512  # the most prompt tokens one decoding step carries
# A share of rows with a recurring context is taken to hold this many steps; then the lookups are planned for every
# row again (and so asked, where that pays), so that text that starts to recur under a full batch is found.
LOOKUP_SHARE_STEPS = 256
PROBE_WINDOW = 24  # a probe's row far behind in the draft cache sees only its latest tokens (restart_window)


def prefill_budget(
    step_seconds: float | None, token_seconds: float | None, prompts: int, decoding: int, left: int | None = None
) -> int:
    """Prompt tokens to feed in one step while `decoding` sequences decode and `prompts` prompts wait to go in.

    Requests share the model's time evenly, the waiting ones at least PREFILL_MIN_SHARE of a decoding
    step: a step's prefill lasts max(prompts / decoding, PREFILL_MIN_SHARE) decoding steps
    (step_seconds, measured) at token_seconds a prompt token (measured). So a burst of new requests
    goes in quickly, and one long prompt slows the streams by 1.75x at most. The prompt's `left`
    tokens go in at once where that lasts WHOLE_PROMPT_STEPS steps at most: a chunk of a few tokens
    costs the streams far more per token than a prefill does. Until both costs are measured, one chunk.
    """
    if step_seconds is None or token_seconds is None:
        return PREFILL_CHUNK
    if left is not None and left * token_seconds <= WHOLE_PROMPT_STEPS * step_seconds:
        return left
    share = max(prompts / decoding, PREFILL_MIN_SHARE)
    return max(1, int(step_seconds * share / token_seconds))


def start_in_model_thread(build: Callable[[], Scheduler], threads: int | None = None) -> Scheduler:
    """Run build() (loading the models) in a new thread, then the scheduler's loop in that same thread.

    torch's CPU kernels run on OpenMP, and libgomp keeps a thread pool for each thread that starts
    parallel work: models loaded in one thread and decoded in another leave two pools on the cores,
    and libgomp, counting more threads than cores, stops spinning between parallel regions, which slows
    every decoding step markedly. So one thread
    loads the models and runs every step; the caller's thread (the HTTP server) runs no torch
    kernels. Errors of build() are raised here.
    """
    outcome: dict[str, object] = {}
    ready = threading.Event()

    def main() -> None:
        try:
            if threads:
                torch.set_num_threads(threads)  # per thread under OpenMP
            scheduler = build()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error
            ready.set()
            return
        scheduler._thread = threading.current_thread()
        outcome["scheduler"] = scheduler
        ready.set()
        scheduler._run()

    threading.Thread(target=main, name="verispec-scheduler", daemon=True).start()
    ready.wait()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["scheduler"]


def build_scheduler(
    target: str,
    draft: str | None,
    drafter: str,
    dtype: str = "auto",
    draft_quantize: str = "auto",
    k: int | str = "auto",
    k_max: int = 8,
    limits: SchedulerLimits = SchedulerLimits(),
    metrics: "ServerMetrics | None" = None,
    progress: bool = False,
    quantize: str = "auto",
    chunked_prefill: bool | None = None,
    k_per_sequence: bool = False,
    draft_vocab: str | int = "full",
    foreign_draft_crosses: bool = False,
) -> Scheduler:
    """Load the models named on the command line and build (not start) a scheduler over them.

    chunked_prefill None: on where the target is batch-invariant (its chunks ride in the decoding steps'
    own forwards), else off. foreign_draft_crosses: a draft model whose tokenizer differs from the target's
    drafts through the cross-tokenizer drafter (the drafter was not named; `Scheduler.drafter` says which ran),
    where otherwise a draft-model or composite drafter refuses it.
    """
    from verispec.drafters import QUANTIZATIONS, draft_model_drafter, is_head_spec, load_head, same_vocabulary

    if drafter not in SERVED_DRAFTERS:
        raise ValueError(f"the server's drafter must be one of {', '.join(SERVED_DRAFTERS)}, got {drafter!r}")
    needs_model = drafter in MODEL_DRAFTERS or drafter == "cross-tokenizer"
    if needs_model and (draft is None or draft.lower() == "none"):
        raise ValueError(f"drafter {drafter!r} needs a draft model: pass --draft NAME_OR_PATH (or --drafter none)")
    head = needs_model and is_head_spec(draft)  # a draft head over the target's hidden states, not a model
    if head and drafter not in MODEL_DRAFTERS:
        raise ValueError(f"a draft head runs as drafter draft-model or composite, not {drafter!r}")
    needs_model = needs_model and not head
    if needs_model and draft_quantize not in QUANTIZATIONS:
        raise ValueError(f"draft quantization {draft_quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    target_model = load_model(target, dtype, progress, quantize)
    draft_model, sequence_drafter = None, None
    loaded = load_model(draft, dtype, progress) if needs_model else None
    foreign = loaded is not None and not same_vocabulary(target_model, loaded)
    if drafter in MODEL_DRAFTERS and foreign_draft_crosses and foreign:
        drafter = "cross-tokenizer"
    if head:
        draft_model = load_head(draft, target_model)
    elif drafter in MODEL_DRAFTERS:
        draft_model = draft_model_drafter(loaded, target_model, dtype, draft_quantize, progress, draft_vocab).model
    elif drafter == "cross-tokenizer":  # each sequence re-encodes text its own way: its own drafter, one shared model
        quantize_draft(loaded, draft_quantize, progress, dtype_asked=dtype != "auto")

        def sequence_drafter() -> Drafter:
            return CrossTokenizerDrafter(loaded, target_model)
    limits = dataclasses.replace(
        limits, max_context=min(limits.max_context, target_model.model.config.max_position_embeddings)
    )
    try:  # the first request with a response_format would otherwise wait for it
        compiler_for(target_model)
    except SchemaError:
        pass  # such requests get the reason as a 400
    if chunked_prefill is None:
        chunked_prefill = target_model.model.batch_invariant
    return Scheduler(
        target_model, draft_model, drafter, k, k_max, limits, metrics, chunked_prefill, k_per_sequence, sequence_drafter
    )
