"""Replaying the controller over a machine kind's recorded costs and a workload's recorded acceptance: tokens per
second against plain decoding on the same costs, with no model and no timing (issue 46).

A kind's costs (`Costs`, benchmarks/results/<kind>/controller-costs.json) are what a step's parts take there: a
target forward by rows and width, a draft position by source and rows, what a step costs besides, a prompt's
prefill. A workload's acceptance (`Trace`, one per request) is, at each position of the greedy answer, how many
of a source's drafts from there the target accepts (None where the source proposes nothing: a lookup that finds
no match). Greedy decoding is the same whatever k is chosen, so min(k, run) drafts pass at a step that starts
there: the trace holds every choice's outcome.

`replay` serves the traces to a number of clients, each taking the next request when its last one ends, as the
scheduler batches them: each step every row proposes from the first source of the composite order that has a
proposal there, the real `AdaptiveController` picks k per source (or a fixed k), the step costs what the
recorded costs say, and the controller observes what the scheduler would hand it. A batched draft source (the
draft model, the head) keeps a cache per row: a row it did not draft for (its prompt, plain steps, lookup steps)
falls behind, and drafting again first catches up on those tokens. As the scheduler does, a row further behind
than LONG_TAIL drafts only where the controller's catch_up_pays says the saving covers it (the first such row
while no catch-up was measured), and a probe's row far behind catches up on its last PROBE_WINDOW tokens only.
Left out: per-row k, the per-step cap on catch-up tokens, and chunked prefill (a prompt's prefill stalls the
batch, the same for every setting).
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from verispec.drafters.base import LONG_TAIL
from verispec.models.forward_cost import STEP_ROWS
from verispec.policy import AdaptiveController, ControllerSettings
from verispec.core.drafting import PROBE_WINDOW

K_MAX = ControllerSettings().k_max  # the deepest draft a trace records (a run of K_MAX: at least that many)
LOOKUP_SOURCES = ("suffix-index", "prompt-lookup")  # sources that propose only where the context recurs


def _line(points: dict[int, float], x: float) -> float:
    """points' value at x: the line through the two measured sizes around it; beyond the largest, the line through
    the last two, never below the largest's value; below the smallest, never above its value nor below zero."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    low, high = xs[i - 1], xs[i]
    value = points[low] + (points[high] - points[low]) * (x - low) / (high - low)
    if x > xs[-1]:
        return max(value, points[xs[-1]])
    if x < xs[0]:
        return max(min(value, points[xs[0]]), 0.0)
    return value


@dataclass(frozen=True)
class Costs:
    """What one machine kind's steps cost, in seconds."""

    kind: str
    forward: dict[int, dict[int, float]]  # rows -> width (tokens per row) -> one target forward
    draft: dict[str, dict[int, float]]  # source -> rows -> one draft position for that many rows
    step_overhead: float  # a step's seconds besides its drafts and its forward (sampling, acceptance, Python)
    prefill_per_token: float  # a prompt's prefill, per token
    catch_up: dict[str, float] = field(default_factory=dict)  # batched source -> seconds per token it catches up on

    def forward_seconds(self, rows: int, width: int) -> float:
        """One target forward over `rows` rows of `width` tokens each (interpolated between recorded sizes)."""
        by_rows = {r: _line(widths, width) for r, widths in self.forward.items()}
        return _line(by_rows, rows)

    def draft_seconds(self, source: str, rows: int) -> float:
        return _line(self.draft[source], rows)

    def catch_up_seconds(self, source: str) -> float:
        """Seconds per token a batched source catches up on; where not recorded, the target's prefill per token
        scaled by that source's one-row draft position over the target's one-row forward (a smaller model's)."""
        if source in self.catch_up:
            return self.catch_up[source]
        return self.prefill_per_token * self.draft_seconds(source, 1) / self.forward_seconds(1, 1)

    @classmethod
    def from_json(cls, path: Path) -> "Costs":
        data = json.loads(Path(path).read_text())
        return cls(
            kind=data["kind"],
            forward={int(r): {int(w): s for w, s in widths.items()} for r, widths in data["forward"].items()},
            draft={source: {int(r): s for r, s in rows.items()} for source, rows in data["draft"].items()},
            step_overhead=data["step_overhead"],
            prefill_per_token=data["prefill_per_token"],
            catch_up=data.get("catch_up_per_token", {}),
        )


