"""Mask time per token of the grammar engines that could constrain verispec's JSON output, on this CPU.

For each schema of benchmarks/workloads/json-schemas.json, a valid instance is tokenized with the target's
tokenizer and walked token by token: at every position the engine computes the next-token mask over the
whole vocabulary, then accepts the token. Reported: grammar compile time, and the mask's median and p95
microseconds per token. Engines that are not installed in this Python are listed as such, so the script can
be run once per environment (xgrammar pulls triton; it was measured from a separate venv).

    python benchmarks/scripts/grammar_mask.py --tokenizer DIR [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

SCHEMAS = Path(__file__).parents[1] / "workloads" / "json-schemas.json"
INSTANCES = {
    "customer": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "vip": True},
    "order": {
        "order_id": "A-1042", "status": "shipped",
        "items": [
            {"sku": "KB-17", "quantity": 2, "unit_price": 49.5}, {"sku": "MS-3", "quantity": 1, "unit_price": 19.99}
        ],
    },
    "ticket": {
        "category": "shipping", "priority": "high", "summary": "Parcel marked delivered but never arrived.",
        "tags": ["lost-parcel", "courier"], "needs_human": True,
    },
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def llguidance_engine(tokenizer, vocab_size):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def compile_schema(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        return lambda: llguidance.LLMatcher(ll_tokenizer, grammar)

    def mask(matcher):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(matcher, token):
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")

    return compile_schema, mask, accept


def xgrammar_engine(tokenizer, vocab_size):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile_schema(schema):
        compiled = compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
        return lambda: xgrammar.GrammarMatcher(compiled)

    def mask(matcher):
        matcher.fill_next_token_bitmask(bitmask)

    def accept(matcher, token):
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")

    return compile_schema, mask, accept


def outlines_core_engine(tokenizer, vocab_size):
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest for chr(256 + i).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}
    special = set(tokenizer.all_special_ids)
    tokens: dict[bytes, list[int]] = {}
    for text, token_id in tokenizer.get_vocab().items():
        if token_id in special or token_id == tokenizer.eos_token_id:
            continue
        raw = bytes(byte_of[c] for c in text) if all(c in byte_of for c in text) else text.encode()
        tokens.setdefault(raw, []).append(token_id)
    vocabulary = Vocabulary(tokenizer.eos_token_id, tokens)
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros(words, dtype=torch.int32)

    def compile_schema(schema):
        index = Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
        return lambda: Guide(index)

    def mask(guide):
        guide.write_mask_into(bitmask.data_ptr(), words, 4)

    def accept(guide, token):
        guide.advance(token)

    return compile_schema, mask, accept


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine, "outlines-core": outlines_core_engine}


def measure(engine, tokenizer, vocab_size, schemas, repeats):
    try:
        compile_schema, mask, accept = ENGINES[engine](tokenizer, vocab_size)
    except ImportError as error:
        return {"error": f"not installed here ({error})"}
    results = {}
    for name, schema in schemas.items():
        token_ids = tokenizer.encode(json.dumps(INSTANCES[name]), add_special_tokens=False)
        started = time.perf_counter()
        new_matcher = compile_schema(schema)
        new_matcher()  # llguidance compiles lazily, when its first matcher is made
        compile_ms = (time.perf_counter() - started) * 1e3
        timings = []
        for _ in range(repeats):
            matcher = new_matcher()
            for token in token_ids:
                started = time.perf_counter()
                mask(matcher)
                timings.append(time.perf_counter() - started)
                accept(matcher, token)
        timings.sort()
        results[name] = {
            "tokens": len(token_ids),
            "compile_ms": round(compile_ms, 2),
            "mask_us_median": round(statistics.median(timings) * 1e6, 1),
            "mask_us_p95": round(timings[int(0.95 * (len(timings) - 1))] * 1e6, 1),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a folder with the target's tokenizer")
    parser.add_argument("--vocab-size", type=int, default=151936, help="the model's logits width")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    schemas = json.loads(SCHEMAS.read_text())
    report = {"cpu": cpu_name(), "python": platform.python_version(), "engines": {}}
    for engine in args.engines.split(","):
        report["engines"][engine] = measure(engine, tokenizer, args.vocab_size, schemas, args.repeats)
        print(engine, json.dumps(report["engines"][engine]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
