"""What a step costs on this machine: seconds of drafting and of the target's forward, measured online.

Speculation pays only when the tokens it is expected to add (verispec.acceptance) outweigh what drafting and the
longer verify pass cost, and the costs differ by machine, model pair and workload. So they are measured here, on this
machine, during the request:

- draft_cost[s](b): seconds per draft position from source s when b sequences draft together (one batched draft-model
  forward; ~0 for lookup), averaged per b and interpolated. Beyond the largest b measured it grows as the target's
  own forward grows from that size to b (both are forwards of the same kind of model over b rows): a line through a
  single size is flat, and would price a many-row draft forward like a one-row one, so a busy server would draft at
  a loss.
- verify_cost(n): seconds of one target forward over n tokens in all, averaged per n and interpolated. One forward is
  one observation however many rows it verified, and a forward slower than slow_forward_clip times the average counts
  as that. Counted once per row, a batch's shared forward would outweigh all before it; and one forward slowed by
  something else on the machine would price plain steps so high that the controller drafts at a loss and never
  measures a plain step again.
- step overhead: what a step costs besides the draft and the verify pass (sampling, acceptance, a draft model's small
  catch-ups, Python) differs between drafting and plain steps, so the forwards alone can predict a gain from a short
  draft where whole steps measure none. So whole steps are measured too: the seconds each took beyond what the
  forwards price, per source that drafted (None: plain) and batch size (observe_step); that overhead joins the step's
  cost. An overhead, not a rate: seconds per committed token would mix a step's luck (how many drafts passed) into
  its cost, and one unlucky first draft could keep a lookup that usually passes from ever drafting again.

A batch of b sequences drafting k each spends draft_cost(b) * k + verify_cost(b * (k + 1)) + overhead seconds on a step
(step_seconds). As the batch grows the verify pass stops being memory-bound and costs more per token.

Costs measured before the first request (the whole forwards of both models, `seed`) let the first steps choose by them
rather than try: on a machine where no draft can pay, the first request never pays for finding that out.

A draft model far behind a sequence (its prompt, or plain steps it sat out) must first catch up on those tokens, once.
That is not the cost of a draft position, so it is kept apart (catch_up_per_token); the controller weighs it
(verispec.policy, catch_up_pays).

The same arithmetic prices a prompt's chunk packed beside decoding rows (estimated_forward_seconds, prompt_chunk).

Rules, each a function or method with its why and a test of its own (tests/test_policy.py): the widest span
(interpolate), a slow forward clipped (clip_slow_forward), stale seeds (check_seeds), a draft over more rows grows as
the target's (_draft_seconds), a drafting step's overhead never below a plain one's (overhead), a wider forward never
cheaper (step_seconds).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from verispec.acceptance import SourceAverages
from verispec.controller_settings import ControllerSettings

# A prompt's chunk is the smallest that admits it within this much of the fastest rate (fewer, shorter stalls).
CHUNK_TOLERANCE = 0.15


def moving_average(average: float | None, value: float, weight: float) -> float:
    """The newest value's weight `weight`, the old average's the rest; the first value is the average."""
    return value if average is None else (1 - weight) * average + weight * value


def interpolate(table: dict[int, float], x: int) -> float | None:
    """table[x] if measured, else a straight line through measured sizes (None if empty).

    Between measured sizes: the line through the two nearest. Beyond them: the line through the
    smallest and the largest, never falling. Two neighbouring sizes (15 and 16 sequences, say) differ
    by little more than noise, so a line through them alone would price a long verify pass like a
    short one.
    """
    values = interpolated_range(table, x, x)
    return None if values is None else values[0]


def interpolated_range(table: dict[int, float], first: int, last: int) -> list[float] | None:
    """[interpolate(table, x) for x in first .. last], sorting the table once (None if empty)."""
    if not table:
        return None
    seen = sorted(table)
    if len(seen) == 1:
        return [table[seen[0]]] * (last - first + 1)
    slope = max((table[seen[-1]] - table[seen[0]]) / (seen[-1] - seen[0]), 0.0)
    values = []
    for x in range(first, last + 1):
        if x in table:
            values.append(table[x])
        elif seen[0] < x < seen[-1]:
            above = bisect.bisect_left(seen, x)
            low, high = seen[above - 1], seen[above]
            values.append(table[low] + (table[high] - table[low]) * (x - low) / (high - low))
        else:
            nearest = seen[-1] if x > seen[-1] else seen[0]
            values.append(max(table[nearest] + slope * (x - nearest), 1e-6))
    return values


def estimated_forward_seconds(costs: dict[int, float], tokens: int, token_seconds: float) -> float:
    """Seconds of a forward over `tokens` tokens, from measured costs (seconds by tokens in all).

    Between measured sizes: the line through the two around it; below the smallest: its flat cost;
    beyond the largest: that cost plus token_seconds per further token; nothing measured: token_seconds
    a token.
    """
    seen = sorted(costs)
    if not seen:
        return tokens * token_seconds
    if tokens >= seen[-1]:
        return costs[seen[-1]] + (tokens - seen[-1]) * token_seconds
    if tokens <= seen[0]:
        return costs[seen[0]]
    above = bisect.bisect_left(seen, tokens)
    low, high = seen[above - 1], seen[above]
    return costs[low] + (costs[high] - costs[low]) * (tokens - low) / (high - low)


def prompt_chunk(
    costs: dict[int, float], base_tokens: int, share: float, draft_seconds: float, token_seconds: float, most: int,
    credit: float, stall_steps: float,
) -> tuple[int, float]:
    """(prompt tokens a decoding step over base_tokens carries, 0 .. most; the prompt's credit after it).

    The prompt has `share` of the streams' time on average, not in every step: each step saves share of itself
    (draft_seconds and a forward over base_tokens) into the prompt's credit, and carrying c tokens spends what they
    add to the forward, extra(c) = f(base + c) - f(base), as estimated_forward_seconds prices it from costs. A chunk
    of c tokens carried whenever the credit pays for it admits min(c, c * saved / extra(c)) tokens a step (saved: one
    step's share). The chunk is the smallest within CHUNK_TOLERANCE of the fastest among those that lengthen the
    step by stall_steps steps at most, or the rest of the prompt where the credit pays for that; the step carries
    nothing until the credit pays for it. Where a forward's cost
    grows by the same seconds a token, that is share of each step, each step. Where it jumps (a kernel for a few
    rows, then another), chunks just past the jump would pay the jump for a few tokens, many times a prefill's cost
    per token, and a prompt among a few cheap streams would crawl in: the chunk is large enough to pay it instead.
    """
    forward = estimated_forward_seconds(costs, base_tokens, token_seconds)
    step = draft_seconds + forward
    saved = share * step
    if saved <= 0:  # no share: a token a step, so that a prompt always goes in
        return 1, credit
    extra = [max(estimated_forward_seconds(costs, base_tokens + c, token_seconds) - forward, 0.0)
             for c in range(1, most + 1)]  # extra[c - 1]: seconds c prompt tokens add to the forward
    fitting = [c for c in range(1, most + 1) if extra[c - 1] <= stall_steps * step] or [1]
    rate = {c: min(c, c * saved / extra[c - 1]) if extra[c - 1] > 0 else c for c in fitting}  # tokens a step
    fastest = max(rate.values())
    size = min(c for c in fitting if rate[c] * (1 + CHUNK_TOLERANCE) >= fastest)
    credit += saved
    if most in rate and extra[most - 1] <= credit:  # what is left of the prompt, at once
        size = most
    if extra[size - 1] > credit:
        return 0, credit
    return size, min(credit - extra[size - 1], saved)


@dataclass
class CostModel:
    """The measured costs of a step's parts (see the module docstring); the controller (verispec.policy) is one."""

    settings: ControllerSettings = field(default_factory=ControllerSettings)
    sources: dict[str, SourceAverages] = field(default_factory=dict)  # by drafter source: acceptance, draft cost
    verify_cost: dict[int, float] = field(default_factory=dict)  # tokens in the forward -> seconds
    catch_up_per_token: float | None = None  # seconds a draft model takes per committed token it catches up on
    # (source that drafted, or None for a plain step; batch size) -> seconds a whole step took beyond its priced
    # parts (drafting and the forward): see observe_step
    step_overhead: dict[tuple[str | None, int], float] = field(default_factory=dict)
    plain_batches: set[int] = field(default_factory=set)  # batch sizes whose plain step was measured (observe_forward)
    seeded: dict[int, float] = field(default_factory=dict)  # seeded one-row forwards by tokens, until a step checks
    seeded_drafts: set[str] = field(default_factory=set)  # sources whose draft cost is the seed's
    stale_seed: float | None = None  # a step's forward over its seed, where they differed by more than seed_tolerance
    seeded_catch_up: bool = False  # whether catch_up_per_token is the seed's

    def _source(self, name: str) -> SourceAverages:
        if name not in self.sources:
            k_max = self.settings.k_max
            self.sources[name] = SourceAverages.start(
                k_max, self.settings.prior_acceptance, self.settings.prior_steps, name
            )
        return self.sources[name]

    def seed(
        self, verify_cost: dict[int, float], draft_cost: dict[str, float] | None = None,
        catch_up_per_token: float | None = None,
    ) -> None:
        """Start from costs measured before any step: seconds of a target forward by tokens in it, of one draft
        position by source (a batch of one), of a draft-model catch-up per token. What steps measure later
        moves them as it moves any average; the first step's forward checks them (check_seeds)."""
        for tokens, seconds in verify_cost.items():
            self.verify_cost.setdefault(tokens, seconds)
            self.seeded.setdefault(tokens, seconds)
        for source, seconds in (draft_cost or {}).items():
            averages = self._source(source)
            if not averages.draft_cost:
                averages.draft_cost[1] = averages.least_draft_cost[1] = seconds
                self.seeded_drafts.add(source)
        if self.catch_up_per_token is None:
            self.catch_up_per_token = catch_up_per_token
            self.seeded_catch_up = catch_up_per_token is not None

    def observe_forward(self, tokens: int, seconds: float, rows: int = 1) -> None:
        """Record one verify forward over `tokens` tokens in all, of `rows` rows: it took `seconds`. Only a forward of
        one token a row is a plain step of that batch size (a one-row 4-token forward is not a 4-row plain step)."""
        if tokens == rows:
            self.plain_batches.add(rows)
        if rows == 1 and tokens in self.seeded:
            self.check_seeds(seconds / self.seeded[tokens])
        average = self.verify_cost.get(tokens)
        seconds = self.clip_slow_forward(average, seconds)
        self.verify_cost[tokens] = moving_average(average, seconds, self.settings.smoothing)

    def clip_slow_forward(self, average: float | None, seconds: float) -> float:
        """A forward slower than slow_forward_clip times its average counts as that, because one forward slowed by
        something else on the machine would price plain steps so high that drafting at a loss looked best, and plain
        steps at that size were never measured again."""
        return seconds if average is None else min(seconds, self.settings.slow_forward_clip * average)

    def check_seeds(self, ratio: float) -> None:
        """The stale-seed rule: where the first step's one-row forward took more than seed_tolerance times its seed
        (`ratio`, either way), the forwards still unmeasured are scaled by it and the seeded draft position and
        catch-up forgotten (stale_seed says so), because seeds timed in a loaded moment and remembered could price a
        draft far too dear (a load slows the two models unequally) that, never drafted, would never be measured again
        and rule drafting out for good. Checked once."""
        seeded, self.seeded = self.seeded, {}
        if 1 / self.settings.seed_tolerance <= ratio <= self.settings.seed_tolerance:
            return
        self.stale_seed = ratio
        for tokens, seconds in seeded.items():
            if self.verify_cost.get(tokens) == seconds:
                self.verify_cost[tokens] = seconds * ratio
        for source in self.seeded_drafts:
            del self.sources[source].draft_cost[1], self.sources[source].least_draft_cost[1]
        self.seeded_drafts.clear()
        if self.seeded_catch_up:
            self.catch_up_per_token, self.seeded_catch_up = None, False

    def observe_draft(self, source: str, draft_seconds: float, drafted: int, batch_size: int) -> None:
        """Record a step's drafting of `drafted` positions from `source` for `batch_size` rows; called once per row,
        each row's share weighs 1 / batch_size of a step."""
        averages = self._source(source)
        w = self.settings.smoothing
        per_position = draft_seconds / drafted
        self.seeded_drafts.discard(source)
        averages.draft_cost[batch_size] = moving_average(
            averages.draft_cost.get(batch_size), per_position, w / max(batch_size, 1)
        )
        if batch_size in averages.least_draft_cost:
            averages.least_draft_cost[batch_size] = min(averages.least_draft_cost[batch_size], per_position)

    def observe_step(self, source: str | None, batch_size: int, seconds: float, priced_seconds: float) -> None:
        """Record a whole step of `batch_size` sequences in which only `source` drafted (None: a plain step):
        it took `seconds`, of which the cost model prices `priced_seconds` (the drafting and the forward)."""
        key = (source, batch_size)
        overhead = max(seconds - priced_seconds, 0.0)
        self.step_overhead[key] = moving_average(self.step_overhead.get(key), overhead, self.settings.smoothing)

    def observe_catch_up(self, seconds: float, tokens: int) -> None:
        """Record a draft model feeding `tokens` committed tokens it had not seen (a prompt, plain steps)."""
        if tokens > 0:
            self.seeded_catch_up = False
            self.catch_up_per_token = moving_average(self.catch_up_per_token, seconds / tokens, self.settings.smoothing)

    def _verify_seconds(self, tokens: int) -> float | None:
        """Measured cost of a forward over `tokens`, linearly inter/extrapolated from what was seen."""
        return interpolate(self.verify_cost, tokens)

    def _draft_seconds(self, averages: SourceAverages, batch_size: int) -> float | None:
        """Seconds of one draft position for `batch_size` rows: measured or interpolated; beyond the largest batch
        size measured, scaled from it as the target's measured forward over as many rows grows (never less than the
        line through the sizes measured), because a line through a single size is flat and would price a many-row
        draft forward like a one-row one, so a busy server would draft at a loss."""
        line = interpolate(averages.draft_cost, batch_size)
        largest = max(averages.draft_cost, default=None)
        if line is None or batch_size <= largest:
            return line
        here, there = self._verify_seconds(batch_size), self._verify_seconds(largest)
        if not here or not there:
            return line
        return max(line, averages.draft_cost[largest] * here / there)

    def overhead(self, source: str | None, batch_size: int) -> float:
        """Seconds a whole step takes beyond its drafting and forward: measured for this source (None: plain) at this
        batch size, and never less than what plain steps measured, because a drafting step does all that a plain one
        does (measured below it, the difference is noise; read as a gain, it would keep a free drafter that never
        agrees drafting wherever a two-token pass costs what a one-token one does)."""
        plain = self.step_overhead.get((None, batch_size), 0.0)
        return plain if source is None else max(self.step_overhead.get((source, batch_size), plain), plain)

    def step_seconds(self, k: int, averages: SourceAverages, batch_size: int = 1) -> float | None:
        """Seconds of a step of `batch_size` rows drafting k each from `averages`' source (k = 0: plain), or None
        before a forward was measured. A wider forward is never priced cheaper than a plain one, because a lower
        measure is noise that would read as a free gain; a source whose drafts were never timed drafts for free, so
        that it is tried, at the k the forwards' costs suggest."""
        verify = self._verify_seconds(batch_size * (k + 1))
        draft = self._draft_seconds(averages, batch_size) if k > 0 else 0.0
        if verify is None:
            return None
        draft = draft or 0.0
        verify = max(verify, self._verify_seconds(batch_size))
        overhead = self.overhead(averages.name if k > 0 else None, batch_size)
        return draft * k + verify + overhead

    def plain_seconds_per_token(self) -> float | None:
        """What one plain decoding step costs here (for the counterfactual speedup).

        Measured when a step verified one token; else extrapolated from two or more sizes; else unknown.
        """
        if 1 not in self.verify_cost and len(self.verify_cost) < 2:
            return None
        return self._verify_seconds(1)