@dataclass(frozen=True)
class Trace:
    """One request: its prompt's tokens and, per source, the run of accepted drafts at each answer position."""

    prompt_tokens: int
    runs: dict[str, list[int | None]]  # source -> (answer tokens,) accepted run from each position, None: no proposal

    @property
    def answer_tokens(self) -> int:
        return len(next(iter(self.runs.values())))


@dataclass
class Outcome:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    chosen: Counter = field(default_factory=Counter)  # k -> steps drafting that deep (0: plain)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class _Row:
    trace: Trace
    position: int = 0  # answer tokens committed
    seen: int = 0  # tokens of the sequence (prompt, then answer) the batched draft source has in its cache

    @property
    def remaining(self) -> int:
        return self.trace.answer_tokens - self.position

    @property
    def behind(self) -> int:
        """Tokens the batched draft source must catch up on before it drafts (the newest goes with the draft)."""
        return max(self.trace.prompt_tokens + self.position - 1 - self.seen, 0)


def _source_at(row: _Row, order: tuple[str, ...]) -> str | None:
    """The first source of the composite order that proposes at the row's position (None: none does)."""
    for source in order:
        runs = row.trace.runs.get(source)
        if runs is not None and runs[row.position] is not None:
            return source
    return None


def seeded_controller(costs: Costs, order: tuple[str, ...], settings: ControllerSettings | None = None
                      ) -> AdaptiveController:
    """A controller seeded as the scheduler seeds it before the first request (forward_cost.step_costs): one row's
    forwards by tokens, one row's draft position of the batched source and its catch-up per token."""
    controller = AdaptiveController(settings or ControllerSettings())
    verify = {n: costs.forward_seconds(1, n) for n in STEP_ROWS}
    model = _batched(order)
    if model is None:
        controller.seed(verify)
    else:
        controller.seed(verify, {model: costs.draft_seconds(model, 1)}, costs.catch_up_seconds(model))
    return controller


def _batched(order: tuple[str, ...]) -> str | None:
    """The order's batched draft source (a model or head drafting for all rows in one forward), if any."""
    return next((source for source in order if source not in LOOKUP_SOURCES), None)


def replay(costs: Costs, traces: list[Trace], clients: int, order: tuple[str, ...], k: int | str = "auto",
           requests: int | None = None, settings: ControllerSettings | None = None) -> Outcome:
    """Serve `requests` traces (cycling; default: each once) to `clients` clients with drafting sources in
    composite `order` and k fixed or "auto" (the controller's); k = 0 is plain decoding."""
    controller = seeded_controller(costs, order, settings)
    queue = [traces[i % len(traces)] for i in range(requests or len(traces))]
    queue.reverse()
    active: list[_Row] = []
    outcome = Outcome()
    while queue or active:
        while queue and len(active) < clients:  # a new request's prompt goes in: a stall for the batch
            trace = queue.pop()
            outcome.seconds += costs.prefill_per_token * trace.prompt_tokens
            active.append(_Row(trace))
        _step(costs, controller, active, order, k, outcome)
        active = [row for row in active if row.remaining > 0]
    return outcome


def _step(costs: Costs, controller: AdaptiveController, active: list[_Row], order: tuple[str, ...],
          k: int | str, outcome: Outcome) -> None:
    n, model = len(active), _batched(order)
    sources = [_source_at(row, order) if k != 0 else None for row in active]
    rows = Counter(source for source in sources if source is not None)
    chosen, probing = {}, False
    for source, count in rows.items():
        chosen[source] = controller.choose_k(n, source, count) if k == "auto" else int(k)
        probing = probing or (k == "auto" and controller.probing and source == model)
    ks = [0 if source is None else max(0, min(chosen[source], row.remaining - 1, K_MAX))
          for row, source in zip(active, sources)]
    catching_up = _catch_ups(costs, controller, active, sources, ks, model, probing, k == "auto")
    drafting = {}  # source -> (seconds of its drafts this step, deepest draft)
    for source in rows:
        depth = max((kk for kk, s in zip(ks, sources) if s == source), default=0)
        drafters = sum(1 for kk, s in zip(ks, sources) if s == source and kk)
        if depth:
            drafting[source] = (costs.draft_seconds(source, drafters) * depth, depth)
    width = 1 + max(ks)
    forward = costs.forward_seconds(n, width)
    spent = sum(seconds for seconds, _ in drafting.values())
    step = catching_up + spent + forward + costs.step_overhead
    controller.observe_forward(n * width, forward, rows=n)
    for row, source, drafted in zip(active, sources, ks):
        run = row.trace.runs[source][row.position] if drafted else 0
        accepted = min(drafted, run)
        if drafted:
            seconds, depth = drafting[source]
            controller.observe(source, drafted, accepted, seconds * drafted / depth, n * width, None, batch_size=n)
        committed = min(accepted + 1, row.remaining)
        row.position += committed
        if drafted and source == model:  # its cache holds the accepted drafts; the bonus token comes next
            row.seen = row.trace.prompt_tokens + row.position - 1
        outcome.tokens += committed
    if len(drafting) <= 1:  # a whole step, one source's or plain (as the scheduler observes it)
        controller.observe_step(next(iter(drafting), None), n, step - catching_up, spent + forward)
    outcome.seconds += step
    outcome.steps += 1
    outcome.chosen[max(ks)] += 1


