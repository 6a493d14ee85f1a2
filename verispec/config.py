"""What one request asks for: its length, sampling, stops, drafting and constraints (library and server alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.sampling import MAX_TOP_LOGPROBS, SamplingParams


def check_drafting(k: int | str, k_max: int, draft_p_min: float) -> None:
    """A ValueError that says which drafting setting is wrong and why (a request's, or a scheduler's own)."""
    if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"k (draft tokens per step) must be 'auto' or an integer >= 0, got {k!r}")
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    if not 0.0 <= draft_p_min <= 1.0:
        raise ValueError(f"draft_p_min is a probability, 0 to 1 (0: never end a draft early), got {draft_p_min}")


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0  # same seed and settings with a fixed k: same output (auto's k depends on timing)
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's own
    k: int | str = "auto"  # draft tokens per step, or "auto": chosen each step by the controller
    k_max: int = 8  # the longest draft "auto" considers
    # A draft model's or head's draft ends before a token it gave less than this probability (0: never; llama.cpp's
    # --draft-p-min). Lossless whatever the value; measured on a Zen 4 it neither paid nor cost clearly (benchmarks/
    # results/zen4/draft-p-min), so it is off. Served: `verispec serve --draft-p-min`.
    draft_p_min: float = 0.0
    # This request's own cap on draft tokens per step, whatever the engine or server would choose (0: this request
    # is decoded plainly, also in a batch that speculates); None: no cap of its own. Served: `max_draft_tokens`.
    max_draft_tokens: int | None = None
    logprobs: int | None = None  # served: each emitted token's log-probability and this many alternatives
    json_schema: dict | None = None  # structured output: the completion is one JSON document valid under it
    lark_grammar: str | None = None  # or a grammar in llguidance's Lark syntax (served tool calls use one)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_drafting(self.k, self.k_max, self.draft_p_min)
        if self.max_draft_tokens is not None and (
            isinstance(self.max_draft_tokens, bool) or not isinstance(self.max_draft_tokens, int) or self.max_draft_tokens < 0
        ):
            raise ValueError(f"max_draft_tokens must be None or an integer >= 0 (0: no speculation), got {self.max_draft_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be None or 0..{MAX_TOP_LOGPROBS} alternatives, got {self.logprobs}")
        if self.json_schema is not None and self.lark_grammar is not None:
            raise ValueError("give a json_schema or a lark_grammar, not both")
        if (self.json_schema is not None or self.lark_grammar is not None) and self.eos_token_ids == ():
            raise ValueError("structured output ends with an end-of-sequence id: it cannot ignore them (ignore_eos)")

    @property
    def longest_draft(self) -> int:
        longest = self.k_max if self.k == "auto" else self.k
        return longest if self.max_draft_tokens is None else min(longest, self.max_draft_tokens)
