"""How much to speculate: before each step, pick the k that maximises expected tokens per second.

Speculation pays only when the tokens it is expected to add outweigh what drafting and the longer
verify pass cost, and both sides differ by machine, model pair and workload. So the controller
measures them online, on this machine, during the request:

- alpha[s][i]: chance that draft position i (1-based) from drafter source s is accepted, given
  positions before it were: decayed counts, hits over steps that reached it (each step of that
  source counts 1 - 1/acceptance_memory times as much as the one after it), shrunk towards a prior worth
  prior_steps steps: prior_acceptance for the first position, the estimate of the position before
  for every later one. A position hardly reached (deeper than the drafts tried) thus reads as the one
  before it, and what it measured long ago fades into that; a new source learns from its first few
  steps, a measured one moves only as much as its memory allows (a moving average of a few steps
  swings with every lucky or unlucky stretch, and each swing below break-even is a run of plain steps).
- draft_cost[s](b): seconds per draft position from source s when b sequences draft together (one
  batched draft-model forward; ~0 for lookup), averaged per b and interpolated. Beyond the largest b
  measured it grows as the target's own forward grows from that size to b (both are forwards of
  the same kind of model over b rows): a line through a single size is flat, and would price a
  many-row draft forward like a one-row one, so a busy server would draft at a loss.
- verify_cost(n): seconds of one target forward over n tokens in all, averaged per n and interpolated.
  One forward is one observation however many rows it verified, and a forward slower than
  slow_forward_clip times the average counts as that. Counted once per row, a batch's shared forward
  would outweigh all before it; and one forward slowed by something else on the machine would price
  plain steps so high that the controller drafts at a loss and never measures a plain step again.

With A_i = alpha_1 * ... * alpha_i, k drafts are expected to yield E(k) = 1 + A_1 + ... + A_k tokens
per sequence; a batch of b sequences spends draft_cost(b) * k + verify_cost(b * (k + 1)) seconds on
them. The controller picks argmax E(k) / seconds over k = 0 .. k_max, where k = 0 is plain
decoding; a single request is b = 1. As the batch grows the verify pass stops being memory-bound
and costs more per token, so the same acceptance buys less and the chosen k falls.

The first step at a batch size b > 1 is plain (k = 0): its cost anchors what each extra token costs. Costs
seeded before any step (one row's forwards) do not count as that step: a forward of 4 tokens for one row
is not one of 4 rows, and priced as one it had a 16-client server draft while its first wave went in.
When it has chosen k = 0 for probe_every * b steps in a row it probes with k = 1 (one cheap draft
token) so it notices when the drafter starts to agree again (each probe that finds plain decoding still best
doubles that wait, up to max_probe_backoff times); unless the costs alone rule drafting
out (it would not pay by min_gain even if every draft were accepted), when a probe could learn nothing.
A draft model's probe row far behind sees only the latest tokens (the scheduler's PROBE_WINDOW), so a
probe costs the same however long the text.

The cost model leaves out what a step costs besides the draft and the verify pass (sampling, acceptance,
a draft model's small catch-ups, Python), which differs between drafting and plain steps, so it can predict
a gain from a short draft where whole steps measure none. So whole steps are measured too:
the seconds each whole step took beyond what the model prices (its drafting and its forward), per source
that drafted (None: plain) and batch size (observe_step); that overhead joins the step's cost. An overhead,
not a rate: seconds per committed token would mix a step's luck (how many drafts passed) into its cost, and
one unlucky first draft could keep a lookup that usually passes from ever drafting again.

Costs measured before the first request (the whole forwards of both models, `seed`) let the first steps
choose by them rather than try: on a machine where no draft can pay, the first request never pays for
finding that out.

A draft model far behind a sequence (its prompt, or plain steps it sat out) must first catch up on
those tokens, once. That is not the cost of a draft position, so it is kept apart (catch_up_per_token)
and weighed by `catch_up_pays` against what drafting saves over the remaining tokens. Every row's
catch-up stalls the whole batch, and the saving is the batch's too: the rows that catch up in one
step share one saving (16 chat rows caught up at once cost 1.3 s, ten plain steps, for a saving
each was priced to win back alone).
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field


def moving_average(average: float | None, value: float, weight: float) -> float:
    """The newest value's weight `weight`, the old average's the rest; the first value is the average."""
    return value if average is None else (1 - weight) * average + weight * value


@dataclass
class ControllerSettings:
    k_max: int = 8  # longest draft considered
    smoothing: float = 0.15  # weight of the newest observation in every moving average of a cost
    acceptance_memory: float = 32.0  # steps of a source its acceptance counts remember (see _Averages)
    prior_acceptance: float = 0.7  # optimistic start, so speculation is tried before it is judged
    probe_every: int = 8  # after this many plain steps in a row (times the batch size), try k = 1 once
    first_k: int = 4  # k of the very first step, before anything was measured
    # Drafting must be expected to beat plain decoding by this much: where the verify pass costs about the same
    # for 1 and k + 1 tokens, noise in two measured costs would otherwise keep drafts that are almost never accepted.
    min_gain: float = 0.05
    # Probes that keep finding plain decoding best come ever further apart, up to this many times probe_every: a
    # probe makes a draft model catch up on every token since the last one, a cost that frequent probes pay over
    # and over where there is nothing to find.
    max_probe_backoff: int = 16
    seed_tolerance: float = 2.0  # seeds a step's forward finds this many times off (either way) are stale (see seed)
    slow_forward_clip: float = 1.25  # a forward slower than this times its average counts as this (see verify_cost)
    row_prior_steps: float = 4.0  # a sequence's own acceptance counts as much as its source's after this many steps
    prior_steps: float = 2.0  # what a position's prior (prior_acceptance, or the position before) weighs, in steps


@dataclass
class _Averages:
    hits: list[float]  # (k_max,) decayed count of steps whose draft at each position was accepted
    reached: list[float]  # (k_max,) decayed count of steps that drafted at each position, with all before accepted
    prior: float  # the first position's acceptance before any step
    prior_steps: float  # what a position's prior weighs, in steps (ControllerSettings.prior_steps)
    draft_cost: dict[int, float] = field(default_factory=dict)  # batch size -> seconds per draft position
    name: str | None = None  # the source these are of (its whole steps' overhead, see step_overhead)

    @classmethod
    def start(cls, k_max: int, prior: float, prior_steps: float, name: str | None = None) -> "_Averages":
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

        Where every draft passed, the position just beyond counts `weight` of a step at the deepest one's estimate:
        the next draft might have passed too. Else a deep position measured low once (a stretch of text the drafter
        guessed badly) would keep k short for long, since short drafts never reach it to measure it again."""
        keep = (1.0 - 1.0 / memory) ** weight
        beyond = self.acceptance()[drafted - 1] if accepted == drafted < len(self.hits) else None
        self.hits = [h * keep for h in self.hits]
        self.reached = [n * keep for n in self.reached]
        for position in range(min(drafted, accepted + 1)):  # positions reached: all accepted, then the first rejected
            self.reached[position] += 1.0
            self.hits[position] += 1.0 if position < accepted else 0.0
        if beyond is not None:
            self.reached[drafted] += weight
            self.hits[drafted] += weight * beyond


