"""The w4a8 kernel of the working tree against the one of a git revision, in one process, interleaved.

    .venv/bin/python benchmarks/scripts/kernel_ab.py --base HEAD~1 --out benchmarks/results/KIND/RUN/kernel-ab

The base revision's kernel sources are built under another op namespace (verispec_base), so both
kernels are loaded at once and timed in alternating order, round after round: machine noise (these
machines are shared, and their speed moves by a third within an hour) hits both alike. Timed: the
target's w4a8 linears alone (12 copies of each weight in turn, so the large ones come from memory) and a
whole target forward (the same loaded model, its linears switched between the two kernels), at 1, 2,
4 and 8 rows. Every output of the two kernels is checked to be bit-identical first.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension
from tqdm import tqdm

from verispec.bench.machine import machine_description
from verispec.models import linear, w4a8
from verispec.models.loading import load_model

ROWS = (1, 2, 4, 8)
SHAPES = ((2048, 1536), (1536, 1536), (8960, 1536), (1536, 8960))  # qkv, o, up (gate alike), down of the 1.5B
KERNEL_DIR = "verispec/models/kernels"


def build_base(revision: str, directory: Path) -> None:
    """The kernel sources of `revision` under op namespace verispec_base, built and loaded."""
    for source in [*w4a8.SOURCES, *w4a8.HEADERS]:
        text = subprocess.run(["git", "show", f"{revision}:{KERNEL_DIR}/{source.name}"], capture_output=True,
                              text=True, check=True).stdout
        text = re.sub(r"TORCH_LIBRARY(_FRAGMENT|_IMPL)?\(verispec,", r"TORCH_LIBRARY\1(verispec_base,", text)
        (directory / source.name).write_text(text)
    cpp_extension.load(name="verispec_base_kernels", sources=[str(directory / s.name) for s in w4a8.SOURCES],
                       extra_cflags=w4a8.compile_flags(), extra_ldflags=["-fopenmp"], build_directory=str(directory),
                       is_python_module=False)


def time_linears(kernels: dict, rounds: int) -> dict:
    """Median ms per w4a8 linear call, (shape, rows, kernel) -> ms."""
    generator = torch.Generator().manual_seed(0)
    seconds = {}
    for n_out, k in tqdm(SHAPES, desc="linears"):
        copies = []
        for _ in range(12):
            _, scale, packed = w4a8.quantize(torch.randn(n_out, k, generator=generator, dtype=torch.float32)
                                             .to(torch.bfloat16))
            copies.append((packed, scale))
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
            outputs = [ops.w4a8_linear(x, *copies[0], None) for ops in kernels.values()]
            assert all(torch.equal(outputs[0], out) for out in outputs[1:]), f"{n_out}x{k} {rows} rows differ"
            for round_ in range(rounds + 2):
                names = list(kernels) if round_ % 2 else list(reversed(kernels))
                for name in names:
                    started = time.perf_counter()
                    for packed, scale in copies:
                        kernels[name].w4a8_linear(x, packed, scale, None)
                    if round_ >= 2:
                        seconds.setdefault((f"{n_out}x{k}", rows, name), []).append(
                            (time.perf_counter() - started) / len(copies))
    return {key: 1000 * statistics.median(values) for key, values in seconds.items()}


def time_forwards(kernels: dict, target: str, rounds: int, context: int) -> dict:
    """Median ms per target forward with `context` tokens cached, (rows, kernel) -> ms."""
    loaded = load_model(target, "bfloat16", progress=True, quantize="w4a8")
    model, chosen = loaded.model, {"ops": kernels["new"]}
    original = linear.Linear._w4a8

    def switched(self, flat):  # the same packed weights through the kernel chosen for this round
        if flat.shape[0] <= w4a8.KERNEL_MAX_ROWS or self.activations == "kernel":
            return chosen["ops"].w4a8_linear(flat, self.packed, self.scales, self.bias)
        return original(self, flat)

    linear.Linear._w4a8 = switched
    cache = model.new_cache(1, context + max(ROWS) + 1)
    model.forward(torch.arange(1000, 1000 + context)[None], cache, last_only=True)
    cache.commit(context)
    seconds = {}
    for rows in ROWS:
        x = torch.arange(7, 7 + rows)[None]
        logits = []
        for ops in kernels.values():
            chosen["ops"] = ops
            logits.append(model.forward(x, cache))
        assert all(torch.equal(logits[0], other) for other in logits[1:]), f"forward logits differ at {rows} rows"
    for round_ in tqdm(range(rounds + 2), desc="forwards"):
        for rows in ROWS:
            names = list(kernels) if (round_ + rows) % 2 else list(reversed(kernels))
            for name in names:
                chosen["ops"] = kernels[name]
                started = time.perf_counter()
                model.forward(torch.arange(7, 7 + rows)[None], cache)
                if round_ >= 2:
                    seconds.setdefault((rows, name), []).append(time.perf_counter() - started)
    linear.Linear._w4a8 = original
    return {key: 1000 * statistics.median(values) for key, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision whose kernel is the baseline")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    w4a8.load_kernel()
    with tempfile.TemporaryDirectory() as directory:
        build_base(args.base, Path(directory))
        kernels = {"base": torch.ops.verispec_base, "new": torch.ops.verispec}
        linears = time_linears(kernels, args.rounds)
        forwards = time_forwards(kernels, args.target, args.rounds, args.context)

    base_commit = subprocess.run(["git", "rev-parse", "--short", args.base], capture_output=True, text=True,
                                 check=True).stdout.strip()
    machine = machine_description()
    header = "| | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in ROWS) + " |"
    rule = "|---" * (len(ROWS) + 1) + "|"
    lines = [
        f"# w4a8 kernel: working tree against {args.base} ({base_commit}), interleaved in one process",
        "",
        f"    .venv/bin/python benchmarks/scripts/kernel_ab.py --base {args.base} --out {args.out}",
        "",
        f"Machine: {machine['cpu']} ({', '.join(machine['cpu_features'])}), {machine['cores']} cores, "
        f"{args.threads} threads, torch {machine['torch']}. Medians of {args.rounds} rounds, base and new "
        "alternating; outputs of the two kernels bit-identical (checked).",
        "",
        f"## Whole target forward ({args.target}, {args.context} tokens cached), ms",
        "",
        header, rule,
        "| base | " + " | ".join(f"{forwards[(r, 'base')]:.1f}" for r in ROWS) + " |",
        "| new | " + " | ".join(f"{forwards[(r, 'new')]:.1f}" for r in ROWS) + " |",
        "| new / base | " + " | ".join(f"{forwards[(r, 'new')] / forwards[(r, 'base')]:.2f}x" for r in ROWS) + " |",
        "",
        "8 rows over 1 row: base "
        f"{forwards[(8, 'base')] / forwards[(1, 'base')]:.2f}x, new {forwards[(8, 'new')] / forwards[(1, 'new')]:.2f}x.",
        "",
        "## One linear (12 copies of its weights in turn: the up and down projections come from memory), ms per call",
        "",
        "| out x in | kernel | " + " | ".join(str(r) for r in ROWS) + " |",
        "|---|---" + "|---" * len(ROWS) + "|",
    ]
    for n_out, k in SHAPES:
        shape = f"{n_out}x{k}"
        for name in ("base", "new"):
            lines.append(f"| {shape} | {name} | " + " | ".join(f"{linears[(shape, r, name)]:.3f}" for r in ROWS) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "README.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({
        "base": base_commit, "machine": machine, "rounds": args.rounds, "context": args.context,
        "forward_ms": {f"{rows}/{name}": ms for (rows, name), ms in forwards.items()},
        "linear_ms": {f"{shape}/{rows}/{name}": ms for (shape, rows, name), ms in linears.items()},
    }, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
