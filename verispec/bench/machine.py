"""What machine a benchmark ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from verispec.models.machine import cpu_flags, cpu_supports_bfloat16


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
        "cpu_features": [f for f in MATRIX_FEATURES if f in cpu_flags()],  # which kernels this CPU can run
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
