"""The server's scheduler: the core's continuous-batching Scheduler, built from the models named on the command
line (build_scheduler) and run in the thread that loaded them (start_in_model_thread)."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Callable

import torch

from verispec.core.requests import SchedulerLimits
from verispec.core.scheduler import MODEL_DRAFTERS, SERVED_DRAFTERS, Scheduler
from verispec.drafters import CrossTokenizerDrafter, quantize_draft
from verispec.drafters.base import Drafter
from verispec.grammar import SchemaError, compiler_for
from verispec.models.loading import load_model

if TYPE_CHECKING:
    from verispec.serving.metrics import ServerMetrics


def start_in_model_thread(build: Callable[[], Scheduler], threads: int | None = None) -> Scheduler:
    """Run build() (loading the models) in a new thread, then the scheduler's loop in that same thread.

    torch's CPU kernels run on OpenMP, and libgomp keeps a thread pool for each thread that starts
    parallel work: models loaded in one thread and decoded in another leave two pools on the cores,
    and libgomp, counting more threads than cores, stops spinning between parallel regions, which slows
    every decoding step markedly. So one thread
    loads the models and runs every step; the caller's thread (the HTTP server) runs no torch
    kernels. Errors of build() are raised here.
    """
    outcome: dict[str, object] = {}
    ready = threading.Event()

    def main() -> None:
        try:
            if threads:
                torch.set_num_threads(threads)  # per thread under OpenMP
            scheduler = build()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error
            ready.set()
            return
        scheduler._thread = threading.current_thread()
        outcome["scheduler"] = scheduler
        ready.set()
        scheduler._run()

    threading.Thread(target=main, name="verispec-scheduler", daemon=True).start()
    ready.wait()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["scheduler"]


def build_scheduler(
    target: str,
    draft: str | None,
    drafter: str,
    dtype: str = "auto",
    draft_quantize: str = "auto",
    k: int | str = "auto",
    k_max: int = 8,
    limits: SchedulerLimits = SchedulerLimits(),
    metrics: "ServerMetrics | None" = None,
    progress: bool = False,
    quantize: str = "auto",
    chunked_prefill: bool | None = None,
    k_per_sequence: bool = False,
    draft_vocab: str | int = "full",
    foreign_draft_crosses: bool = False,
    draft_p_min: float = 0.0,
) -> Scheduler:
    """Load the models named on the command line and build (not start) a scheduler over them.

    chunked_prefill None: on where the target is batch-invariant (its chunks ride in the decoding steps'
    own forwards), else off. foreign_draft_crosses: a draft model whose tokenizer differs from the target's
    drafts through the cross-tokenizer drafter (the drafter was not named; `Scheduler.drafter` says which ran),
    where otherwise a draft-model or composite drafter refuses it.
    """
    from verispec.drafters import QUANTIZATIONS, draft_model_drafter, is_head_spec, load_head, same_vocabulary

    if drafter not in SERVED_DRAFTERS:
        raise ValueError(f"the server's drafter must be one of {', '.join(SERVED_DRAFTERS)}, got {drafter!r}")
    needs_model = drafter in MODEL_DRAFTERS or drafter == "cross-tokenizer"
    if needs_model and (draft is None or draft.lower() == "none"):
        raise ValueError(f"drafter {drafter!r} needs a draft model: pass --draft NAME_OR_PATH (or --drafter none)")
    head = needs_model and is_head_spec(draft)  # a draft head over the target's hidden states, not a model
    if head and drafter not in MODEL_DRAFTERS:
        raise ValueError(f"a draft head runs as drafter draft-model or composite, not {drafter!r}")
    needs_model = needs_model and not head
    if needs_model and draft_quantize not in QUANTIZATIONS:
        raise ValueError(f"draft quantization {draft_quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    target_model = load_model(target, dtype, progress, quantize)
    draft_model, sequence_drafter = None, None
    loaded = load_model(draft, dtype, progress) if needs_model else None
    foreign = loaded is not None and not same_vocabulary(target_model, loaded)
    if drafter in MODEL_DRAFTERS and foreign_draft_crosses and foreign:
        drafter = "cross-tokenizer"
    if head:
        draft_model = load_head(draft, target_model)
    elif drafter in MODEL_DRAFTERS:
        draft_model = draft_model_drafter(loaded, target_model, dtype, draft_quantize, progress, draft_vocab).model
    elif drafter == "cross-tokenizer":  # each sequence re-encodes text its own way: its own drafter, one shared model
        quantize_draft(loaded, draft_quantize, progress, dtype_asked=dtype != "auto")

        def sequence_drafter() -> Drafter:
            return CrossTokenizerDrafter(loaded, target_model)
    limits = dataclasses.replace(
        limits, max_context=min(limits.max_context, target_model.model.config.max_position_embeddings)
    )
    try:  # the first request with a response_format would otherwise wait for it
        compiler_for(target_model)
    except SchemaError:
        pass  # such requests get the reason as a 400
    if chunked_prefill is None:
        chunked_prefill = target_model.model.batch_invariant
    return Scheduler(
        target_model, draft_model, drafter, k, k_max, limits, metrics, chunked_prefill, k_per_sequence, sequence_drafter,
        draft_p_min=draft_p_min,
    )
