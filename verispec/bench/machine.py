"""What machine a benchmark ran on."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from verispec.models.machine import cpu_flags, cpu_model, cpu_supports_bfloat16


# The instruction sets that decide which matrix kernels are fastest (Intel Xeons advertise AMX, AMD EPYC does not).
MATRIX_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def machine_description() -> dict:
    """CPU model, cores, memory, bf16 support, threads and software versions."""
    cpu = platform.processor() or platform.machine()
    family_model = {}  # "cpu family" and "model": what tells an AMD EPYC Zen 2 (23, 49) from a Zen 5 (26, 2)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name":
                cpu = value
            elif key in ("cpu family", "model"):
                family_model[key] = value
            elif not line.strip():
                break  # the first CPU's block is enough
    except OSError:
        pass
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_family_model": f"{family_model.get('cpu family', '?')}/{family_model.get('model', '?')}",
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "bfloat16_dot_products": cpu_supports_bfloat16(),
        "cpu_features": matrix_features(),  # which kernels this CPU can run
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def matrix_features() -> list[str]:
    """The MATRIX_FEATURES this CPU has: which kernels it can run."""
    return [f for f in MATRIX_FEATURES if f in cpu_flags()]


def machine_line() -> str:
    """The one line each result's run.json names its machine by: kind, CPU model, cores, ISA features."""
    features = "+".join(matrix_features()) or "none of " + "/".join(MATRIX_FEATURES)
    return f"{machine_kind()}: {cpu_model()}, {os.cpu_count()} cores, {features}"


def machine_kind() -> str:
    """This machine's kind, the folder of benchmarks/results/ its runs go to: zen2 ... zen5, xeon; else a rough name.

    "AMD EPYC" alone names Zen 2 to Zen 5 alike: the CPU family tells them apart (23: Zen 1/2, 25: Zen 3/4,
    26: Zen 5), and in family 25 AVX-512, which Zen 4 brought.
    """
    model = cpu_model()
    numbers = re.search(r"\((\d+)/(\d+)\)$", model)
    family, number = (int(numbers[1]), int(numbers[2])) if numbers else (None, None)
    if "AMD" in model and family is not None:
        if family == 23:
            return "zen2" if number >= 0x30 else "zen1"
        if family == 25:
            return "zen4" if "avx512f" in cpu_flags() else "zen3"
        if family == 26:
            return "zen5"
        return f"amd-family-{family}"
    if "Xeon" in model:
        return "xeon"
    if "Intel" in model:
        return "intel"
    return platform.machine() or "unknown"


def git_commit() -> str | None:
    """The short hash of the git checkout verispec runs from; None where it is not one (an installed package)."""
    root = Path(__file__).resolve().parents[2]  # verispec/bench/machine.py -> the checkout's root
    try:
        done = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != root:
        return None  # not a checkout, or verispec sits inside some other repository (a venv in it)
    return lines[1]
