"""How often a drafter source's drafts pass, by position: the controller's estimate of the tokens a draft adds.

alpha[s][i]: chance that draft position i (1-based) from drafter source s is accepted, given positions before it
were: decayed counts, hits over steps that reached it (each step of that source counts 1 - 1/acceptance_memory times
as much as the one after it), shrunk towards a prior worth prior_steps steps: prior_acceptance for the first position,
the estimate of the position before for every later one. A position hardly reached (deeper than the drafts tried) thus
reads as the one before it, and what it measured long ago fades into that; a new source learns from its first few
steps, a measured one moves only as much as its memory allows (a moving average of a few steps swings with every lucky
or unlucky stretch, and each swing below break-even is a run of plain steps).

With A_i = alpha_1 * ... * alpha_i, k drafts are expected to yield E(k) = 1 + A_1 + ... + A_k tokens per sequence
(verispec.policy divides that by what verispec.cost_model prices the step at).

A source's record also holds the seconds of one of its draft positions by batch size (draft_cost): the cost model
prices and observes those; this module only keeps them beside the source's acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceAverages:
    """What the controller measured of one drafter source: acceptance by position, and draft cost by batch size."""

    hits: list[float]  # (k_max,) decayed count of steps whose draft at each position was accepted
    reached: list[float]  # (k_max,) decayed count of steps that drafted at each position, with all before accepted
    prior: float  # the first position's acceptance before any step
    prior_steps: float  # what a position's prior weighs, in steps (ControllerSettings.prior_steps)
    draft_cost: dict[int, float] = field(default_factory=dict)  # batch size -> seconds per draft position
    # batch size -> the least seconds per draft position timed before any step (CostModel.seed) or measured since
    least_draft_cost: dict[int, float] = field(default_factory=dict)
    name: str | None = None  # the source these are of (its whole steps' overhead, see CostModel.step_overhead)

    @classmethod
    def start(cls, k_max: int, prior: float, prior_steps: float, name: str | None = None) -> "SourceAverages":
        averages = cls([0.0] * k_max, [0.0] * k_max, prior, prior_steps, name=name)
        averages.forget_first()
        return averages

    def forget_first(self) -> None:
        """The first position back to its prior: prior_steps steps at prior acceptance (they fade as steps do)."""
        self.hits[0], self.reached[0] = self.prior_steps * self.prior, self.prior_steps

    def acceptance(self) -> list[float]:
        """(k_max,) acceptance by position given reached: the first position's counts (its prior among them); each
        later one's shrunk towards the estimate of the one before, by prior_steps steps."""
        rates = [self.hits[0] / self.reached[0]]
        for hits, reached in zip(self.hits[1:], self.reached[1:]):
            rates.append((hits + self.prior_steps * rates[-1]) / (reached + self.prior_steps))
        return rates

    def assume(self, rates: list[float], steps: float) -> None:
        """As if `steps` steps had reached every position and measured `rates`."""
        self.hits = [rate * steps for rate in rates]
        self.reached = [float(steps)] * len(rates)

    def record(self, drafted: int, accepted: int, memory: float, weight: float = 1.0) -> None:
        """One row's step that drafted `drafted` positions, of which the first `accepted` passed; `weight`: the row's
        share of its step (1 / batch size). Older observations fade by that share of a step: the memory is in
        steps, so the rows of a batch each count, and a batch remembers as many steps as a single sequence.
        Where every draft passed, the position just beyond is credited too (beyond_all_passed)."""
        keep = (1.0 - 1.0 / memory) ** weight
        beyond = self.beyond_all_passed(drafted, accepted)
        self.hits = [h * keep for h in self.hits]
        self.reached = [n * keep for n in self.reached]
        for position in range(min(drafted, accepted + 1)):  # positions reached: all accepted, then the first rejected
            self.reached[position] += 1.0
            self.hits[position] += 1.0 if position < accepted else 0.0
        if beyond is not None:
            self.reached[drafted] += weight
            self.hits[drafted] += weight * beyond

    def beyond_all_passed(self, drafted: int, accepted: int) -> float | None:
        """The all-passed rule: where every draft passed, the position just beyond counts the row's share of a step at
        the deepest one's estimate (returned; None where a draft failed or no position lies beyond), because the next
        draft might have passed too, and a deep position measured low once (a stretch the drafter guessed badly)
        would else keep k short for long, short drafts never reaching it to measure it again."""
        return self.acceptance()[drafted - 1] if accepted == drafted < len(self.hits) else None
