"""Choosing a model's weight format by measuring it here, within a time budget: one mechanism for targets and drafts.

A CPU decides which format is fastest (AMX, VNNI, AVX2 and memory bandwidth all move it), so `auto` measures. It
must also end: on CPUs without AMX, oneDNN's signed int8 is a reference implementation whose forward can cost
orders of magnitude more than the fastest candidate's, so timing every candidate in full could take far longer
than the load itself. So:

1. **Screen** every candidate cheaply: one call of a few linears of the model's MLP shape, at one row (cheap on
   a fast path; a reference path's call shows its slowness at a small part of its whole forward's cost).
2. **Drop** a candidate whose screen costs SCREEN_DROP times the best one's: it is recorded as too slow, untimed.
3. **Time the survivors whole** (forwards of the model, or of a probe of it), in interleaved rounds, cheapest
   screen first. A candidate whose forward costs WHOLE_DROP times the best one's at the same width (HOPELESS
   times in a warm-up round, which allocates and picks kernels) stops being timed, as too slow; one whose next
   forward, predicted from what it cost so far (from its screen before it ran), would end past the budget is
   not waited for. When the budget is spent, what was measured stands.
4. **Pick** (a pure function of what was measured): the least whole-forward seconds among the candidates timed at
   every width; the whole-forward estimate stays the judge among the survivors.

A forward in flight is not interrupted: the screen and the predictions are the guard, so a candidate whose screen
misjudges its whole forward past SCREEN_DROP costs at most its prefill and one forward before it stops. A test
replays every machine kind's recorded costs through steps 1-4 with a clock that only counts
(benchmarks/results/<kind>/format-costs*.json): each choice ends within its budget and picks what that kind's
benchmarks show fastest.
"""

from __future__ import annotations

import collections
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from verispec.models.forward_cost import Forwarding, cost_token_ids, prompted_cache
from verispec.models.linear import Linear

# A screen this many times the best one's drops a candidate: above how far one linear misjudges a whole forward
# in the recorded costs (up to ~5x, benchmarks/results/<kind>/format-costs*.json).
SCREEN_DROP = 8.0
WHOLE_DROP = 3.0  # a timed forward this many times the best one's at its width stops a candidate
HOPELESS = 10.0  # ... in a warm-up round, whose first calls allocate and pick kernels
# Seconds a first load may spend choosing: the packaged pair's target and draft together stay within about 60 s.
BUDGETS = {"target": 40.0, "draft": 20.0}
PREFILL_FORWARDS = 2  # what the short prompt's prefill costs, in forwards of a step's width (a guess, before it ran)
SCREEN_COPIES = 2  # linears called in turn by a screen: weights from memory, as a forward's come
SCREEN_REPEATS = 3  # timed screen calls (after one warm-up), where each is short
SHORT_SCREEN = 0.05  # seconds: a screen call longer than this is timed once
HOPELESS_SCREEN = 1.0  # seconds: a warm-up call longer than this stands for the screen (no kernel pick is so slow)
# "candidate=seconds": each screen call and whole forward of that candidate sleeps so long first (a test hook: a
# candidate as slow as a reference path)
SLOW_FORMAT_ENV = "VERISPEC_SLOW_FORMAT"
MARGIN = 1.5  # the format in force may cost this many times another candidate's remembered cost before re-choosing
WINDOW = 16  # one-row forwards timed while serving or drafting whose median is checked


@dataclass
class Subject:
    """What choosing one model's format times.

    screen(candidate): the screen call (a function timed after one warm-up call), or None where the candidate
    cannot run here. build(candidate): the models its whole forward is timed on (name -> model; the target's probe
    and the probe's head alone), or None where it cannot run here; called only for survivors of the screen.
    estimate(costs): those models' median seconds by width -> the whole forward's seconds by width.
    """

    screen: Callable[[str], Callable[[], object] | None]
    build: Callable[[str], Mapping[str, Forwarding] | None]
    estimate: Callable[[Mapping[str, Mapping[int, float]]], dict[int, float]] = lambda costs: dict(
        next(iter(costs.values())))
    rows: tuple[int, ...] = (1,)  # widths a whole forward is timed at: new tokens after the prompt
    context: int = 32  # tokens of prompt in each model's cache before the timed forwards
    rounds: int = 5  # timed rounds after the warm-up ones
    warmup: int = 1


# -- the choice and the drops: pure functions of measured seconds -------------------------------------------