def _catch_ups(costs: Costs, controller: AdaptiveController, active: list[_Row], sources: list[str | None],
               ks: list[int], model: str | None, probing: bool, auto: bool) -> float:
    """Seconds the batched source spends catching rows up before it drafts; rows it will not catch up get k = 0 (as
    the scheduler's _draft decides). Changes ks and the rows' seen in place."""
    wants = [kk > 0 and source == model for kk, source in zip(ks, sources)]
    if model is None or not any(wants):
        return 0.0
    if probing:  # a probe drafts the rows caught up, else its first row on its last PROBE_WINDOW tokens
        current = [w and row.behind <= LONG_TAIL for w, row in zip(wants, active)]
        first = wants.index(True)
        keep = current if any(current) else [b == first for b in range(len(active))]
        if not any(current) and active[first].behind > PROBE_WINDOW:
            active[first].seen = active[first].trace.prompt_tokens + active[first].position - 1 - PROBE_WINDOW
    elif auto:  # the scheduler's decision (its _draft)
        behind, remaining = [row.behind for row in active], [row.remaining for row in active]
        keep = controller.catch_up_rows(model, wants, behind, remaining, ks, LONG_TAIL)
        keep = controller.rows_left_pay(model, wants, keep, ks)
    else:  # a fixed k drafts every row, however far behind
        keep = wants
    tokens = 0
    for b, row in enumerate(active):
        if wants[b] and not keep[b]:
            ks[b] = 0
        elif keep[b] and row.behind > LONG_TAIL:  # a short tail goes with the first draft forward
            tokens += row.behind
    seconds = tokens * costs.catch_up_seconds(model)
    if tokens:
        controller.observe_catch_up(seconds, tokens)
    return seconds


def speedup(costs: Costs, traces: list[Trace], clients: int, order: tuple[str, ...], k: int | str = "auto",
            requests: int | None = None) -> float:
    """replay's tokens per second with k over plain decoding's (k = 0), on the same costs and requests."""
    plain = replay(costs, traces, clients, order, 0, requests)
    return replay(costs, traces, clients, order, k, requests).tokens_per_second / plain.tokens_per_second


def runs_from_steps(steps: list[tuple[int, int]], answer_tokens: int, lookup: bool) -> list[int | None]:
    """A source's accepted run at each answer position, from a greedy run that drafted k = K_MAX with it: steps
    [(drafted, accepted)] in order. A step at position p with a drafts accepted commits p .. p + a, and the draft
    from each p + j of those continues the same guesses (its context is the same), so its run is a - j: exact where
    a draft was rejected, a lower bound where all passed. A step that drafted nothing: None for a lookup (it found
    no match), else 0."""
    runs: list[int | None] = [0] * answer_tokens
    position = 0
    for drafted, accepted in steps:
        if position >= answer_tokens:
            break
        if drafted == 0:
            runs[position] = None if lookup else 0
        for j in range(min(accepted + 1, answer_tokens - position)):
            if drafted:
                runs[position + j] = accepted - j
        position += accepted + 1
    return runs


def load_traces(path: Path) -> list[Trace]:
    """A workload's recorded traces (benchmarks/results/acceptance-traces/<workload>.json)."""
    data = json.loads(Path(path).read_text())
    return [Trace(item["prompt_tokens"], item["runs"]) for item in data["requests"]]
