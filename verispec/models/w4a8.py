"""The w4a8 format: int8 weights that are 4-bit codes times small integers, read as 4 bits by short passes.

Every weight is an int8 value w[n, k] = m[n, g] * q[n, k] + o[n, g] with q in -8..7, an integer
multiplier m in 1..16 and an integer offset o per group g of 32 inputs (an asymmetric grid, like
llama.cpp's Q4_1), times a float scale per output row: the int8 weights of w8a8, restricted to
values a 4-bit code can name. Activations are int8 with one scale per row, as in w8a8. Passes of
up to KERNEL_MAX_ROWS rows (plain decoding, a verify pass, a draft step) run verispec's kernel
over the 4-bit codes, multipliers and offsets, about half the bytes of int8, read once for all
the rows, with activation quantization and the float finish in the same call; longer passes
(prefill) run oneDNN's int8 matmul on an int8 copy of the weights, or the same kernel where it is
as fast (timed once per machine; then no int8 copy is kept). Both compute the same exact integer sums
and then the same float roundings, so a row gets the same bits whichever path and whatever other
rows run with it (batch-invariant).

No package on PyPI gives torch an int4 x int8 CPU kernel that could agree with oneDNN bit for bit:
torch's int4 kernel takes bfloat16 activations, its `_dyn_quant_matmul_4bit` is a scalar
reference on x86, torchao's wheel carries no CPU kernels, onnxruntime's grows with the row count.
So verispec builds this one (kernels/w4a8.cpp: AVX-512 VNNI, or AVX2 on CPUs without AVX-512:
the same integers, so the same bits) with torch.utils.cpp_extension the
first time it is needed: seconds to a minute, once per machine and torch version, kept under the
verispec cache. The same extension holds the one-query-at-a-time attention kernel
(kernels/attention.cpp, see verispec.models.attention) and the RMS norm (kernels/norm.cpp, see
verispec.models.transformer).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import shutil
from pathlib import Path

import torch

from verispec.models.machine import cache_lock, cache_root, cpu_flags

GROUP_SIZE = 32  # inputs sharing one integer multiplier and offset
COLUMNS = 16  # output columns per packed block
# Passes of up to this many rows read the 4-bit codes; longer ones (prefill) run oneDNN's int8 matmul,
# whose AMX / VNNI tiles win once the kernel here turns compute-bound: reading half the bytes stops paying
# when enough rows share each read (benchmarks/archive/xeon/fast-w4a8/).
KERNEL_MAX_ROWS = 8
# One extension holds the w4a8 kernel and the attention and norm kernels (see attention and transformer).
SOURCES = [Path(__file__).with_name("kernels") / name for name in ("w4a8.cpp", "attention.cpp", "norm.cpp")]
HEADERS = [Path(__file__).with_name("kernels") / "vec16.h"]
# The instruction sets the kernels are built for, the first this CPU has all of: (CPU flags, compiler flags).
INSTRUCTION_SETS = (
    (("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]),
    (("avx2", "fma"), ["-mavx2", "-mfma"]),  # kernels/vec16.h's two-halves path
)
# -fopenmp: at::parallel_for then runs on torch's threads (without it, on one); no FMA contraction.
BASE_COMPILE_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]


class KernelUnavailable(RuntimeError):
    """w4a8 cannot run here; the message says why and what to use instead."""


def missing_cpu_flags() -> list[str]:
    """What this CPU lacks of the least of INSTRUCTION_SETS; empty where the kernels can be built here."""
    missing = [[flag for flag in needed if flag not in cpu_flags()] for needed, _ in INSTRUCTION_SETS]
    return [] if [] in missing else missing[-1]


def compile_flags() -> list[str]:
    """The compiler flags for the best of INSTRUCTION_SETS this CPU has (the last where it has none)."""
    for needed, flags in INSTRUCTION_SETS:
        if all(flag in cpu_flags() for flag in needed):
            return BASE_COMPILE_FLAGS + flags
    return BASE_COMPILE_FLAGS + INSTRUCTION_SETS[-1][1]


_build_failure: KernelUnavailable | None = None  # set once a build failed: not tried again in this process


def unavailable_reason() -> str | None:
    """Why w4a8 cannot run on this machine, or None when it can (the kernel may still need building)."""
    if _build_failure is not None:
        return str(_build_failure)
    missing = missing_cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler found (apt install g++)"
    return None


@functools.cache
def build_digest() -> str:
    """What names a build of the kernels: their sources, compile flags and torch version (12 hex digits)."""
    sources = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    recipe = sources + " ".join([*compile_flags(), torch.__version__]).encode()
    return hashlib.sha256(recipe).hexdigest()[:12]


def _build_directory() -> Path:
    path = cache_root() / "kernels" / f"w4a8-{build_digest()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def is_built() -> bool:
    return any(_build_directory().glob("*.so"))


def load_kernel() -> None:
    """Build (first time) and load the kernels, registering torch.ops.verispec.w4a8_linear and .attend."""
    global _build_failure
    if hasattr(torch.ops.verispec, "w4a8_linear"):
        return
    if _build_failure is not None:
        raise _build_failure
    try:
        _build_and_load()
    except KernelUnavailable as error:
        _build_failure = error
        raise


@contextlib.contextmanager
def _building(directory: Path):
    """Holds the cache's lock on the build directory while torch builds or loads the kernels there, and under it
    removes torch's own lock file where a killed build left it: torch waits on that file forever, even to load a
    kernel already built, and every process that builds here holds the cache's lock first."""
    with cache_lock(f"kernels-{directory.name}"):
        (directory / "lock").unlink(missing_ok=True)
        yield