def pick(seconds: Mapping[str, float], screen: Mapping[str, float]) -> str | None:
    """The candidate to load: the least whole-forward seconds among those timed at every width (`seconds`); where
    none was, the least screen; None where nothing ran."""
    if seconds:
        return min(seconds, key=seconds.get)
    return min(screen, key=screen.get) if screen else None


def screen_survivors(screen: Mapping[str, float], drop: float = SCREEN_DROP) -> list[str]:
    """The screened candidates worth timing whole, cheapest first: those within `drop` times the best screen."""
    if not screen:
        return []
    best = min(screen.values())
    return sorted((c for c, s in screen.items() if s <= drop * best), key=screen.get)


def too_slow(seconds: float, best: float | None, warm: bool) -> bool:
    """Whether a forward of `seconds` stops its candidate, the best other forward at its width having cost `best`
    (WHOLE_DROP times it once warm, HOPELESS times in a warm-up round)."""
    return best is not None and seconds > (WHOLE_DROP if warm else HOPELESS) * best


def predicted_seconds(candidate: str, width: int, timed: Mapping[str, Mapping[int, list[float]]],
                      screen: Mapping[str, float]) -> float | None:
    """What `candidate`'s next forward at `width` should cost: its own last one there; before it ran there, its last
    at a narrower width; before it ran at all, another candidate's at `width` scaled by their screens. None: no
    basis (the first forward of all)."""
    own = timed.get(candidate, {})
    if own.get(width):
        return own[width][-1]
    narrower = [n for n in own if n < width and own[n]]
    if narrower:
        return own[max(narrower)][-1]
    for other, by_width in timed.items():
        if by_width.get(width) and screen.get(other):
            return by_width[width][-1] * screen[candidate] / screen[other]
    return None


# -- measuring within a budget ----------------------------------------------------------------------------------


