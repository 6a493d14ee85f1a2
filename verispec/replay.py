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
recorded costs say, and the controller observes what the scheduler would hand it. Left out: a draft model's
catch-up (its cache behind the sequence; the recorded draft costs are those of caught-up rows), per-row k, and
chunked prefill (a prompt's prefill stalls the batch, the same for every setting).
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from verispec.policy import AdaptiveController, ControllerSettings

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

    def forward_seconds(self, rows: int, width: int) -> float:
        """One target forward over `rows` rows of `width` tokens each (interpolated between recorded sizes)."""
        by_rows = {r: _line(widths, width) for r, widths in self.forward.items()}
        return _line(by_rows, rows)

    def draft_seconds(self, source: str, rows: int) -> float:
        return _line(self.draft[source], rows)

    @classmethod
    def from_json(cls, path: Path) -> "Costs":
        data = json.loads(Path(path).read_text())
        return cls(
            kind=data["kind"],
            forward={int(r): {int(w): s for w, s in widths.items()} for r, widths in data["forward"].items()},
            draft={source: {int(r): s for r, s in rows.items()} for source, rows in data["draft"].items()},
            step_overhead=data["step_overhead"],
            prefill_per_token=data["prefill_per_token"],
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

    @property
    def remaining(self) -> int:
        return self.trace.answer_tokens - self.position


def _source_at(row: _Row, order: tuple[str, ...]) -> str | None:
    """The first source of the composite order that proposes at the row's position (None: none does)."""
    for source in order:
        runs = row.trace.runs.get(source)
        if runs is not None and runs[row.position] is not None:
            return source
    return None


def seeded_controller(costs: Costs, order: tuple[str, ...], settings: ControllerSettings | None = None
                      ) -> AdaptiveController:
    """A controller seeded as the scheduler seeds it before the first request: one row's forwards by tokens and one
    row's draft position of the batched source."""
    controller = AdaptiveController(settings or ControllerSettings())
    verify = {n: costs.forward_seconds(1, n) for n in (1, 2, 4, 8, 16)}
    model = [source for source in order if source not in LOOKUP_SOURCES]
    controller.seed(verify, {model[0]: costs.draft_seconds(model[0], 1)} if model else {})
    return controller


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
    n = len(active)
    sources = [_source_at(row, order) if k != 0 else None for row in active]
    rows = Counter(source for source in sources if source is not None)
    chosen = {source: (controller.choose_k(n, source, count) if k == "auto" else int(k)) for source, count in rows.items()}
    ks = [0 if source is None else max(0, min(chosen[source], row.remaining - 1, K_MAX))
          for row, source in zip(active, sources)]
    drafting = {}  # source -> (seconds of its drafts this step, deepest draft)
    for source in rows:
        depth = max((kk for kk, s in zip(ks, sources) if s == source), default=0)
        drafters = sum(1 for kk, s in zip(ks, sources) if s == source and kk)
        if depth:
            drafting[source] = (costs.draft_seconds(source, drafters) * depth, depth)
    width = 1 + max(ks)
    forward = costs.forward_seconds(n, width)
    spent = sum(seconds for seconds, _ in drafting.values())
    step = spent + forward + costs.step_overhead
    controller.observe_forward(n * width, forward, rows=n)
    for row, source, drafted in zip(active, sources, ks):
        run = row.trace.runs[source][row.position] if drafted else 0
        accepted = min(drafted, run)
        if drafted:
            seconds, depth = drafting[source]
            controller.observe(source, drafted, accepted, seconds * drafted / depth, n * width, None, batch_size=n)
        committed = min(accepted + 1, row.remaining)
        row.position += committed
        outcome.tokens += committed
    if len(drafting) <= 1:  # a whole step, one source's or plain (as the scheduler observes it)
        controller.observe_step(next(iter(drafting), None), n, step, spent + forward)
    outcome.seconds += step
    outcome.steps += 1
    outcome.chosen[max(ks)] += 1


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
