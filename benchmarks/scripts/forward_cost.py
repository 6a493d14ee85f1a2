"""What one target forward costs at 1, 2, 4, 8 and 16 new tokens, per weight format, side by side.

    .venv/bin/python benchmarks/scripts/forward_cost.py --formats none,w8a8,w4a8 --out RUN_FOLDER/forward-cost
    .venv/bin/python benchmarks/scripts/forward_cost.py --formats none@float32,w4a8@float32,w4a8 --out ...
    # FORMAT@DTYPE: that format in that dtype (bfloat16 when none is given)

Formats are loaded into one process and timed in interleaved rounds (one forward per format and
row count per round) after a 512-token prompt, so machine noise hits them alike; medians are
reported, with each row count's cost relative to one token of the same format.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.bench.machine import machine_description
from verispec.models.loading import load_model

ROWS = (1, 2, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--formats", default="none,w8a8,w4a8", help="FORMAT or FORMAT@DTYPE (default bfloat16), comma-separated")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-results/forward-cost"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    models = {}
    for name in args.formats.split(","):
        weight_format, _, dtype = name.partition("@")
        models[name] = load_model(args.target, dtype or "bfloat16", progress=True, quantize=weight_format)
    prompt = torch.arange(1000, 1000 + args.context)[None]  # (1, context)
    caches = {}
    for name, loaded in models.items():
        cache = loaded.model.new_cache(1, args.context + max(ROWS) + 1)
        loaded.model.forward(prompt, cache, last_only=True)
        cache.commit(args.context)
        caches[name] = cache
    seconds = {(f, n): [] for f in models for n in ROWS}
    for _ in tqdm(range(args.rounds + 2), desc="rounds"):  # two warm-up rounds, not kept
        for name, loaded in models.items():
            for n in ROWS:
                started = time.perf_counter()
                loaded.model.forward(torch.arange(7, 7 + n)[None], caches[name])
                seconds[(name, n)].append(time.perf_counter() - started)
    median = {key: statistics.median(values[2:]) for key, values in seconds.items()}

    machine = machine_description()
    lines = [
        f"# Target forward cost: {args.target}, {args.context} tokens of context, {args.threads} threads",
        "",
        f"Machine: {machine['cpu']} (family/model {machine['cpu_family_model']}; {', '.join(machine['cpu_features'])}), {machine['cores']} cores, torch {machine['torch']}. Median of {args.rounds} interleaved rounds.",
        "",
        "| format | " + " | ".join(f"{n} tok" for n in ROWS) + " | 8 tok / 1 tok |",
        "|---|" + "---|" * (len(ROWS) + 1),
    ]
    for name, loaded in models.items():
        ms = [1000 * median[(name, n)] for n in ROWS]
        label = loaded.format.label
        lines.append(f"| {label} | " + " | ".join(f"{m:.1f} ms" for m in ms) + f" | {ms[3] / ms[0]:.2f}x |")
    dense = list(models)[0]
    for fast in list(models)[1:]:
        lines += ["", f"{fast} over {dense}, same row count: " + ", ".join(
            f"{n}: {median[(dense, n)] / median[(fast, n)]:.2f}x" for n in ROWS)]
    lines += ["", "Load (read cache + quantize): " + ", ".join(
        f"{name} {m.format.load_seconds:.1f} s" for name, m in models.items())]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "README.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({
        "machine": machine, "target": args.target, "context": args.context, "rounds": args.rounds,
        "seconds": {f"{f}/{n}": v for (f, n), v in seconds.items()},
        "formats": {f: m.format.as_dict() for f, m in models.items()},
    }, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