@dataclass
class Choosing:
    """One choice under way: what was measured so far, against a clock and a deadline."""

    budget: float
    clock: Callable[[], float] = time.perf_counter
    on_progress: Callable[[str], None] | None = None
    started: float = 0.0
    screen: dict[str, float] = field(default_factory=dict)
    too_slow: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not timed to the end
    # candidate -> width -> seconds of each of its whole forwards (its models' summed), warm-up rounds included
    timed: dict[str, dict[int, list[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def left(self) -> float:
        return self.budget - (self.clock() - self.started)

    def say(self, text: str) -> None:
        if self.on_progress is not None:
            self.on_progress(text)


def measure(subject: Subject, candidates: Sequence[str], budget: float,
            clock: Callable[[], float] = time.perf_counter,
            on_progress: Callable[[str], None] | None = None) -> dict:
    """Screen, drop, time the survivors whole within `budget` seconds, and pick (see the module docstring).

    Returns the record remembered for the choice: {"format": the pick, "seconds": candidate -> whole-forward
    seconds summed over subject.rows (those timed at every width), "one_row": candidate -> one-row seconds (where
    timed), "whole": candidate -> {str(width): seconds}, "screen": candidate -> screen seconds, "too_slow":
    candidate -> why, "choosing_seconds": spent}.
    """
    state = Choosing(budget, clock, on_progress)
    slow = _slow_format_hook()
    for candidate in candidates:
        state.say(f"screening {candidate}")
        call = subject.screen(candidate)
        if call is not None and candidate in slow:
            call = _slowed_call(call, slow[candidate])
        if call is not None:
            seconds = _time_screen(call, clock)
            if seconds is not None:
                state.screen[candidate] = seconds
    survivors = screen_survivors(state.screen)
    for candidate in state.screen:
        if candidate not in survivors:
            state.too_slow[candidate] = f"screen {state.screen[candidate] / min(state.screen.values()):.0f}x the best"
    costs = _time_whole(subject, survivors, state, slow)
    estimates = {c: subject.estimate(by_model) for c, by_model in costs.items()}
    seconds = {c: sum(by_width.values()) for c, by_width in estimates.items()}
    return {
        "format": pick(seconds, state.screen),
        "seconds": seconds,
        "one_row": {c: by_width[min(subject.rows)] for c, by_width in estimates.items()},
        "whole": {c: {str(n): s for n, s in by_width.items()} for c, by_width in estimates.items()},
        "screen": state.screen,
        "too_slow": state.too_slow,
        "choosing_seconds": round(clock() - state.started, 3),
    }


def _time_screen(call: Callable[[], object], clock: Callable[[], float]) -> float | None:
    """Least seconds of the screen call after one warm-up call (one timed call where it is long; the warm-up call's
    own seconds where it took HOPELESS_SCREEN); None where it fails to run here."""
    try:
        started = clock()
        call()  # warm-up: first calls allocate and pick kernels
        warmup = clock() - started
        if warmup > HOPELESS_SCREEN:  # no kernel choice takes this long: it is that slow
            return warmup
        times = []
        for _ in range(SCREEN_REPEATS):
            started = clock()
            call()
            times.append(clock() - started)
            if times[-1] > SHORT_SCREEN:
                break
    except (RuntimeError, NotImplementedError, ValueError):  # this CPU or build lacks the kernel
        return None
    return min(times)


def _time_whole(subject: Subject, survivors: list[str], state: Choosing,
                slow: Mapping[str, float]) -> dict[str, dict[str, dict[int, float]]]:
    """candidate -> model name -> width -> median seconds, for the survivors timed at every width before the budget
    ran out or they proved too slow. Rounds interleave the candidates, so machine noise hits them alike. `slow`:
    $VERISPEC_SLOW_FORMAT's candidates, whose forwards sleep first."""
    models: dict[str, dict[str, Forwarding]] = {}
    building = 0.0  # seconds the last candidate took to build: what the next one should take
    for candidate in survivors:
        if state.left() <= building:
            state.too_slow[candidate] = "the budget ran out before it was built"
            continue
        state.say(f"preparing {candidate}")
        started = state.clock()
        try:
            built = subject.build(candidate)
        except (RuntimeError, NotImplementedError, ValueError):
            built = None
        building = state.clock() - started
        if built:
            models[candidate] = {name: _Slowed(m, slow[candidate]) if candidate in slow else m
                                 for name, m in built.items()}
    caches: dict[str, dict[str, object]] = {}  # made at a candidate's first forward: a prefill costs too
    samples: dict[str, dict[str, dict[int, list[float]]]] = {c: {name: {n: [] for n in subject.rows}
                                                                  for name in group} for c, group in models.items()}
    alive = list(models)
    total = subject.warmup + subject.rounds
    for round_index in range(total):
        warm = round_index >= subject.warmup
        for n in subject.rows:
            for candidate in list(alive):
                predicted = predicted_seconds(candidate, n, state.timed, state.screen)
                if predicted is not None and predicted > state.left():
                    alive.remove(candidate)
                    if not _complete(samples[candidate]):
                        state.too_slow[candidate] = f"a forward ({predicted:.2f} s) would end past the budget"
                    continue
                state.say(f"timing {candidate} at {n} rows, round {round_index + 1} of {total}")
                if candidate not in caches:
                    prefill = None if predicted is None else PREFILL_FORWARDS * predicted
                    if prefill is not None and prefill + predicted > state.left():
                        alive.remove(candidate)
                        state.too_slow[candidate] = f"its prefill ({prefill:.2f} s) would end past the budget"
                        continue
                    caches[candidate] = {name: prompted_cache(m, subject.context, max(subject.rows))
                                         for name, m in models[candidate].items()}
                seconds = 0.0
                for name, model in models[candidate].items():
                    started = state.clock()
                    model.forward(cost_token_ids(n, model.vocab_size, 7), caches[candidate][name])  # never committed
                    spent = state.clock() - started
                    samples[candidate][name][n].append(spent)
                    seconds += spent
                state.timed.setdefault(candidate, {}).setdefault(n, []).append(seconds)
                _drop_the_slow(alive, n, warm, state)
        if not alive:
            break
    return {c: {name: {n: statistics.median(s[n][subject.warmup:] or s[n]) for n in subject.rows}
                for name, s in by_model.items()}
            for c, by_model in samples.items() if c not in state.too_slow and _complete(by_model)}


def _drop_the_slow(alive: list[str], width: int, warm: bool, state: Choosing) -> None:
    """Stop timing the alive candidates whose last forward at `width` was too_slow against the best other's."""
    last = {c: state.timed[c][width][-1] for c in alive if state.timed.get(c, {}).get(width)}
    for candidate, seconds in last.items():
        best = min((s for other, s in last.items() if other != candidate), default=None)
        if too_slow(seconds, best, warm):
            alive.remove(candidate)
            state.too_slow[candidate] = f"a forward {seconds / best:.1f}x the best at {width} rows"


def _complete(by_model: Mapping[str, Mapping[int, list[float]]]) -> bool:
    """Whether every model of a candidate was timed at every width at least once."""
    return all(all(widths.values()) for widths in by_model.values())


def _slow_format_hook() -> dict[str, float]:
    """$VERISPEC_SLOW_FORMAT as candidate -> seconds each of its calls sleeps ("w8a8-u8=5,none=2")."""
    hook = {}
    for part in filter(None, os.environ.get(SLOW_FORMAT_ENV, "").split(",")):
        candidate, _, seconds = part.partition("=")
        try:
            hook[candidate.strip()] = float(seconds)
        except ValueError:
            raise ValueError(f"{SLOW_FORMAT_ENV}: {part!r} is not candidate=seconds (e.g. w8a8-u8=5)") from None
    return hook


def _slowed_call(call: Callable[[], object], seconds: float) -> Callable[[], object]:
    def slowed() -> object:
        time.sleep(seconds)
        return call()

    return slowed


class _Slowed:
    """A model whose forwards sleep `seconds` first: a candidate made slow on purpose ($VERISPEC_SLOW_FORMAT)."""

    def __init__(self, model: Forwarding, seconds: float) -> None:
        self.model, self.seconds, self.vocab_size = model, seconds, model.vocab_size

    def new_cache(self, batch_size: int, capacity: int):
        return self.model.new_cache(batch_size, capacity)

    def forward(self, input_ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.model.forward(input_ids, cache, last_only=last_only)


# -- the choice in force, checked against what its forwards cost later ---------------------------------------


@dataclass
class CostCheck:
    """A remembered choice in force, checked against one-row forwards of the loaded model timed later: at load, and
    while a server or an engine runs it (the median of the last WINDOW). Targets and drafts alike: where the format
    in force costs MARGIN times another candidate's remembered one-row cost, that candidate is faster here."""

    chosen: str  # the candidate in force, e.g. "w4a8" or "w8a8-u8"
    one_row: Mapping[str, float]  # candidate -> remembered seconds of one one-row forward (where timed)
    calibration: float = 1.0  # the loaded model's measured one-row forward over its remembered estimate (a probe's)
    observed: collections.deque = field(default_factory=lambda: collections.deque(maxlen=WINDOW))

    def faster_candidate(self, seconds: float) -> str | None:
        """The remembered candidate that a forward of `seconds` in the format in force costs MARGIN times (scaled
        by the calibration), if any."""
        others = {name: cost for name, cost in self.one_row.items() if name != self.chosen}
        if not others:
            return None
        best = min(others, key=others.get)
        return best if seconds > MARGIN * self.calibration * others[best] else None

    def observe(self, seconds: float) -> bool:
        """One one-row forward timed while running: True when the median of the last WINDOW ones says another
        candidate is faster."""
        self.observed.append(seconds)
        return len(self.observed) == WINDOW and self.faster_candidate(statistics.median(self.observed)) is not None


# -- the screen: a few linears of the model's MLP shape --------------------------------------------------------


def linear_screen(candidate: str, dtype: torch.dtype, in_features: int, out_features: int,
                  copies: int = SCREEN_COPIES) -> Callable[[], object] | None:
    """One call of `copies` random in -> out linears in `candidate`'s format at one row; None where it cannot be
    built here. w4a8 is screened with its 4-bit kernel (what its one-row passes run)."""
    weight_format, _, activations = candidate.partition("-")
    if weight_format == "w4a8":
        activations = "kernel"
    generator = torch.Generator().manual_seed(0)
    linears = []
    try:
        for _ in range(copies):
            linear = Linear((torch.randn(out_features, in_features, generator=generator) * 0.02).to(dtype))
            linear.quantize(weight_format, activations or "s8")
            linears.append(linear)
    except (RuntimeError, NotImplementedError, ValueError):
        return None
    x = torch.randn(1, in_features, generator=generator).to(dtype)  # (1, in)
    return lambda: [linear(x) for linear in linears]


def progress_line(enabled: bool, label: str) -> tuple[Callable[[str], None] | None, Callable[[], None]]:
    """(on_progress, close): a one-line progress display saying what `label`'s choosing times, where enabled."""
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=0, desc=label, bar_format="{desc}: {postfix} [{elapsed}]")
    return (lambda text: bar.set_postfix_str(text)), bar.close
