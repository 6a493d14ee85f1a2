"""Benchmark modes: one way of decoding a prompt, timed the same way for ours and for peers.

Every mode returns a `Run`: the generated ids plus the time at which each token became available,
so end-to-end and decode-only speed, time to first token and per-token latency are computed by
one function for all modes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from verispec.engine import GenerationConfig, SpeculativeEngine


@dataclass
class Run:
    token_ids: list[int]
    seconds: float  # wall time from the request to the last token
    token_times: list[float]  # seconds since the request at which each token was available
    stats: dict = field(default_factory=dict)  # engine statistics where the mode has them

    @property
    def ttft(self) -> float:
        return self.token_times[0] if self.token_times else self.seconds

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, over the time after the first: excludes prompt processing."""
        decode = self.seconds - self.ttft
        return (len(self.token_ids) - 1) / decode if decode > 0 and len(self.token_ids) > 1 else 0.0

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gap before each token after the first; tokens verified together arrive together (gap 0)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


class EngineMode:
    """Our engine: plain (k = 0) or speculative with a given drafter and k.

    constrained: the prompt's json_schema (if any) constrains the output; False runs it free.
    """

    def __init__(self, name: str, engine: SpeculativeEngine, k: int, constrained: bool = True) -> None:
        self.name, self.engine, self.k, self.constrained = name, engine, k, constrained

    def run(self, prompt: str, config: GenerationConfig) -> Run:
        config = GenerationConfig(
            max_new_tokens=config.max_new_tokens, sampling=config.sampling, seed=config.seed,
            stop_strings=config.stop_strings, eos_token_ids=config.eos_token_ids, k=self.k,
            json_schema=config.json_schema if self.constrained else None,
        )
        started = time.perf_counter()
        times: list[float] = []
        stream = self.engine.stream(prompt, config)
        count = 0
        for _ in stream.steps():
            now = time.perf_counter() - started
            new = len(stream.token_ids) - count
            times.extend([now] * new)
            count += new
        result = stream.result
        return Run(result.token_ids, time.perf_counter() - started, times, result.stats.to_dict())


class _TimingStreamer:
    """A transformers streamer that records when each new token arrives."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:  # generate() first hands over the prompt
            self.seen_prompt = True
            return
        self.times.extend([time.perf_counter() - self.started] * value.numel())

    def end(self) -> None:
        pass


class HuggingFaceMode:
    """Hugging Face `generate`, plain or with `assistant_model`, on the same weights and dtype."""

    constrained = False  # no json_schema support: the bench refuses such modes on a workload with schemas

    def __init__(self, name: str, model, tokenizer, eos_token_ids, assistant=None, assistant_tokens: int | None = None):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.assistant = assistant
        self.assistant_tokens = assistant_tokens  # None: transformers' default settings
        if assistant is not None:
            config = assistant.generation_config
            self._defaults = (config.num_assistant_tokens_schedule, config.num_assistant_tokens)

    @torch.inference_mode()
    def run(self, prompt: str, config: GenerationConfig) -> Run:
        ids = torch.tensor([self.tokenizer.encode(prompt, add_special_tokens=False)])
        kwargs = {"max_new_tokens": config.max_new_tokens, "eos_token_id": self.eos_token_ids,
                  "pad_token_id": self.eos_token_ids[0]}
        sampling = config.sampling
        if sampling.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                          top_p=sampling.top_p, min_p=sampling.min_p or None)
            torch.manual_seed(config.seed)
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
            gen_config = self.assistant.generation_config
            if self.assistant_tokens is None:  # the schedule adapts during a run: restore it each time
                gen_config.num_assistant_tokens_schedule, gen_config.num_assistant_tokens = self._defaults
            else:
                gen_config.num_assistant_tokens_schedule = "constant"
                gen_config.num_assistant_tokens = self.assistant_tokens
        started = time.perf_counter()
        streamer = _TimingStreamer(started)
        output = self.model.generate(ids, streamer=streamer, **kwargs)
        seconds = time.perf_counter() - started
        new = output[0, ids.shape[1]:].tolist()
        return Run(new, seconds, streamer.times[: len(new)])
