"""A target's `auto` weight format, chosen within a budget from whole forwards at the widths a step runs.

One linear timed alone misjudges a model: it misses the attention, the norms, the output head and the memory
traffic of the rest of the forward, so it can rank two formats the wrong way round (the format with the cheaper
linear can have the dearer whole forward). A linear only screens out the hopeless (format_chooser: such as a
reference path, far slower than the best on every measure). A whole target in every
candidate format would cost each first load a full quantization per format, so the survivors are timed as a
probe of the model itself: its first PROBE_SHARE of decoder layers with their real weights, the embedding and the
output head, and beside it the same head with no layers, at PROBE_ROWS new tokens (a plain step and verify
passes). A whole forward of n tokens is estimated as

    head(n) + (layers / probed layers) * (probe(n) - head(n))

and format_chooser.pick takes the least estimate summed over PROBE_ROWS. The choice is remembered per machine,
weights and kernel build (remembered_choice), with the ratio of the loaded model's measured one-row forward to its
estimate (calibrate), and checked whenever the model loads (slower_than_another) and while a server runs it
(ServingCheck), by format_chooser.CostCheck: where the loaded model's one-row forward costs MARGIN times another
candidate's calibrated estimate, the formats are timed again.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Callable, Iterable

import torch

from verispec.models import format_chooser, w4a8
from verispec.models.config import ModelConfig
from verispec.models.forward_cost import forward_costs
from verispec.models.linear import auto_candidates, candidate_choice, w4a8_long_pass_kinds
from verispec.models.machine import forget_choice, remembered_choice, weights_identity
from verispec.models.transformer import Transformer

PROBE_SHARE = 0.25  # of the decoder layers, loaded for the probe (at least MIN_PROBE_LAYERS)
MIN_PROBE_LAYERS = 2
PROBE_ROWS = (1, 2, 4, 8)  # a plain step, verify passes of 1, 3 and 7 drafts
PROBE_CONTEXT = 32  # tokens of prompt in the cache before each timed forward
PROBE_ROUNDS = 5
CHECK_ROUNDS = 3  # one-row forwards of the loaded model, after one warm-up, that check a remembered choice


def probe_layers(num_layers: int) -> int:
    """How many of a model's decoder layers the probe loads."""
    return min(num_layers, max(MIN_PROBE_LAYERS, round(num_layers * PROBE_SHARE)))


def probe_tensor_names(names: Iterable[str], config: ModelConfig) -> list[str]:
    """The tensors a probe needs: everything outside the decoder layers, and the first probe_layers() layers."""
    kept = {f"model.layers.{i}." for i in range(probe_layers(config.num_layers))}
    return [name for name in names if not name.startswith("model.layers.") or name[: name.index(".", 13) + 1] in kept]


def choice_kind(directory, dtype: torch.dtype) -> str:
    """The remembered choice's kind for a target's weights in `dtype` (remembered_choice adds the machine)."""
    return (f"target auto {str(dtype).removeprefix('torch.')} among {','.join(auto_candidates())}"
            f"; w4a8 long passes among {','.join(w4a8_long_pass_kinds())} | weights {weights_identity(directory)}"
            f" | kernels {w4a8.build_digest()} | screened, whole forwards within {format_chooser.BUDGETS['target']:.0f} s")


def choose(directory, config: ModelConfig, dtype: torch.dtype, read_probe: Callable[[], dict],
           progress: bool = False) -> tuple[dict, bool]:
    """(the remembered choice for the target in `directory`, whether it was timed just now).

    The choice is format_chooser.measure's record over the probe: {"format": a candidate of auto_candidates,
    "seconds": candidate -> estimated seconds of whole forwards summed over PROBE_ROWS, "one_row": candidate ->
    estimated seconds of a one-row forward, "screen", "too_slow", "choosing_seconds"}. read_probe() returns the
    probe's dense tensors (name -> tensor, see probe_tensor_names); it is called only when the formats are timed,
    and only if a candidate survives its screen.
    """
    timed_now = []

    def measure() -> dict:
        on_progress, close = format_chooser.progress_line(progress, f"choosing {Path(directory).name}'s format")
        try:
            record = format_chooser.measure(
                probe_subject(config, read_probe, dtype), auto_candidates(), format_chooser.BUDGETS["target"],
                on_progress=on_progress)
        finally:
            close()
        timed_now.append(True)
        return record

    return remembered_choice(choice_kind(directory, dtype), measure), bool(timed_now)


