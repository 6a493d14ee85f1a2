"""Every setting of the adaptive controller, in one object: its cost model, its acceptance estimate and its rules read
them from here (verispec.cost_model, verispec.acceptance, verispec.policy), so this sits below all three."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ControllerSettings:
    k_max: int = 8  # longest draft considered
    smoothing: float = 0.15  # weight of the newest observation in every moving average of a cost
    acceptance_memory: float = 32.0  # steps of a source its acceptance counts remember (see SourceAverages.record)
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
    seed_tolerance: float = 2.0  # seeds a step's forward finds this many times off (either way) are stale (check_seeds)
    slow_forward_clip: float = 1.25  # a forward slower than this times its average counts as this (clip_slow_forward)
    row_prior_steps: float = 4.0  # a sequence's own acceptance counts as much as its source's after this many steps
    prior_steps: float = 2.0  # what a position's prior (prior_acceptance, or the position before) weighs, in steps
    recent_steps: int = 32  # the steps of recent sources counted before their counts halve (see recent_source)