def _put_ninja_on_path() -> None:
    """torch builds extensions with ninja; the `ninja` wheel (a dependency) has it when the system does not."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # cpp_extension then says ninja is missing, and w4a8 is left out
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build_and_load() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(f"--quantize w4a8 cannot run: {reason}; use --quantize w8a8 or none")
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    output = io.StringIO()
    build_directory = _build_directory()
    try:
        with _building(build_directory), contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            cpp_extension.load(
                name="verispec_kernels", sources=[str(source) for source in SOURCES], extra_cflags=compile_flags(),
                extra_ldflags=["-fopenmp"], build_directory=str(build_directory), is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as error:
        raise KernelUnavailable(
            f"building the w4a8 kernel failed ({error}); use --quantize w8a8 or none. Compiler output:\n"
            + output.getvalue()[-2000:]
        ) from error


def quantize(weight: torch.Tensor, keep_int8: bool = True) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """weight (N, K) ~= scale[n] * int8[n, k], int8 = m * q + o (see the module docstring), in the kernel's C++.

    Returns int8 (N, K), the weights oneDNN runs (None unless keep_int8); scale (N,) float32; packed
    (N/16, K/32, 288) uint8, the same weights as 4-bit codes and per-group multipliers and offsets,
    what the kernel reads. Each group keeps the multiplier and offset around its ideal grid with the
    least squared error. The search is the slow part of loading a large model, so the results of large
    weights are kept on disk under the verispec cache, keyed by the weight's bytes and this kernel
    build (`quantized_path`): a later load reads them, far faster, and gets the same bits.
    """
    load_kernel()
    path = quantized_path(weight) if weight.numel() >= CACHED_MIN_WEIGHTS else None
    stored = _read_quantized(path, keep_int8) if path is not None else None
    if stored is not None:
        return stored
    int8, scale, packed = search_grid(weight)
    if path is not None:
        _write_quantized(path, {"scale": scale, "packed": packed, **({"int8": int8} if keep_int8 else {})})
    return (int8 if keep_int8 else None), scale, packed


CACHED_MIN_WEIGHTS = 1 << 20  # smaller weights quantize quickly: not worth a file each


def search_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's search for each group's multiplier and offset: (int8, scale, packed), as `quantize` returns."""
    return torch.ops.verispec.w4a8_quantize(weight)


def quantized_path(weight: torch.Tensor) -> Path:
    """Where the quantized form of `weight` is kept: named by a hash of its dtype, shape and bytes, in a
    folder of this kernel build (sources, flags and torch version), so a changed kernel never reads old results."""
    digest = hashlib.blake2b(f"{weight.dtype} {tuple(weight.shape)}".encode(), digest_size=20)
    digest.update(weight.detach().contiguous().view(torch.uint8).reshape(-1).numpy())
    return _build_directory() / "weights" / f"{digest.hexdigest()}.safetensors"


def _read_quantized(path: Path, keep_int8: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
    """The kept (int8, scale, packed) at path; None where it is missing, unreadable or lacks the int8 copy asked for."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        stored = load_file(path)
    except (OSError, SafetensorError):
        return None
    if (keep_int8 and "int8" not in stored) or not {"scale", "packed"} <= stored.keys():
        return None
    return stored.get("int8") if keep_int8 else None, stored["scale"], stored["packed"]


def _write_quantized(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write next to path and rename: a reader (another replica loading the same model) never sees half a file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    try:
        save_file(tensors, scratch)
        os.replace(scratch, path)
    except OSError:  # a full or read-only disk costs the next load the search again, nothing else
        scratch.unlink(missing_ok=True)


def supports_shape(out_features: int, in_features: int) -> bool:
    return out_features % COLUMNS == 0 and in_features % GROUP_SIZE == 0


def matmul(xq: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """xq (M, K) int8 -> (M, N) float32: float(exact integer sums) * scale, as oneDNN's int8 matmul gives."""
    return torch.ops.verispec.w4a8_matmul(xq, packed, scale)
