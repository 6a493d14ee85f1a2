"""Per-request statistics, returned as data: one record for the library and the server (its usage and metrics)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache (server)
    new_tokens: int = 0  # tokens returned to the caller (after stop handling)
    target_forwards: int = 0  # decode-time target forwards (one per step; prefill not counted)
    draft_forwards: int = 0  # draft model forwards, prefill not counted
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_by_position: list[int] = field(default_factory=list)  # [i]: steps that drafted position i
    accepted_by_position: list[int] = field(default_factory=list)  # [i]: of those, accepted at position i
    # acceptance_by_position[i] = accepted / drafted at position i (so it includes earlier rejections)
    steps_by_drafter: dict[str, int] = field(default_factory=dict)  # which drafter proposed, per step
    k_histogram: dict[int, int] = field(default_factory=dict)  # drafted tokens per step -> steps
    prefill_seconds: float = 0.0  # target and draft prompt processing
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # target forward, accept/reject and commit
    total_seconds: float = 0.0  # from the request to its last token
    time_to_first_token: float | None = None  # seconds from the request to its first generated token

    controller: object = field(default=None, repr=False, compare=False)  # the request's cost measurements

    @property
    def plain_seconds_estimate(self) -> float | None:
        """What plain decoding would have taken for this output: prefill + one measured plain step per token."""
        per_token = self.controller.plain_seconds_per_token() if self.controller is not None else None
        return None if per_token is None else self.prefill_seconds + self.new_tokens * per_token

    @property
    def counterfactual_speedup(self) -> float | None:
        plain = self.plain_seconds_estimate
        return plain / self.total_seconds if plain is not None and self.total_seconds > 0 else None

    @property
    def completion_tokens(self) -> int:
        """OpenAI's name for new_tokens."""
        return self.new_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decode = self.total_seconds - self.prefill_seconds
        return self.new_tokens / decode if decode > 0 else 0.0

    def record_step(self, num_drafted: int, num_accepted: int, source: str = "") -> None:
        while len(self.drafted_by_position) < num_drafted:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for position in range(num_drafted):
            self.drafted_by_position[position] += 1
            if position < num_accepted:
                self.accepted_by_position[position] += 1
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.target_forwards += 1
        self.k_histogram[num_drafted] = self.k_histogram.get(num_drafted, 0) + 1
        if num_drafted:
            self.steps_by_drafter[source] = self.steps_by_drafter.get(source, 0) + 1

    def snapshot(self) -> "GenerationStats":
        """A copy that later steps do not change (the controller is shared, not copied)."""
        copied = copy.copy(self)
        for name in ("drafted_by_position", "accepted_by_position", "steps_by_drafter", "k_histogram"):
            setattr(copied, name, copy.copy(getattr(self, name)))
        return copied

    def usage(self) -> dict:
        """What a served response reports of its speculation (its "speculative" block)."""
        ttft = self.time_to_first_token
        return {
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "target_forwards": self.target_forwards,
            "tokens_per_target_forward": round(self.mean_tokens_per_target_forward, 4),
            "time_to_first_token": None if ttft is None else round(ttft, 4),
            "total_seconds": round(self.total_seconds, 4),
        }

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "controller"}
        for name in (
            "plain_seconds_estimate",
            "counterfactual_speedup",
            "acceptance_rate",
            "mean_tokens_per_target_forward",
            "acceptance_by_position",
            "tokens_per_second",
            "decode_tokens_per_second",
        ):
            data[name] = getattr(self, name)
        return data
