"""Where a one-row draft forward's time goes: each part of every layer, the output head, and the rest (Python).

    .venv/bin/python benchmarks/scripts/draft_cost.py --model qwen2.5-coder-0.5b-instruct --format w4a8 \\
        --out benchmarks/results/MACHINE/draft-cost

The model is loaded in one format; after --context tokens of prompt, interleaved rounds time (a) the whole
one-token forward and (b) each of its parts alone, on the very tensors of that forward: the norms, the four
matmuls of every layer, the q/k positioning, writing the new key and value and attending, the MLP's gate, the
final norm and the output head. What (a) costs beyond the sum of (b) is the glue between the parts (Python,
views, dispatch). Beside it: the bytes one forward reads (weights as stored, the keys and values it attends
over) and this machine's measured memory bandwidth, so the time a forward would take if it only read memory.
Medians over the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.bench.machine import git_commit, machine_description, machine_line
from verispec.models.attention import attention_per_row
from verispec.models.loading import load_model
from verispec.models.transformer import ACTIVATIONS, rms_norm

PARTS = ("norms", "qkv", "position q/k", "cache write + attention", "out", "gate_up", "gate activation", "down")


def linear_bytes(linear) -> int:
    """Bytes a one-row pass of `linear` reads: its weights as the format stores them, and their scales."""
    if linear.packed is not None:
        return linear.packed.numel() * linear.packed.element_size()
    if linear.format == "w8a8":
        return linear.out_features * linear.in_features + 4 * linear.out_features
    weight = linear.weight
    scales = 0 if linear.scales is None else linear.scales.numel() * linear.scales.element_size()
    return weight.numel() * weight.element_size() + scales


def bandwidth(gib: float = 1.0, rounds: int = 5) -> dict[str, float]:
    """GB/s of reading (a float32 sum) and of copying (read + write) `gib` GiB, medians."""
    numbers = int(gib * 2**30) // 4
    source, target = torch.ones(numbers), torch.empty(numbers)
    read, copy = [], []
    for _ in range(rounds + 1):
        started = time.perf_counter()
        source.sum()
        read.append(time.perf_counter() - started)
        started = time.perf_counter()
        target.copy_(source)
        copy.append(time.perf_counter() - started)
    size = numbers * 4 / 1e9
    return {"read_gb_s": size / statistics.median(read[1:]), "copy_gb_s": 2 * size / statistics.median(copy[1:])}


def timed(function, times: list[float]) -> None:
    started = time.perf_counter()
    function()
    times.append(time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--format", default="w4a8", help="the model's weight format (--quantize)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=128, help="tokens already in the cache")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--target", default="qwen2.5-coder-1.5b-instruct", help="whose one-token forward to compare with"
    )
    parser.add_argument("--target-format", default="w4a8")
    parser.add_argument("--out", type=Path, default=Path("bench-results/draft-cost"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(args.model, args.dtype, progress=True, quantize=args.format)
    target = load_model(args.target, args.dtype, progress=True, quantize=args.target_format).model
    model, config = loaded.model, loaded.model.config
    eps, activation = config.rms_norm_eps, ACTIVATIONS[config.hidden_act]
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    prompt = torch.arange(1000, 1000 + args.context)[None]  # (1, context)
    cache, target_cache = model.new_cache(1, args.context + 2), target.new_cache(1, args.context + 2)
    for m, c in ((model, cache), (target, target_cache)):
        m.forward(prompt, c, last_only=True)
        c.commit(args.context)
    token = torch.tensor([[7]])  # (1, 1)

    # The hidden states each part sees in a real forward, captured once.
    x = model._embed(token)  # (1, 1, C)
    rotary = model._rope(cache.plan_write(1), None)
    inputs = []
    for layer in model.layers:
        normed = rms_norm(x, layer.attn_norm, eps)
        qkv = layer.qkv(normed)  # (1, 1, (H + 2 Hkv) D)
        heads_qk = qkv.narrow(-1, 0, q_size + kv_size).view(1, 1, heads + kv_heads, head_dim)  # (1, 1, H + Hkv, D)
        qk = model._position_qk(layer, heads_qk, rotary)
        attended = torch.randn(1, 1, q_size).to(model.dtype)
        x = x + layer.out(attended)
        gate_up = layer.gate_up(rms_norm(x, layer.mlp_norm, eps))
        gate, up = gate_up.chunk(2, dim=-1)
        inputs.append((x, normed, qkv, qk, attended, gate_up, activation(gate) * up))
        x = x + layer.down(activation(gate) * up)

    def attend(index: int, qk: torch.Tensor, qkv: torch.Tensor) -> None:
        plan = cache.plan_write(1)
        q = qk.narrow(2, 0, heads).transpose(1, 2)  # (1, H, 1, D)
        k = qk.narrow(2, heads, kv_heads).transpose(1, 2)  # (1, Hkv, 1, D)
        v = qkv.narrow(-1, q_size + kv_size, kv_size).view(1, 1, kv_heads, head_dim).transpose(1, 2)
        keys, values = cache.write(index, k, v, plan)
        attention_per_row(q, keys, values, [[args.context + 1]])

    part_calls = {
        "norms": lambda i, layer, s: (rms_norm(s[0], layer.attn_norm, eps), rms_norm(s[0], layer.mlp_norm, eps)),
        "qkv": lambda i, layer, s: layer.qkv(s[1]),
        "position q/k": lambda i, layer, s: model._position_qk(
            layer, s[2].narrow(-1, 0, q_size + kv_size).view(1, 1, heads + kv_heads, head_dim), rotary),
        "cache write + attention": lambda i, layer, s: attend(i, s[3], s[2]),
        "out": lambda i, layer, s: layer.out(s[4]),
        "gate_up": lambda i, layer, s: layer.gate_up(s[1]),
        "gate activation": lambda i, layer, s: activation(s[5].chunk(2, dim=-1)[0]).mul_(s[5].chunk(2, dim=-1)[1]),
        "down": lambda i, layer, s: layer.down(s[6]),
    }
    seconds = {name: [] for name in ("whole", "target whole", "embedding", "final norm", "head", *PARTS)}
    per_layer = {name: [[] for _ in model.layers] for name in PARTS}
    final_x = x
    with torch.inference_mode():
        for _ in tqdm(range(args.rounds + 3), desc="rounds"):  # three warm-up rounds, not kept
            timed(lambda: model.forward(token, cache), seconds["whole"])
            timed(lambda: target.forward(token, target_cache), seconds["target whole"])
            timed(lambda: model._embed(token), seconds["embedding"])
            timed(lambda: rms_norm(final_x, model.final_norm, eps), seconds["final norm"])
            normed_final = rms_norm(final_x, model.final_norm, eps)
            timed(lambda: model.lm_head(normed_final).float(), seconds["head"])
            for name, call in part_calls.items():
                total = 0.0
                for index, (layer, saved) in enumerate(zip(model.layers, inputs)):
                    started = time.perf_counter()
                    call(index, layer, saved)
                    spent = time.perf_counter() - started
                    per_layer[name][index].append(spent)
                    total += spent
                seconds[name].append(total)
    median = {name: statistics.median(values[3:]) for name, values in seconds.items()}
    layer_medians = [sum(statistics.median(per_layer[name][i][3:]) for name in PARTS) for i in range(len(model.layers))]
    parts_sum = sum(median[name] for name in ("embedding", "final norm", "head", *PARTS))
    linears = [linear for layer in model.layers for linear in layer.linears]
    weight_bytes = sum(linear_bytes(linear) for linear in linears)
    head_bytes = linear_bytes(model.lm_head)
    kv_bytes = config.num_layers * 2 * kv_size * (args.context + 1) * torch.finfo(model.dtype).bits // 8
    measured = bandwidth()
    total_bytes = weight_bytes + head_bytes + kv_bytes
    result = {
        "commit": git_commit(), "date": datetime.date.today().isoformat(), "machine": machine_line(),
        "machine_details": machine_description(),
        "command": "benchmarks/scripts/draft_cost.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "model": args.model, "format": loaded.format.label if loaded.format else args.format, "context": args.context,
        "ms": {name: round(value * 1e3, 3) for name, value in median.items()},
        "glue_ms": round((median["whole"] - parts_sum) * 1e3, 3),
        "per_layer_ms": [round(value * 1e3, 3) for value in layer_medians],
        "bytes": {"layers": weight_bytes, "head": head_bytes, "kv_cache": kv_bytes, "total": total_bytes},
        "bandwidth_gb_s": {k: round(v, 2) for k, v in measured.items()},
        "memory_bound_ms": round(total_bytes / (measured["read_gb_s"] * 1e9) * 1e3, 3),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run.json").write_text(json.dumps(result, indent=2) + "\n")
    whole = median["whole"]
    print(f"{args.model} ({result['format']}), one token after {args.context}: {whole * 1e3:.2f} ms "
          f"= {whole / median['target whole']:.2f} of {args.target}'s ({median['target whole'] * 1e3:.2f} ms)")
    for name in ("embedding", *PARTS, "final norm", "head"):
        print(f"  {name:24s} {median[name] * 1e3:7.3f} ms  {median[name] / whole:6.1%}")
    print(f"  {'glue (whole - parts)':24s} {(whole - parts_sum) * 1e3:7.3f} ms  {(whole - parts_sum) / whole:6.1%}")
    print(f"reads {total_bytes / 1e6:.1f} MB (layers {weight_bytes / 1e6:.1f}, head {head_bytes / 1e6:.1f}, "
          f"keys/values {kv_bytes / 1e6:.1f}); read bandwidth {measured['read_gb_s']:.1f} GB/s -> "
          f"{result['memory_bound_ms']:.2f} ms if only memory counted")


if __name__ == "__main__":
    main()
