"""Facts about this machine that the models depend on: its CPU, its cache directory, and the choices timed on it.

The one place for them (loading, the kernels, the formats and the benchmarks' machine description all read
them here), so no module imports a higher layer for a CPU flag or the cache root.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

FORMAT_CHOICES_FILE = "format-choices.json"
CACHE_MARKER = "verispec-cache.json"  # written last in a converted model's directory: one without it is unfinished


@functools.cache
def _cpuinfo_block() -> dict[str, str]:
    """The first CPU's block of /proc/cpuinfo, key -> value; empty where there is none (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    block: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if block:
                break  # the first CPU's block is enough
            continue
        key, _, value = (part.strip() for part in line.partition(":"))
        block.setdefault(key, value)
    return block


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo; empty where there is none."""
    return frozenset(_cpuinfo_block().get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name with its family/model numbers: "AMD EPYC" alone names Zen 2, 3, 4 and 5 alike."""
    block = _cpuinfo_block()
    name = block.get("model name") or "unknown CPU"
    return f"{name} ({block.get('cpu family', '?')}/{block.get('model', '?')})"


def cpu_supports_bfloat16() -> bool:
    """True when the CPU has native bfloat16 dot products (AVX-512 BF16 or AMX), where bf16 outruns f32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cache_root() -> Path:
    """$VERISPEC_CACHE, else $XDG_CACHE_HOME/verispec, else ~/.cache/verispec."""
    if os.environ.get("VERISPEC_CACHE"):
        return Path(os.environ["VERISPEC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "verispec"


@contextlib.contextmanager
def cache_lock(name: str):
    """Holds an exclusive lock on one cache entry (the OS lets go of it when the process dies): two processes that
    need the same model or kernel build at once (two replicas, two test workers) make it once, the second waiting for
    the first, never into each other's scratch files."""
    import fcntl

    path = cache_root() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def weights_identity(directory: Path) -> str:
    """What names a model's weights in a remembered choice (16 hex digits): a catalog model's GGUF sha256, else
    each weight file's name, size and modification time."""
    marker = directory / CACHE_MARKER
    if marker.exists():
        try:
            sha256 = json.loads(marker.read_text()).get("sha256")
        except (OSError, ValueError):
            sha256 = None
        if sha256:
            return sha256[:16]
    files = sorted(directory.glob("*.safetensors")) + [directory / "config.json"]
    stamp = "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.exists())
    return hashlib.sha256(stamp.encode()).hexdigest()[:16]


_consulted: set[str] = set()  # the kinds remembered_choice was asked for in this process: the choices in force


def remembered_choice(kind: str, measure: Callable[[], dict]) -> dict:
    """What `measure()` (a JSON-able dict) chose for `kind` the first time on this machine.

    `auto` formats are timed once per CPU model, core count and torch version (kind names the rest: the
    candidates, the kernel's digest, the model's shape) and then kept in the cache (delete
    format-choices.json there to time again): the same command then loads the same model every time,
    which timing noise between two close formats would not promise, and skips the timing.
    """
    _consulted.add(kind)
    key = f"{kind}{_machine_suffix()}"
    path = cache_root() / FORMAT_CHOICES_FILE
    table = _read_choices(path)
    if key not in table:
        table[key] = measure()
        _write_choices(path, _read_choices(path) | {key: table[key]})  # what others wrote while this one measured
    return table[key]


def forget_choice(kind: str) -> None:
    """Drop what remembered_choice kept for `kind` on this machine, so the next call measures again."""
    path = cache_root() / FORMAT_CHOICES_FILE
    table = _read_choices(path)
    if table.pop(f"{kind}{_machine_suffix()}", None) is not None:
        _write_choices(path, table)


def remembered_choices() -> dict[str, dict]:
    """The choices remembered_choice kept for this machine (CPU model, core count, torch version): kind -> choice."""
    suffix = _machine_suffix()
    table = _read_choices(cache_root() / FORMAT_CHOICES_FILE)
    return {key.removesuffix(suffix): choice for key, choice in table.items() if key.endswith(suffix)}


def consulted_kinds() -> frozenset[str]:
    """The kinds this process asked remembered_choice for: which remembered choices its models loaded by."""
    return frozenset(_consulted)


def _machine_suffix() -> str:
    """What follows the kind in a remembered choice's key: the machine and software it was timed on."""
    return f" | {cpu_model()} | {os.cpu_count()} cores | torch {torch.__version__}"


def _write_choices(path: Path, table: dict[str, dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(table, indent=1, sort_keys=True))
    scratch.replace(path)  # atomic: a concurrent reader sees the old table or the new one


def _read_choices(path: Path) -> dict[str, dict]:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}
