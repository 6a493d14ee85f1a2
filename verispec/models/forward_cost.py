"""What whole forwards cost: models timed side by side, a few new tokens after a prompt, in interleaved rounds.

A forward's cost is what decides a format and a draft length: a linear timed alone misses the attention,
the norms and the memory traffic of the rest of the model. Each model gets its own KV cache holding a
`context`-token prompt; each round runs one forward per row count and model, the same row count of every model
back to back, and writes its new tokens after the prompt without committing them, so every round sees the
same cache. Machine noise then hits every model alike, and medians over the rounds (the first `warmup`
dropped: they allocate and pick kernels) are what is reported.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

import torch

from verispec.models import w4a8
from verispec.models.kv_cache import KVCache
from verispec.models.linear import time_call
from verispec.models.machine import remembered_choice, weights_identity

if TYPE_CHECKING:  # loading times targets with this module: it may not import loading
    from verispec.models.loading import LoadedModel

DEFAULT_ROWS = (1, 4, 8)  # plain decoding, a short verify pass, the longest draft's
DEFAULT_CONTEXT = 256  # tokens of prompt in the cache: a short prompt's worth, cheap to prefill
DEFAULT_ROUNDS = 7
WARMUP_ROUNDS = 2


class Forwarding(Protocol):
    """What forward_costs runs: a Transformer, or anything that makes a cache and runs forwards over it."""

    vocab_size: int

    def new_cache(self, batch_size: int, capacity: int) -> KVCache: ...

    def forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor: ...


def forward_costs(
    models: Mapping[str, "LoadedModel | Forwarding"],
    rows: tuple[int, ...] = DEFAULT_ROWS,
    context: int = DEFAULT_CONTEXT,
    rounds: int = DEFAULT_ROUNDS,
    warmup: int = WARMUP_ROUNDS,
    on_round: Callable[[int, int], None] | None = None,
) -> dict[str, dict[int, float]]:
    """Median seconds of one forward of `n` new tokens after `context` tokens, per model and n in rows.

    models: name -> a LoadedModel or its Transformer. on_round(done, total) is called after each round,
    warm-up rounds included (total = warmup + rounds).
    """
    if not models:
        raise ValueError("forward_costs needs at least one model")
    if rounds < 1 or warmup < 0 or context < 1 or not rows or min(rows) < 1:
        raise ValueError(f"need rounds >= 1, warmup >= 0, context >= 1 and rows >= 1; got {rounds}, {warmup}, "
                         f"{context}, {rows}")
    transformers = {name: m if hasattr(m, "forward") else m.model for name, m in models.items()}  # LoadedModel: .model
    caches = {name: prompted_cache(model, context, max(rows)) for name, model in transformers.items()}
    inputs = {name: {n: cost_token_ids(n, m.vocab_size, offset=7) for n in rows} for name, m in transformers.items()}
    seconds: dict[tuple[str, int], list[float]] = {(name, n): [] for name in transformers for n in rows}
    total = warmup + rounds
    for done in range(1, total + 1):
        for n in rows:
            for name, model in transformers.items():
                started = time.perf_counter()
                model.forward(inputs[name][n], caches[name])  # new tokens after the prompt, never committed
                seconds[(name, n)].append(time.perf_counter() - started)
        if on_round is not None:
            on_round(done, total)
    return {name: {n: statistics.median(seconds[(name, n)][warmup:]) for n in rows} for name in transformers}


def prompted_cache(model: Forwarding, context: int, most_rows: int) -> KVCache:
    """A one-row cache holding a `context`-token prompt, with room for `most_rows` more."""
    cache = model.new_cache(1, context + most_rows)
    model.forward(cost_token_ids(context, model.vocab_size, offset=1000), cache, last_only=True)
    cache.commit(context)
    return cache


def cost_token_ids(count: int, vocab_size: int, offset: int) -> torch.Tensor:
    """(1, count) distinct-looking token ids that every vocabulary holds: what they say does not change a cost."""
    return ((torch.arange(count) + offset) % vocab_size)[None]


STEP_ROWS = (1, 2, 4, 8)  # a plain step and verify passes of 1, 3 and 7 drafts (between them, lines)
STEP_CONTEXT = 32  # tokens of prompt before the timed forwards
CATCH_UP_TOKENS = 32  # a draft model's catch-up is timed as one forward over this many tokens
STEP_ROUNDS = 3


def step_costs(target: "LoadedModel", draft: Forwarding | None = None) -> dict:
    """What a step's parts cost here, before any request: {"verify": {tokens: seconds of a target forward over
    them}, "draft": seconds of a two-token draft-model forward (what a draft position costs: a step's first
    draft forward feeds the token the last verify pass added too) or None, "catch_up_per_token": seconds per token of
    a draft-model forward over CATCH_UP_TOKENS tokens (a catch-up) or None}.

    Remembered per machine, weights, formats and threads where both models are named (a draft loaded by
    load_draft_model carries its weights' directory): the same models then start from the same costs without
    timing them again. What the steps measure later moves these as it moves any measured cost. "remembered":
    the record's kind (forget_choice drops it, so that the next start times again), None where not remembered.
    """

    def measure() -> dict:
        models = {"target": target.model} | ({"draft": draft} if draft is not None else {})
        context = max(1, min(STEP_CONTEXT, target.model.config.max_position_embeddings - max(STEP_ROWS) - 1))
        costs = forward_costs(models, STEP_ROWS, context, rounds=STEP_ROUNDS, warmup=1)
        return {
            "verify": {str(n): seconds for n, seconds in costs["target"].items()},
            # A drafting step's first draft forward feeds the token the last verify pass added as well: two tokens.
            "draft": costs["draft"][2] if draft is not None else None,
            "catch_up_per_token": _catch_up_seconds(draft) / CATCH_UP_TOKENS if draft is not None else None,
        }

    check = getattr(draft, "format_check", None)
    if draft is not None and check is None:  # an unnamed draft (built in memory): timed, not remembered
        measured, kind = measure(), None
    else:
        draft_name = "none" if draft is None else f"{weights_identity(check.directory)} {check.chosen}"
        if getattr(draft, "output_token_ids", None) is not None:  # a head over fewer tokens (draft_vocab)
            draft_name += f" head {draft.lm_head.out_features}"
        target_format = target.format.label if target.format is not None else str(target.model.dtype)
        kind = (f"step costs | target {weights_identity(target.directory)} {target_format} | draft {draft_name}"
                f" | {torch.get_num_threads()} threads | kernels {w4a8.build_digest()}")
        measured = remembered_choice(kind, measure)
    return measured | {"verify": {int(n): seconds for n, seconds in measured["verify"].items()}, "remembered": kind}


def _catch_up_seconds(draft: Forwarding, rounds: int = STEP_ROUNDS) -> float:
    """Median seconds of one draft forward over CATCH_UP_TOKENS new tokens, scoring only the last (a catch-up)."""
    cache = draft.new_cache(1, CATCH_UP_TOKENS)
    tokens = cost_token_ids(CATCH_UP_TOKENS, draft.vocab_size, offset=11)
    # never committed: every call sees the empty cache
    return time_call(lambda: draft.forward(tokens, cache, last_only=True), repeats=rounds)
