"""Which instruction set verispec's kernels are built for, from the CPU's flags (no build, no kernel needed)."""

from __future__ import annotations

import pytest

from verispec.models import w4a8

ZEN4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
ZEN2 = {"avx", "avx2", "fma"}


@pytest.mark.parametrize(
    "flags, wanted",
    [(ZEN4, "-mavx512vnni"), (ZEN2, "-mavx2"), (ZEN4 - {"avx512_vnni"}, "-mavx2")],  # AVX-512 without VNNI: AVX2
)
def test_the_kernels_are_built_for_the_best_instruction_set_the_cpu_has(monkeypatch, flags, wanted):
    monkeypatch.setattr(w4a8, "cpu_flags", lambda: frozenset(flags))
    assert w4a8.missing_cpu_flags() == []
    flags_used = w4a8.compile_flags()
    assert wanted in flags_used and "-ffp-contract=off" in flags_used
    assert ("-mavx512f" in flags_used) == (wanted == "-mavx512vnni")


def test_a_cpu_without_avx2_is_told_what_it_lacks(monkeypatch):
    monkeypatch.setattr(w4a8, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    monkeypatch.setattr(w4a8, "_build_failure", None)
    assert w4a8.missing_cpu_flags() == ["avx2", "fma"]
    assert w4a8.unavailable_reason() == "this CPU lacks avx2, fma"


@pytest.mark.skipif(w4a8.unavailable_reason() is not None, reason="the kernels do not build on this CPU")
def test_a_lock_file_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch's lock file in the build directory, left by a build that was killed (a server stopped while it built),
    made every later load wait forever; the next load now clears it under verispec's own lock and loads."""
    import subprocess
    import sys

    stale = w4a8._build_directory() / "lock"
    stale.touch()
    loaded = subprocess.run([sys.executable, "-c", "from verispec.models import w4a8; w4a8.load_kernel()"],
                            timeout=300, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert not stale.exists()