@dataclass
class AdaptiveController:
    settings: ControllerSettings = field(default_factory=ControllerSettings)
    sources: dict[str, _Averages] = field(default_factory=dict)
    verify_cost: dict[int, float] = field(default_factory=dict)  # tokens in the forward -> seconds
    recent_sources: Counter = field(default_factory=Counter)
    plain_streak: int = 0
    chosen: Counter = field(default_factory=Counter)  # k -> steps (the histogram reported in stats)
    probing: bool = False  # whether the last choose_k returned a probe (k = 1 to re-measure acceptance)
    probe_backoff: int = 1  # probes come probe_every * batch size * this steps apart; doubled by each vain probe
    drafted_last: bool = False  # whether the last choice drafted (not as a probe): then it takes less to go on
    catch_up_per_token: float | None = None  # seconds a draft model takes per committed token it catches up on
    # (source that drafted, or None for a plain step; batch size) -> seconds a whole step took beyond its priced
    # parts (drafting and the forward): see observe_step
    step_overhead: dict[tuple[str | None, int], float] = field(default_factory=dict)
    plain_batches: set[int] = field(default_factory=set)  # batch sizes whose plain step was measured (observe_forward)
    seeded: dict[int, float] = field(default_factory=dict)  # seeded one-row forwards by tokens, until a step checks
    seeded_drafts: set[str] = field(default_factory=set)  # sources whose draft cost is the seed's
    stale_seed: float | None = None  # a step's forward over its seed, where they differed by more than seed_tolerance
    seeded_catch_up: bool = False  # whether catch_up_per_token is the seed's

    def _source(self, name: str) -> _Averages:
        if name not in self.sources:
            k_max = self.settings.k_max
            self.sources[name] = _Averages.start(k_max, self.settings.prior_acceptance, self.settings.prior_steps, name)
        return self.sources[name]

    def seed(
        self, verify_cost: dict[int, float], draft_cost: dict[str, float] | None = None,
        catch_up_per_token: float | None = None,
    ) -> None:
        """Start from costs measured before any step: seconds of a target forward by tokens in it, of one draft
        position by source (a batch of one), of a draft-model catch-up per token. What steps measure later
        moves them as it moves any average.

        All of them were timed in one moment, perhaps a loaded one, and may have been remembered from it: the first
        one-row forward a step measures at a seeded size checks them, and where it took seed_tolerance times
        more or less, the seeds are stale (stale_seed says so): the forwards still unmeasured are scaled by that
        factor and the draft and catch-up seeds dropped, to be measured when drafted. Else a draft seeded far too
        dear (a load slows the two models unequally), never drafted again to be measured, rules drafting out for
        good."""
        for tokens, seconds in verify_cost.items():
            self.verify_cost.setdefault(tokens, seconds)
            self.seeded.setdefault(tokens, seconds)
        for source, seconds in (draft_cost or {}).items():
            if not self._source(source).draft_cost:
                self._source(source).draft_cost[1] = seconds
                self.seeded_drafts.add(source)
        if self.catch_up_per_token is None:
            self.catch_up_per_token = catch_up_per_token
            self.seeded_catch_up = catch_up_per_token is not None

    def _verify_seconds(self, tokens: int) -> float | None:
        """Measured cost of a forward over `tokens`, linearly inter/extrapolated from what was seen."""
        return interpolate(self.verify_cost, tokens)

    def expected_rate(
        self, k: int, averages: _Averages, batch_size: int = 1, drafting_rows: int | None = None
    ) -> float | None:
        """Expected tokens per second per sequence with k drafts, or None before the costs were measured.

        drafting_rows: how many of the batch's sequences draft (None: all). The verify pass is as wide
        for every row (rows are padded to the longest draft), but only drafting rows gain tokens. A source
        whose drafts were never timed is taken to draft for free where the forwards are known: optimistic,
        so that it is tried, at the k the forwards' costs suggest.
        """
        verify = self._verify_seconds(batch_size * (k + 1))
        draft = self._draft_seconds(averages, batch_size) if k > 0 else 0.0
        if verify is None:
            return None
        draft = draft or 0.0
        verify = max(verify, self._verify_seconds(batch_size))  # a wider forward is never cheaper (noise aside)
        overhead = self._overhead(averages.name if k > 0 else None, batch_size)
        extra, reach = 0.0, 1.0
        acceptance = averages.acceptance()
        for i in range(k):
            reach *= acceptance[i]
            extra += reach
        share = 1.0 if drafting_rows is None else drafting_rows / batch_size
        return (1.0 + share * extra) / max(draft * k + verify + overhead, 1e-9)

    def _draft_seconds(self, averages: _Averages, batch_size: int) -> float | None:
        """Seconds of one draft position for `batch_size` rows: measured or interpolated; beyond the largest batch
        size measured, scaled from it as the target's measured forward over as many rows grows (never less than
        the line through the sizes measured)."""
        line = interpolate(averages.draft_cost, batch_size)
        largest = max(averages.draft_cost, default=None)
        if line is None or batch_size <= largest:
            return line
        here, there = self._verify_seconds(batch_size), self._verify_seconds(largest)
        if not here or not there:
            return line
        return max(line, averages.draft_cost[largest] * here / there)

    def _overhead(self, source: str | None, batch_size: int) -> float:
        """Seconds a whole step takes beyond its drafting and forward: measured for this source (None: plain) at
        this batch size, and never less than what plain steps measured: a drafting step does all that a plain one
        does. (Measured below it, the difference is noise; read as a gain, it would keep a free drafter that never
        agrees drafting wherever a two-token pass costs what a one-token one does.)"""
        plain = self.step_overhead.get((None, batch_size), 0.0)
        return plain if source is None else max(self.step_overhead.get((source, batch_size), plain), plain)

    def choose_k(self, batch_size: int = 1, source: str | None = None, drafting_rows: int | None = None) -> int:
        """k for the next step of `batch_size` sequences decoded together (0 = plain decoding).

        source: the drafter that will propose (a composite drafter knows before it drafts: lookup when
        the context recurs, else its draft model), whose acceptance and cost then decide; None = the
        source seen most in recent steps. drafting_rows: how many of the sequences it drafts for (None: all).
        """
        after_probe, self.probing = self.probing, False
        k, averages = self._best_k(batch_size, source, drafting_rows)
        if averages is not None:
            if k == 0 and self._could_pay(averages, batch_size, drafting_rows):
                if after_probe:  # the probe found drafting still does not pay: wait longer for the next
                    self.probe_backoff = min(2 * self.probe_backoff, self.settings.max_probe_backoff)
                self.plain_streak += 1
                if self._probe_due(batch_size, self.plain_streak):
                    self.plain_streak = 0
                    k = 1
                    self.probing = True
            else:
                self.plain_streak = 0
                self.probe_backoff = 1 if k > 0 else self.probe_backoff
        self.chosen[k] += 1
        self.drafted_last = k > 0 and not self.probing
        return k

    def planned_k(self, batch_size: int = 1, source: str | None = None, drafting_rows: int | None = None) -> int:
        """What choose_k would choose now (a probe's k = 1 included), changing nothing."""
        k, averages = self._best_k(batch_size, source, drafting_rows)
        if k == 0 and averages is not None and self._could_pay(averages, batch_size, drafting_rows):
            return int(self._probe_due(batch_size, self.plain_streak + 1))
        return k

    def _probe_due(self, batch_size: int, plain_streak: int) -> bool:
        # A probe drafts for every sequence in the batch, so a big batch probes less often.
        return plain_streak >= self.settings.probe_every * batch_size * self.probe_backoff

    def _best_k(
        self, batch_size: int, source: str | None, drafting_rows: int | None
    ) -> tuple[int, "_Averages | None"]:
        """choose_k's k before probes: by the expected rates of `source` (its averages returned with it), or without
        them (None): plain for a batch size whose plain step was never measured, first_k before any source was."""
        if source is None:
            source = self.recent_sources.most_common(1)[0][0] if self.recent_sources else None
        if batch_size > 1 and batch_size not in self.plain_batches:
            # A batch size's plain step is measured before anything is drafted at it: it costs no drafts, and
            # without it the cost of k extra tokens per sequence would be guessed from other sizes only.
            return 0, None
        if source is None:
            return self.settings.first_k, None
        averages = self._source(source)
        k_values = range(self.settings.k_max + 1)
        rates = [(self.expected_rate(k, averages, batch_size, drafting_rows), k) for k in k_values]
        if any(rate is None for rate, _ in rates):  # this source's costs are not measured yet: try it
            return self.settings.first_k, averages
        best_rate, k = max(rates)
        if k > 0 and not self._beats_plain(best_rate, rates[0][0]):
            k = 0
        return k, averages

    def _beats_plain(self, rate: float, plain_rate: float) -> bool:
        """Within noise of plain decoding a measured gain this small is no gain: it takes min_gain to start drafting,
        and half of it to go on (else an acceptance estimate that a few unlucky steps pulled down stops a drafter
        that pays on average)."""
        margin = self.settings.min_gain / 2 if self.drafted_last else self.settings.min_gain
        return rate >= (1 + margin) * plain_rate

    def still_pays(self, k: int, source: str, batch_size: int, drafting_rows: int) -> bool:
        """Whether k drafts from `source` for only `drafting_rows` of the batch still beat plain decoding by the margin
        choose_k asks: when rows chosen to draft drop out after choose_k (a draft cache too far behind to catch up),
        the verify pass is as wide for every row and only the rows left gain."""
        if k == 0 or drafting_rows == 0:
            return False
        averages = self._source(source)
        plain = self.expected_rate(0, averages, batch_size)
        drafting = self.expected_rate(k, averages, batch_size, drafting_rows)
        return plain is None or drafting is None or self._beats_plain(drafting, plain)

    def catch_up_rows(
        self, source: str, wanted: list[bool], behind: list[int], remaining: list[int], k_per_row: list[int],
        long_tail: int,
    ) -> list[bool]:
        """Which of the rows `wanted` to draft from a batched `source` (a draft model or head) are worth it, given how
        far behind the sequence each row's draft cache is and the tokens it has left.

        A row further behind than `long_tail` must first catch up: a new sequence's draft cache is empty, so its
        first draft feeds the whole prompt to the draft model (and after plain steps, what they committed). Alone
        a request wins that back in a few steps; in a batch whose verify pass is compute-bound drafting saves little
        per token, and 16 prompts fed at once cost seconds. Every catch-up stalls the whole batch and the saving is
        the batch's, so the rows that catch up in one step share one saving: they are taken nearest first while it
        covers them all (catch_up_pays). Until a catch-up has been timed, only the first such row catches up.
        """
        kept, measuring, spent = list(wanted), False, 0.0
        for row in sorted(range(len(wanted)), key=behind.__getitem__):
            if not wanted[row] or behind[row] <= long_tail:
                continue
            pays = self.catch_up_pays(behind[row], remaining[row], k_per_row[row], source, len(wanted), spent)
            if pays is None:
                pays, measuring = not measuring, True
            elif pays:
                spent += behind[row] * self.catch_up_per_token
            kept[row] = pays
        return kept

    def rows_left_pay(self, source: str, wanted: list[bool], kept: list[bool], k_per_row: list[int]) -> list[bool]:
        """`kept` of the rows `wanted` to draft from `source`, if they still pay for the batch's verify pass as wide as
        before (still_pays; rows other sources draft for count among them); else none."""
        if sum(kept) == sum(wanted):
            return kept
        others = sum(1 for k, wants in zip(k_per_row, wanted) if k > 0 and not wants)
        depth = max(k for k, wants in zip(k_per_row, wanted) if wants)
        return kept if self.still_pays(depth, source, len(wanted), sum(kept) + others) else [False] * len(wanted)

    def choose_row_ks(
        self, batch_size: int, source: str, row_acceptance: list[list[float]], other_tokens: int, k_cap: list[int]
    ) -> list[int] | None:
        """A k for each of the rows `source` drafts for, rows that agree more drafting longer (per-sequence k).

        row_acceptance[r]: row r's acceptance by position (see row_acceptance); other_tokens: what the
        batch's other rows put in the verify pass; k_cap[r]: the most row r may draft. The step costs
        draft_cost(batch_size) * max(k) + verify_cost(all tokens); each row is expected to gain
        A_1 + ... + A_k over its one token. Every row drafts at least one token (else its acceptance
        would never be measured again); for each longest draft K, further draft tokens are added in
        order of their expected gain (a row's gains fall with depth, so each row takes a prefix) and
        the best expected tokens per second over all these is taken; one k >= 1 for all rows is among
        them, so under this model per-row k never does worse. None of the costs measured: k for all from
        choose_k's rule (call choose_k first; this refines a k > 0 it chose).
        """
        averages = self._source(source)
        draft = self._draft_seconds(averages, batch_size)
        rows = len(row_acceptance)
        base_tokens = other_tokens + rows
        top = base_tokens + sum(k_cap)
        verify = _interpolated_range(self.verify_cost, base_tokens, top)  # verify[i]: cost of base_tokens + i tokens
        if draft is None or verify is None or not rows:
            return None
        # Every row drafts at least one token: a row given none would never show that it agrees again.
        least = [min(1, cap) for cap in k_cap]
        gains = []  # (expected gain, depth, row) of each draft position past the first
        base = batch_size  # every row of the batch commits at least one token, and its first draft is expected to add
        for r, (acceptance, cap) in enumerate(zip(row_acceptance, k_cap)):
            reach = 1.0
            for i in range(cap):
                reach *= acceptance[i]
                if i < least[r]:
                    base += reach
                else:
                    gains.append((reach, i, r))
        first = sum(least)
        best_rate, best = base / (draft * max(least, default=0) + verify[first]), list(least)
        for longest in range(1, max(k_cap, default=0) + 1):
            ks, extra, added = list(least), 0.0, first
            for gain, depth, r in sorted((g for g in gains if g[1] < longest), key=lambda g: -g[0]):
                ks[r] += 1
                extra += gain
                added += 1
                rate = (base + extra) / (draft * max(ks) + verify[added])
                if rate > best_rate:
                    best_rate, best = rate, list(ks)
        return best

    def row_acceptance(self, source: str, hits: list[int], reached: list[int]) -> list[float]:
        """A sequence's acceptance by position: its own hits over reached, shrunk towards the source's
        estimate with the weight of settings.row_prior_steps steps (a new sequence is its source)."""
        prior = self._source(source).acceptance()
        weight = self.settings.row_prior_steps
        return [(h + weight * a) / (n + weight) for h, n, a in zip(hits, reached, prior)]

    def _could_pay(self, averages: _Averages, batch_size: int, drafting_rows: int | None = None) -> bool:
        """Would drafting beat plain decoding here by min_gain if every draft were accepted?

        When not (a batch so large that verifying extra tokens costs more than they can bring; a
        draft model and a verify pass that cost, on an AVX2-only CPU, what the accepted tokens save),
        plain decoding is chosen on cost alone and a probe could only confirm it.
        """
        k_max = self.settings.k_max
        perfect = _Averages.start(k_max, 1.0, averages.prior_steps, averages.name)
        perfect.draft_cost = averages.draft_cost
        plain = self.expected_rate(0, perfect, batch_size)
        rates = [self.expected_rate(k, perfect, batch_size, drafting_rows) or 0.0 for k in range(1, k_max + 1)]
        return max(rates) > (1 + self.settings.min_gain) * (plain or 0.0)

    def observe(
        self,
        source: str,
        drafted: int,
        accepted: int,
        draft_seconds: float,
        verify_tokens: int,
        verify_seconds: float | None,
        batch_size: int = 1,
    ) -> None:
        """Record one sequence's step: how many drafts from `source` were accepted, what each phase cost.

        For a batch, call once per sequence with the whole step's draft_seconds (each row's share of the
        draft cost then weighs 1 / batch_size of a step) and verify_seconds None, and observe_forward once
        for the step's forward. verify_seconds (a batch of one): what its forward over verify_tokens took;
        None also where the forward carried other work (a prompt chunk), which tells nothing of what
        verifying costs.
        """
        if verify_seconds is not None:
            self.observe_forward(verify_tokens, verify_seconds)
        if drafted == 0:
            return
        averages = self._source(source)
        averages.record(drafted, accepted, self.settings.acceptance_memory, 1.0 / max(batch_size, 1))
        if self.probing and accepted:
            # A probe that passed is drafting worth trying again, and measuring as it really drafts: a probe may see
            # only the latest tokens (a draft model's window), which a chat answer's first guesses need more than.
            averages.forget_first()
        w = self.settings.smoothing
        per_position = draft_seconds / drafted
        self.seeded_drafts.discard(source)
        averages.draft_cost[batch_size] = moving_average(
            averages.draft_cost.get(batch_size), per_position, w / max(batch_size, 1)
        )
        self.recent_sources[source] += 1
        if sum(self.recent_sources.values()) > 32:  # keep "recent" recent
            for name in list(self.recent_sources):
                self.recent_sources[name] //= 2

    def observe_forward(self, tokens: int, seconds: float, rows: int = 1) -> None:
        """Record one verify forward over `tokens` tokens in all, of `rows` rows: it took `seconds`."""
        if tokens == rows:
            self.plain_batches.add(rows)
        if rows == 1 and tokens in self.seeded:
            self._check_seeds(seconds / self.seeded[tokens])
        average = self.verify_cost.get(tokens)
        if average is not None:
            seconds = min(seconds, self.settings.slow_forward_clip * average)
        self.verify_cost[tokens] = moving_average(average, seconds, self.settings.smoothing)

    def _check_seeds(self, ratio: float) -> None:
        """The first step's one-row forward over its seed: beyond seed_tolerance either way, the forwards still
        unmeasured are scaled by it, and the seeded draft position and catch-up forgotten. Checked once."""
        seeded, self.seeded = self.seeded, {}
        if 1 / self.settings.seed_tolerance <= ratio <= self.settings.seed_tolerance:
            return
        self.stale_seed = ratio
        for tokens, seconds in seeded.items():
            if self.verify_cost.get(tokens) == seconds:
                self.verify_cost[tokens] = seconds * ratio
        for source in self.seeded_drafts:
            del self.sources[source].draft_cost[1]
        self.seeded_drafts.clear()
        if self.seeded_catch_up:
            self.catch_up_per_token, self.seeded_catch_up = None, False

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

    def catch_up_pays(
        self, behind: int, remaining: int, k: int, source: str, batch_size: int, spent: float = 0.0
    ) -> bool | None:
        """Would drafting k for a sequence `behind` tokens back win its catch-up back over `remaining` tokens?

        The catch-up (a draft-model prefill of what the sequence committed without it) is paid once;
        what drafting saves is paid per token: the seconds per token of a plain step less those of a
        k-draft step at this batch size. Both are the whole batch's wall time, so rows caught up in the
        same step share one saving: `spent` is what the step's other catch-ups already cost. None while a
        catch-up has not been measured yet.
        """
        if self.catch_up_per_token is None:
            return None
        averages = self._source(source)
        plain, drafting = self.expected_rate(0, averages, batch_size), self.expected_rate(k, averages, batch_size)
        if not plain or not drafting:
            return True
        saving = remaining * (1 / plain - 1 / drafting)
        return saving > spent + behind * self.catch_up_per_token

    def plain_seconds_per_token(self) -> float | None:
        """What one plain decoding step costs here (for the counterfactual speedup).

        Measured when a step verified one token; else extrapolated from two or more sizes; else unknown.
        """
        if 1 not in self.verify_cost and len(self.verify_cost) < 2:
            return None
        return self._verify_seconds(1)


def interpolate(table: dict[int, float], x: int) -> float | None:
    """table[x] if measured, else a straight line through measured sizes (None if empty).

    Between measured sizes: the line through the two nearest. Beyond them: the line through the
    smallest and the largest, never falling. Two neighbouring sizes (15 and 16 sequences, say) differ
    by little more than noise, so a line through them alone would price a long verify pass like a
    short one.
    """
    values = _interpolated_range(table, x, x)
    return None if values is None else values[0]


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


# A prompt's chunk is the smallest that admits it within this much of the fastest rate (fewer, shorter stalls).
CHUNK_TOLERANCE = 0.15


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


def _interpolated_range(table: dict[int, float], first: int, last: int) -> list[float] | None:
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
