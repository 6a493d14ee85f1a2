"""The speculative decoding loop: draft, verify in one target forward, accept/reject, commit.

Target cache invariant: it holds the committed tokens except the newest one (the "pending"
token). Each step feeds [pending, d_1 .. d_k] to the target, which yields the k + 1
distributions p_1 .. p_{k+1} that `verify` needs. With no drafter (k = 0) the same step is plain
autoregressive decoding, through the same model code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.grammar import Grammar, constraint_for, cut_to_grammar
from verispec.models.loading import LoadedModel
from verispec.policy import AdaptiveController, ControllerSettings
from verispec.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenHistory, logits_to_probs
from verispec.stats import GenerationStats
from verispec.stopping import TextAssembler
from verispec.verify import verify


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0  # same seed and settings with a fixed k: same output (auto's k depends on timing)
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's own
    k: int | str = "auto"  # draft tokens per step, or "auto": chosen each step by the controller
    k_max: int = 8  # the longest draft "auto" considers
    logprobs: int | None = None  # served: each emitted token's log-probability and this many alternatives
    json_schema: dict | None = None  # structured output: the completion is one JSON document valid under it
    lark_grammar: str | None = None  # or a grammar in llguidance's Lark syntax (served tool calls use one)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.k != "auto" and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0):
            raise ValueError(f"k (draft tokens per step) must be 'auto' or an integer >= 0, got {self.k!r}")
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be None or 0..{MAX_TOP_LOGPROBS} alternatives, got {self.logprobs}")
        if self.json_schema is not None and self.lark_grammar is not None:
            raise ValueError("give a json_schema or a lark_grammar, not both")
        if (self.json_schema is not None or self.lark_grammar is not None) and self.eos_token_ids == ():
            raise ValueError("structured output ends with an end-of-sequence id: it cannot ignore them (ignore_eos)")

    @property
    def longest_draft(self) -> int:
        return self.k_max if self.k == "auto" else self.k


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only (an end-of-sequence id is kept when it ended the text)
    stats: GenerationStats
    finish_reason: str  # "stop" (eos or stop string) or "length"


@dataclass
class _Step:
    token_ids: list[int]  # tokens committed by this step, in order


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
        # An empty schema ({}) still asks for one JSON document.
        grammar = constraint_for(self.target, config.json_schema, config.lark_grammar, config.eos_token_ids)
        return TextStream(self, prompt_ids, config, grammar)

    def _steps(
        self, prompt_ids: list[int], config: GenerationConfig, stats: GenerationStats, grammar: Grammar | None = None
    ) -> Iterator[_Step]:
        target = self.target.model
        k_longest = config.longest_draft if self.drafter is not None else 0
        adaptive = config.k == "auto" and self.drafter is not None
        # The controller always measures (for the counterfactual in the stats); it decides only for "auto".
        controller = self.controller(config.k_max)
        stats.controller = controller
        params = config.sampling
        generator = torch.Generator().manual_seed(config.seed)
        max_length = len(prompt_ids) + config.max_new_tokens + k_longest + 1
        cache = target.new_cache(1, max_length)
        tokens = list(prompt_ids)  # every committed token; the last one is pending

        # 0. Prefill: all prompt tokens but the last go into both caches.
        started = time.perf_counter()
        target.prefill(prompt_ids[:-1], cache)
        if self.drafter is not None:
            self.drafter.begin(prompt_ids, max_length)
        stats.prefill_seconds += time.perf_counter() - started

        while True:
            # 1. Draft up to k tokens after everything committed.
            started = time.perf_counter()
            remaining = config.max_new_tokens - (len(tokens) - len(prompt_ids))
            k_wanted = controller.choose_k(source=self._next_source(tokens)) if adaptive else k_longest
            k_step = min(k_wanted, remaining - 1)  # drafts past max_new_tokens would be thrown away
            if k_step > 0:
                if grammar is not None and getattr(self.drafter, "drafts_under_grammar", False):
                    proposal = self.drafter.propose(tokens, k_step, params, generator, grammar)  # masked q
                else:
                    proposal = self.drafter.propose(tokens, k_step, params, generator)
            else:
                proposal = Proposal(torch.empty(1, 0, dtype=torch.long), None)
            proposal = cut_to_grammar(proposal, grammar)  # drafts the grammar forbids are not verified
            drafted = proposal.num_tokens
            stats.draft_forwards += proposal.forwards
            verifying = time.perf_counter()
            stats.draft_seconds += verifying - started

            # 2. Verify: one target forward over the pending token and the drafts.
            inputs = torch.cat([torch.tensor([[tokens[-1]]]), proposal.token_ids], dim=1)  # (1, 1 + k)
            logits = target.forward(inputs, cache)  # (1, 1 + k, V)
            drafts = proposal.token_ids[0].tolist()
            allowed = grammar.masks_along(drafts)[None] if grammar else None  # (1, 1 + k, V)
            history = TokenHistory(tokens + drafts, len(prompt_ids)) if params.penalized else None
            p = logits_to_probs(logits, params, allowed, history)  # (1, 1 + k, V)

            # 3. Accept/reject: accepted drafts, then one recovered or bonus token.
            result = verify(proposal.token_ids, proposal.probs, p, generator)
            num_accepted = int(result.num_accepted[0])
            new_tokens = result.token_ids[0, : num_accepted + 1].tolist()

            # 4. Commit the pending token and the accepted drafts; rejected slots are just not kept.
            cache.commit(1 + num_accepted)
            tokens.extend(new_tokens)
            if grammar is not None:
                grammar.advance(new_tokens)
            verify_seconds = time.perf_counter() - verifying
            stats.record_step(drafted, num_accepted, proposal.source)
            stats.verify_seconds += verify_seconds
            draft_seconds = verifying - started - proposal.catch_up_seconds  # a backlog fed is not drafting
            controller.observe(proposal.source, drafted, num_accepted, draft_seconds, 1 + drafted, verify_seconds)
            yield _Step(new_tokens)

    def _next_source(self, tokens: list[int]) -> str | None:
        """The drafter about to propose, when the drafter knows (a composite's lookup or model); else None."""
        next_source = getattr(self.drafter, "next_source", None)
        return next_source(tokens) if next_source is not None else None


class TextStream:
    """Iterates text deltas of one request; stops on eos ids, stop strings or max_new_tokens."""

    def __init__(
        self, engine: SpeculativeEngine, prompt_ids: list[int], config: GenerationConfig, grammar: Grammar | None = None
    ) -> None:
        self.engine = engine
        self.grammar = grammar
        self.prompt_ids = prompt_ids
        self.config = config
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.result: GenerationResult | None = None
        self._text = TextAssembler(engine.target.decode, config.stop_strings)
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
        return list(self._text.token_ids)

    def _run(self) -> Iterator[str]:
        config = self.config
        target = self.engine.target
        eos = set(config.eos_token_ids if config.eos_token_ids is not None else target.eos_token_ids)
        text = self._text
        started = time.perf_counter()
        # 5. Stop checks after each step: eos id, max_new_tokens, stop strings.
        for step in self.engine._steps(self.prompt_ids, config, self.stats, self.grammar):
            finish_reason = text.add_step(step.token_ids, eos, config.max_new_tokens)
            done = finish_reason is not None
            if done:
                self._finish(finish_reason, started)
            yield text.release(final=done)
            if done:
                return

    def _finish(self, finish_reason: str, started: float) -> None:
        self.stats.new_tokens = len(self._text.token_ids)
        self.stats.total_seconds = time.perf_counter() - started
        self.result = GenerationResult(self._text.text, list(self._text.token_ids), self.stats, finish_reason)