def calibrate(kept: dict, one_row: float, directory, dtype: torch.dtype) -> dict:
    """kept, remembered again with its "calibration": `one_row`, the loaded model's measured one-row forward
    (one_row_seconds), over the probe's estimate of it. The probe's few layers may stay in cache where a whole
    model's do not; the checks scale every estimate by this ratio, so that such a bias in the estimates does not
    make a choice look stale at every load."""
    estimate = kept["one_row"].get(kept["format"])  # none where the budget ended before any forward was timed
    calibrated = kept | {"calibration": one_row / estimate if estimate else 1.0}
    forget(directory, dtype)
    return remembered_choice(choice_kind(directory, dtype), lambda: calibrated)


def one_row_seconds(model: Transformer, rounds: int = CHECK_ROUNDS) -> float:
    """Median seconds of the loaded model's one-token forward after PROBE_CONTEXT tokens."""
    return forward_costs({"loaded": model}, (1,), PROBE_CONTEXT, rounds, warmup=1)["loaded"][1]


def cost_check(kept: dict) -> format_chooser.CostCheck:
    """The check of a remembered target choice: its one-row estimates, scaled by its calibration."""
    return format_chooser.CostCheck(kept["format"], kept.get("one_row", {}), kept.get("calibration", 1.0))


def slower_than_another(kept: dict, one_row: float) -> bool:
    """Whether a one-row forward of kept's format that took `one_row` seconds costs MARGIN times another
    candidate's remembered estimate (scaled by the calibration)."""
    return cost_check(kept).faster_candidate(one_row) is not None


@dataclasses.dataclass
class ServingCheck:
    """The remembered format of a loaded target, checked against the plain one-token forwards a server times
    (load_model sets one on the Transformer as `target_format_check`; the scheduler feeds it)."""

    kept: dict  # the remembered choice in force (see choose)
    directory: Path  # the target's weights, to time them and load them again
    dtype: torch.dtype
    stale: bool = False  # found slow: the remembered choice is forgotten and the target should be loaded again
    check: format_chooser.CostCheck = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.check = cost_check(self.kept)

    def observe(self, seconds: float) -> bool:
        """One plain one-token forward of the target: True (once) when the median of the last WINDOW ones costs
        MARGIN times another candidate's estimate; the remembered choice is then forgotten, so that the next
        load times the formats again."""
        if self.stale or not self.check.observe(seconds):
            return False
        self.stale = True
        forget(self.directory, self.dtype)
        return True


def forget(directory, dtype: torch.dtype) -> None:
    """Drop the remembered choice for this target, so that the next choose() times the formats again."""
    forget_choice(choice_kind(directory, dtype))


def probe_subject(config: ModelConfig, read_probe: Callable[[], dict], dtype: torch.dtype) -> format_chooser.Subject:
    """What choosing a target's format times: each candidate's probe (its first probe_layers() layers, embedding
    and head) beside the same head with no layers, at PROBE_ROWS new tokens; a whole forward of n tokens is
    estimated as head(n) + (layers / probed layers) * (probe(n) - head(n)). The screen is a linear of the model's
    MLP shape."""
    probed = probe_layers(config.num_layers)
    probe_config = dataclasses.replace(config, num_layers=probed)
    dense: dict = {}

    def build(candidate: str) -> dict[str, Transformer]:
        if not dense:
            dense.update(read_probe())
        choice = candidate_choice(candidate, dtype)
        probe = Transformer(probe_config, dict(dense), dtype, choice.weight_format, choice.activations)
        head_only = copy.copy(probe)  # the same embedding and head (shared tensors), no decoder layers
        head_only.layers = []
        return {"probe": probe, "head": head_only}

    def estimate(costs: dict[str, dict[int, float]]) -> dict[int, float]:
        probe, head = costs["probe"], costs["head"]
        return {n: head[n] + config.num_layers / probed * max(0.0, probe[n] - head[n]) for n in PROBE_ROWS}

    def screen(candidate: str):
        return format_chooser.linear_screen(candidate, dtype, config.hidden_size, config.intermediate_size)

    return format_chooser.Subject(screen, build, estimate, rows=PROBE_ROWS, context=PROBE_CONTEXT,
                                  rounds=PROBE_ROUNDS, warmup=1)
