"""The library's entry point: one request at a time, through the server's own step.

A request runs on a scheduler of one row (`Scheduler.run_once`, driven here): the same draft, verify
in one target forward, accept/reject, commit, record and stop as every served request, so the
library and the server cannot drift apart. Target cache invariant: it holds the committed tokens
except the newest one (the "pending" token). Each step feeds [pending, d_1 .. d_k] to the target,
which yields the k + 1 distributions p_1 .. p_{k+1} that `verify` needs. With no drafter (k = 0) the
same step is plain autoregressive decoding, through the same model code.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Iterator

from verispec.config import GenerationConfig
from verispec.core.step_record import StepRecord
from verispec.drafters.base import Drafter, as_drafter
from verispec.drafters.composite import CompositeDrafter
from verispec.drafters.draft_format import current_draft
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.models.loading import LoadedModel
from verispec.policy import AdaptiveController, ControllerSettings
from verispec.sampling import TokenLogprob
from verispec.core.requests import RequestHandle, SchedulerLimits
from verispec.core.scheduler import Scheduler
from verispec.stats import GenerationStats

__all__ = ["GenerationConfig", "GenerationResult", "SpeculativeEngine", "TextStream"]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only (an end-of-sequence id is kept when it ended the text)
    stats: GenerationStats
    finish_reason: str  # "stop" (eos or stop string) or "length"
    logprobs: list[TokenLogprob] | None = None  # one per token, when the config asked for them
    steps: list[StepRecord] = field(default_factory=list)  # what each step drafted, accepted and cost


class SpeculativeEngine:
    def __init__(self, target: LoadedModel, drafter: Drafter | None = None) -> None:
        self.target = target
        self.drafter = drafter
        # Costs belong to this machine and model pair, so measurements carry over between requests.
        self._controllers: dict[int, AdaptiveController] = {}  # k_max -> controller

    def controller(self, k_max: int) -> AdaptiveController:
        if k_max not in self._controllers:
            self._controllers[k_max] = AdaptiveController(ControllerSettings(k_max=k_max))
        return self._controllers[k_max]

    def generate(self, prompt: str | list[int], config: GenerationConfig = GenerationConfig()) -> GenerationResult:
        stream = self.stream(prompt, config)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | list[int], config: GenerationConfig = GenerationConfig()) -> "TextStream":
        """An iterator of text deltas; its `result` holds the full result once exhausted."""
        prompt_ids = self.target.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        limit = self.target.model.config.max_position_embeddings
        if len(prompt_ids) + config.max_new_tokens + config.longest_draft + 1 > limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds "
                f"the model's context of {limit} tokens; shorten the prompt or lower max_new_tokens"
            )
        scheduler = self._scheduler(len(prompt_ids) + config.max_new_tokens, config)
        return TextStream(scheduler, scheduler.submit(prompt_ids, config), len(prompt_ids), config.logprobs is not None)

    def _scheduler(self, context: int, config: GenerationConfig) -> Scheduler:
        """A scheduler of one row for one request, drafting as this engine's drafter does.

        A draft model of the target's tokenizer (alone, or behind a lookup in a composite) drafts as the
        server's batched one does; any other drafter is the sequence's own.
        """
        drafter = self.drafter
        draft_model, own, name = None, None, "none"
        if isinstance(drafter, DraftModelDrafter):
            drafter.model = current_draft(drafter.model)  # a format a request found slow was replaced
            draft_model, name = drafter.model, "draft-model"
        elif isinstance(drafter, CompositeDrafter) and _lookup_then_model(drafter):
            lookup, model_drafter = drafter.drafters
            model_drafter.model = current_draft(model_drafter.model)
            draft_model, own, name = model_drafter.model, (lambda: lookup), "composite"
        elif drafter is not None:
            own, name = (lambda: drafter), as_drafter(drafter).source or "own"
        return Scheduler(
            self.target, draft_model, name, k=config.k, k_max=config.k_max,
            limits=SchedulerLimits(max_batch_size=1, max_waiting=1, max_context=context, prefix_cache_bytes=0),
            sequence_drafter=own, controller=self.controller(config.k_max), synchronous=True,
            draft_p_min=config.draft_p_min,
        )


def _lookup_then_model(composite: CompositeDrafter) -> bool:
    """A composite of a lookup that says whether it finds something, then a same-tokenizer draft model."""
    if len(composite.drafters) != 2:
        return False
    lookup, model = composite.drafters
    return isinstance(model, DraftModelDrafter) and lookup.tells_if_it_proposes and bool(lookup.source)


class TextStream:
    """Iterates text deltas of one request; stops on eos ids, stop strings or max_new_tokens."""

    def __init__(self, scheduler: Scheduler, handle: RequestHandle, prompt_tokens: int, logprobs: bool) -> None:
        self.scheduler = scheduler
        self.handle = handle
        self.wants_logprobs = logprobs
        self.stats = GenerationStats(prompt_tokens=prompt_tokens)
        self.result: GenerationResult | None = None
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._steps: list[StepRecord] = []
        scheduler.step_observers.append(self._steps.append)
        self._iterator = self._run()

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        while True:
            delta = next(self._iterator)
            if delta:
                return delta

    def steps(self) -> Iterator[str]:
        """One item per engine step: the text released by that step, possibly empty."""
        return self._iterator

    @property
    def token_ids(self) -> list[int]:
        """Tokens generated so far."""
        return list(self._token_ids)

    def _run(self) -> Iterator[str]:
        events = self.handle._sync_queue
        while True:
            self.scheduler.run_once()  # admission (the first time), then one step
            released, finish_reason = [], None
            while finish_reason is None:
                try:
                    event = events.get_nowait()
                except queue.Empty:
                    break
                if event.finish_reason == "error":
                    raise event.exception or RuntimeError(event.error)
                self._token_ids.extend(event.token_ids)
                self._logprobs.extend(event.logprobs or [])
                released.append(event.text)
                self.stats, finish_reason = event.stats, event.finish_reason
            self._text.extend(released)
            if finish_reason is not None:
                logprobs = self._logprobs if self.wants_logprobs else None
                self.result = GenerationResult(
                    "".join(self._text), list(self._token_ids), self.stats, finish_reason, logprobs, self._steps
                )
            yield "".join(released)
            if finish_reason is not None:
                return
