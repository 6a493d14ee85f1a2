"""Continuous batching: every active request advances by one speculative step per batched target forward.

One thread owns the models. Each turn (`run_once`) it
  1. ends cancelled and overdue requests (lifecycle.py),
  2. admits waiting prompts into free cache rows, after the longest prefix of each the prefix cache holds;
     with chunked prefill, one prompt at a time, in chunks that take the prompts' share of the streams' time
     (admission.py),
  3. runs one step for every decoding row (step.py): the controller's k for each drafter and row, the drafts
     (drafting.py), ONE target forward over every row's [pending, drafts...] (and a prompt's chunk), each row
     verified with its own sampling settings and generator, committed and streamed; finished rows leave and
     the others move down to rows 0 .. n-1.

Both front doors run it: the library's engine drives it synchronously, the server from its model thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from typing import Callable

import torch

from verispec.config import GenerationConfig, check_drafting
from verispec.core.admission import Admission
from verispec.core.drafting import Drafting
from verispec.core.lifecycle import Lifecycle
from verispec.core.prefix_cache import PrefixCache
from verispec.core.requests import QueueFullError, RequestHandle, SchedulerLimits, Sequence
from verispec.core.step import Stepping
from verispec.core.step_record import StepMetrics, StepRecord
from verispec.drafters import composite_lookup, make_drafter
from verispec.drafters.base import BatchedProposer, Drafter
from verispec.drafters.batch_draft import BatchedDraftModel, ChainDrafter
from verispec.drafters.batch_head import BatchedDraftHead
from verispec.drafters.draft_head import HeadLayer
from verispec.drafters.sequence_drafters import SequenceDrafters
from verispec.grammar import constraint_for
from verispec.models.forward_cost import step_costs
from verispec.models.loading import LoadedModel, load_model
from verispec.models.transformer import Transformer
from verispec.policy import AdaptiveController, ControllerSettings
from verispec.stats import GenerationStats
from verispec.stopping import TextAssembler

log = logging.getLogger("verispec.scheduler")

SERVED_DRAFTERS = ("draft-model", "prompt-lookup", "suffix-index", "composite", "cross-tokenizer", "none")
# Drafters with a (batched) draft model; composite asks each sequence's suffix index first.
MODEL_DRAFTERS = ("draft-model", "composite")


class Scheduler(Admission, Drafting, Stepping, Lifecycle):
    """The requests, the rows and the models' thread; the rooms it is made of hold the admission, drafting, the
    step and the requests' ends."""

    def __init__(
        self,
        target: LoadedModel,
        draft_model: Transformer | HeadLayer | None = None,
        drafter: str = "none",
        k: int | str = "auto",
        k_max: int = 8,
        limits: SchedulerLimits = SchedulerLimits(),
        metrics: StepMetrics | None = None,
        chunked_prefill: bool = False,
        k_per_sequence: bool = False,
        sequence_drafter: Callable[[], Drafter] | None = None,
        controller: AdaptiveController | None = None,
        synchronous: bool = False,
        draft_p_min: float = 0.0,
    ) -> None:
        """draft_model: a same-tokenizer draft model, or a draft head over the target's hidden states (draft_head).
        drafter: one of SERVED_DRAFTERS, or with `sequence_drafter` (a library's own drafter, made for each
        sequence) the name its statistics go by: "composite" when a draft model drafts where it finds nothing.
        controller: one that measured this machine and model pair before (the library keeps one across requests).
        synchronous: requests are submitted and run_once driven by one thread that reads its events itself.
        draft_p_min: a row's draft from the draft model or head ends where its top probability falls below this.
        """
        if sequence_drafter is None and drafter not in SERVED_DRAFTERS:
            raise ValueError(f"the server's drafter must be one of {', '.join(SERVED_DRAFTERS)}, got {drafter!r}")
        if drafter in MODEL_DRAFTERS and draft_model is None:
            raise ValueError(f"drafter {drafter!r} needs a draft model")
        if drafter == "cross-tokenizer" and sequence_drafter is None:
            raise ValueError("drafter 'cross-tokenizer' needs each sequence's drafter (sequence_drafter)")
        if drafter not in MODEL_DRAFTERS and draft_model is not None:
            raise ValueError(f"drafter {drafter!r} uses no draft model; only {' and '.join(MODEL_DRAFTERS)} do")
        check_drafting(k, k_max, draft_p_min)
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
        new_drafter: Callable[[], Drafter] | None = sequence_drafter
        if sequence_drafter is None and drafter in ("prompt-lookup", "suffix-index", "composite"):
            new_drafter = composite_lookup if drafter == "composite" else lambda: make_drafter(drafter, target)
        self.own = SequenceDrafters(new_drafter) if new_drafter is not None else None
        # Room for the verify pass's draft tokens after the longest sequence.
        capacity = limits.max_context + self.k_max + 2
        self.cache = target.model.new_cache(limits.max_batch_size, capacity)
        self.prefix_cache = PrefixCache(limits.prefix_cache_bytes) if limits.prefix_cache_bytes else None
        self.draft: BatchedProposer | None = None
        if isinstance(draft_model, HeadLayer):
            target.model.feature_layers = draft_model.feature_layers  # the hidden states its forwards hand on
            self.draft = BatchedDraftHead(draft_model, target.model.vocab_size, limits.max_batch_size, capacity)
        elif draft_model is not None:
            self.draft = BatchedDraftModel(draft_model, target.model.vocab_size, limits.max_batch_size, capacity)
        if isinstance(self.draft, ChainDrafter):
            self.draft.min_confidence = draft_p_min
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
        self.active: list[Sequence] = []  # active[i] lives in cache row i
        self._prefilling: Sequence | None = None  # the prompt going in, in row len(active)
        self._step_seconds: float | None = None  # moving average of a decoding step
        # The share of rows whose lookup could propose when the lookups were last asked (None: never asked yet)
        self._lookup_share: float | None = None
        self._steps_since_lookups = 0  # steps since the lookups were last asked
        self._prefill_token_seconds: float | None = None  # moving average of a prompt token's prefill
        self._waiting: collections.deque[Sequence] = collections.deque()  # submitted, not yet admitted
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
    ) -> Sequence:
        total = len(prompt_ids) + config.max_new_tokens
        if total > self.limits.max_context:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({config.max_new_tokens}) = {total} exceeds the "
                f"server's context of {self.limits.max_context} tokens; shorten the prompt or lower max_tokens"
            )
        eos = config.eos_token_ids if config.eos_token_ids is not None else self.target.eos_token_ids
        grammar = constraint_for(self.target, config.json_schema, config.lark_grammar, eos)
        return Sequence(
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

    def _row_of(self, sequence: Sequence | None) -> int | None:
        """The cache row of an active sequence (by identity); None when it is not decoding."""
        return next((row for row, active in enumerate(self.active) if active is sequence), None)

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
