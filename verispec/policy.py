"""How much to speculate: before each step, pick the k that maximises expected tokens per second.

The model: k drafts from source s are expected to yield E(k) = 1 + A_1 + ... + A_k tokens per sequence, with
A_i = alpha_1 * ... * alpha_i the chance that the first i drafts all pass (verispec.acceptance); a batch of b
sequences spends step_seconds(k, b) = draft_cost(b) * k + verify_cost(b * (k + 1)) + overhead on them, costs measured
on this machine during the request (verispec.cost_model). The controller picks argmax E(k) / step_seconds over
k = 0 .. k_max, where k = 0 is plain decoding; a single request is b = 1. As the batch grows the verify pass stops
being memory-bound and costs more per token, so the same acceptance buys less and the chosen k falls. Per-sequence k
(choose_row_ks) maximises the same ratio over a k for each row.

Around the model, a few rules, each a method below with one sentence of why and a test of its own
(tests/test_policy.py); every setting is in ControllerSettings:

- needs_plain_step: a batch size's first step is plain, to anchor what each extra token costs at that size.
- beats_plain: drafting must beat plain decoding by min_gain to start, and by half of it to go on.
- probe_due, pace_probes, could_pay: after a run of plain steps, one k = 1 probe notices a drafter that agrees again;
  vain probes come ever further apart, and none comes where the costs alone rule drafting out.
- relearn_after_probe: a probe that passed sets the first position back to its prior.
- recent_source: with no source named, the source of the last few steps decides.
- still_pays, rows_left_pay: rows that drop out after choose_k leave a verify pass that must still pay.
- catch_up_pays, catch_up_rows: a draft model far behind catches up only where its row's share of the batch's saving
  covers it.
- row_acceptance, choose_row_ks: a sequence's own acceptance moves it off its source's; every row drafts one token.

The cost model's rules (a slow forward clipped, stale seeds, a draft over more rows, a step's overhead, a wider
forward) are in verispec.cost_model, the acceptance estimate's (the all-passed rule) in verispec.acceptance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from verispec.acceptance import SourceAverages
from verispec.controller_settings import ControllerSettings
from verispec.cost_model import CostModel, interpolated_range

__all__ = ["AdaptiveController", "ControllerSettings"]


@dataclass
class AdaptiveController(CostModel):
    """The cost model (CostModel: settings, sources and the measured costs) plus the decision and its rules."""

    recent_sources: Counter = field(default_factory=Counter)
    plain_streak: int = 0
    chosen: Counter = field(default_factory=Counter)  # k -> steps (the histogram reported in stats)
    probing: bool = False  # whether the last choose_k returned a probe (k = 1 to re-measure acceptance)
    probe_backoff: int = 1  # probes come probe_every * batch size * this steps apart; doubled by each vain probe
    drafted_last: bool = False  # whether the last choice drafted (not as a probe): then it takes less to go on

    def expected_rate(
        self, k: int, averages: SourceAverages, batch_size: int = 1, drafting_rows: int | None = None
    ) -> float | None:
        """Expected tokens per second per sequence with k drafts, or None before the costs were measured.

        drafting_rows: how many of the batch's sequences draft (None: all). The verify pass is as wide
        for every row (rows are padded to the longest draft), but only drafting rows gain tokens.
        """
        seconds = self.step_seconds(k, averages, batch_size)
        if seconds is None:
            return None
        extra, reach = 0.0, 1.0
        acceptance = averages.acceptance()
        for i in range(k):
            reach *= acceptance[i]
            extra += reach
        share = 1.0 if drafting_rows is None else drafting_rows / batch_size
        return (1.0 + share * extra) / max(seconds, 1e-9)

    def choose_k(self, batch_size: int = 1, source: str | None = None, drafting_rows: int | None = None) -> int:
        """k for the next step of `batch_size` sequences decoded together (0 = plain decoding).

        source: the drafter that will propose (a composite drafter knows before it drafts: lookup when
        the context recurs, else its draft model), whose acceptance and cost then decide; None = the
        source seen most in recent steps. drafting_rows: how many of the sequences it drafts for (None: all).
        """
        after_probe, self.probing = self.probing, False
        k, averages = self._best_k(batch_size, source, drafting_rows)
        if averages is not None:
            if k == 0 and self.could_pay(averages, batch_size, drafting_rows):
                self.pace_probes(vain_probe=after_probe, drafts=False)
                self.plain_streak += 1
                if self.probe_due(batch_size, self.plain_streak):
                    self.plain_streak = 0
                    k = 1
                    self.probing = True
            else:
                self.plain_streak = 0
                self.pace_probes(vain_probe=False, drafts=k > 0)
        self.chosen[k] += 1
        self.drafted_last = k > 0 and not self.probing
        return k

    def planned_k(self, batch_size: int = 1, source: str | None = None, drafting_rows: int | None = None) -> int:
        """What choose_k would choose now (a probe's k = 1 included), changing nothing."""
        k, averages = self._best_k(batch_size, source, drafting_rows)
        if k == 0 and averages is not None and self.could_pay(averages, batch_size, drafting_rows):
            return int(self.probe_due(batch_size, self.plain_streak + 1))
        return k

    def _best_k(
        self, batch_size: int, source: str | None, drafting_rows: int | None
    ) -> tuple[int, SourceAverages | None]:
        """choose_k's k before probes: the argmax of expected rates of `source` (its averages returned with it), or
        without them (None): plain where needs_plain_step; first_k before any source or its costs were measured
        (speculation is tried before it is judged)."""
        if source is None:
            source = self.recent_source()
        if self.needs_plain_step(batch_size):
            return 0, None
        if source is None:
            return self.settings.first_k, None
        averages = self._source(source)
        k_values = range(self.settings.k_max + 1)
        rates = [(self.expected_rate(k, averages, batch_size, drafting_rows), k) for k in k_values]
        if any(rate is None for rate, _ in rates):  # this source's costs are not measured yet: try it
            return self.settings.first_k, averages
        best_rate, k = max(rates)
        if k > 0 and not self.beats_plain(best_rate, rates[0][0]):
            k = 0
        return k, averages

    def needs_plain_step(self, batch_size: int) -> bool:
        """A batch size > 1 drafts only once its plain step was measured, because that step costs no drafts and
        anchors what each extra token costs there: else it would be guessed from other sizes only, and a one-row
        forward seeded before any step priced as a plain step of as many rows had a server draft while its first wave
        went in."""
        return batch_size > 1 and batch_size not in self.plain_batches

    def beats_plain(self, rate: float, plain_rate: float) -> bool:
        """Drafting must beat plain decoding by min_gain to start and by half of it to go on, because a gain this
        small is within noise, and an acceptance estimate that a few unlucky steps pulled down would else stop a
        drafter that pays on average."""
        margin = self.settings.min_gain / 2 if self.drafted_last else self.settings.min_gain
        return rate >= (1 + margin) * plain_rate

    def probe_due(self, batch_size: int, plain_streak: int) -> bool:
        """After probe_every * batch size * probe_backoff plain steps in a row, draft one token (k = 1) for every row,
        because plain steps alone never show when the drafter starts to agree again; a big batch probes less often,
        since a probe drafts for every sequence in it. (A draft model's probe row far behind sees only the latest
        tokens, the scheduler's PROBE_WINDOW, so a probe costs the same however long the text.)"""
        return plain_streak >= self.settings.probe_every * batch_size * self.probe_backoff

    def pace_probes(self, vain_probe: bool, drafts: bool) -> None:
        """Probe backoff: a probe that found plain decoding still best doubles the wait for the next (up to
        max_probe_backoff times), and a step that drafts on its merits restores the first pace, because a probe makes
        a draft model catch up on every token since the last one, a cost that frequent probes pay over and over
        where there is nothing to find."""
        if drafts:
            self.probe_backoff = 1
        elif vain_probe:
            self.probe_backoff = min(2 * self.probe_backoff, self.settings.max_probe_backoff)

    def could_pay(self, averages: SourceAverages, batch_size: int, drafting_rows: int | None = None) -> bool:
        """Whether drafting would beat plain decoding here by min_gain at best: every draft accepted, a draft position
        at the least it was timed before any step or measured since (never timed: free) and a step's overhead at a
        plain step's. Where not (a batch so large that verifying extra tokens costs more than they can bring; a draft
        model and a verify pass that cost what the accepted tokens save), plain decoding is chosen on cost alone and
        no probe comes, because a probe could only confirm it. At best, because this verdict ends probing and only
        drafting steps measure a source's draft position and overhead: one slow first drafting step (a busy machine),
        averaged in and never measured again, would else end it for good."""
        k_max = self.settings.k_max
        perfect = SourceAverages.start(k_max, 1.0, averages.prior_steps)  # no name: a plain step's overhead
        perfect.draft_cost = averages.least_draft_cost
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
        self.relearn_after_probe(averages, accepted)
        self.observe_draft(source, draft_seconds, drafted, batch_size)
        self._remember_source(source)

    def relearn_after_probe(self, averages: SourceAverages, accepted: int) -> None:
        """A probe that passed sets the source's first position back to its prior, because it shows drafting worth
        trying again, measured as it really drafts: a probe may see only the latest tokens (a draft model's window),
        which a chat answer's first guesses need more than."""
        if self.probing and accepted:
            averages.forget_first()

    def recent_source(self) -> str | None:
        """The source that decides when none is named: the one seen most in recent steps, their counts halving past
        recent_steps (_remember_source), because the drafter of the last few steps, not of the whole run, is the one
        likely to draft next."""
        return self.recent_sources.most_common(1)[0][0] if self.recent_sources else None

    def _remember_source(self, source: str) -> None:
        self.recent_sources[source] += 1
        if sum(self.recent_sources.values()) > self.settings.recent_steps:
            for name in list(self.recent_sources):
                self.recent_sources[name] //= 2

    def still_pays(self, k: int, source: str, batch_size: int, drafting_rows: int) -> bool:
        """Whether k drafts from `source` for only `drafting_rows` of the batch still beat plain decoding by the margin
        choose_k asks, because when rows chosen to draft drop out after choose_k (a draft cache too far behind to
        catch up), the verify pass is as wide for every row and only the rows left gain."""
        if k == 0 or drafting_rows == 0:
            return False
        averages = self._source(source)
        plain = self.expected_rate(0, averages, batch_size)
        drafting = self.expected_rate(k, averages, batch_size, drafting_rows)
        return plain is None or drafting is None or self.beats_plain(drafting, plain)

    def rows_left_pay(self, source: str, wanted: list[bool], kept: list[bool], k_per_row: list[int]) -> list[bool]:
        """`kept` of the rows `wanted` to draft from `source`, if they still pay for the batch's verify pass as wide as
        before (still_pays; rows other sources draft for count among them); else none."""
        if sum(kept) == sum(wanted):
            return kept
        others = sum(1 for k, wants in zip(k_per_row, wanted) if k > 0 and not wants)
        depth = max(k for k, wants in zip(k_per_row, wanted) if wants)
        return kept if self.still_pays(depth, source, len(wanted), sum(kept) + others) else [False] * len(wanted)

    def catch_up_pays(
        self, behind: int, remaining: int, k: int, source: str, batch_size: int, spent: float = 0.0
    ) -> bool | None:
        """Would drafting k for a sequence `behind` tokens back win its catch-up back over `remaining` tokens?

        The catch-up (a draft-model prefill of what the sequence committed without it) is paid once, and it stalls
        the whole batch. What drafting saves is paid per token: the seconds per token of a plain step less those of
        a k-draft step at this batch size, of which this sequence's tokens take one share in batch_size, because a
        step's wall time is every row's. Counting the whole batch's saving for each row would pay for every new
        prompt's catch-up as many times over as the batch has rows (the Zen 5 26/2 costs replayed chat with the
        draft model at 4 clients at 0.97x plain that way). Rows caught up in the same step stall it together, so a
        row's share must also cover `spent`, what the step's nearer catch-ups already cost. None while a catch-up
        has not been measured yet.
        """
        if self.catch_up_per_token is None:
            return None
        averages = self._source(source)
        plain, drafting = self.expected_rate(0, averages, batch_size), self.expected_rate(k, averages, batch_size)
        if not plain or not drafting:
            return True
        saving = remaining * (1 / plain - 1 / drafting) / batch_size
        return saving > spent + behind * self.catch_up_per_token

    def catch_up_rows(
        self, source: str, wanted: list[bool], behind: list[int], remaining: list[int], k_per_row: list[int],
        long_tail: int,
    ) -> list[bool]:
        """Which of the rows `wanted` to draft from a batched `source` (a draft model or head) are worth it, given how
        far behind the sequence each row's draft cache is and the tokens it has left.

        A row further behind than `long_tail` must first catch up: a new sequence's draft cache is empty, so its
        first draft feeds the whole prompt to the draft model (and after plain steps, what they committed). Alone
        a request wins that back in a few steps; in a batch whose verify pass is compute-bound drafting saves little
        per token, and 16 prompts fed at once cost seconds. Every catch-up stalls the whole batch, and a row's saving
        is its share of the batch's (catch_up_pays): the rows that catch up in one step are taken nearest first while
        each one's share covers its own catch-up and the nearer rows'. Until a catch-up has been timed, only the first
        such row catches up.
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

    def row_acceptance(self, source: str, hits: list[int], reached: list[int]) -> list[float]:
        """A sequence's acceptance by position: its own hits over reached, shrunk towards the source's estimate with
        the weight of settings.row_prior_steps steps, because a new sequence is its source until its own steps say
        otherwise, and a few of them are luck."""
        prior = self._source(source).acceptance()
        weight = self.settings.row_prior_steps
        return [(h + weight * a) / (n + weight) for h, n, a in zip(hits, reached, prior)]

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
        verify = interpolated_range(self.verify_cost, base_tokens, top)  # verify[i]: cost of base_tokens + i tokens
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
