"""A draft head over the target's most frequent tokens: a cheaper draft forward, the same output.

A draft model's output head projects onto the whole vocabulary: Qwen2.5's tied 151,936 x 896 head is about a
quarter of the 0.5B's weights, read at every draft position. Most of those tokens are almost never the next
one: a head restricted to the N most frequent tokens (Transformer.restrict_output_vocab) reads a fraction of
them, and its q is zero elsewhere, so verification stays exact (the target's distribution is untouched; a token
outside the subset is simply never drafted, which costs acceptance where the target wants it).

Frequencies come from text every Python install carries: the standard library's sources (code, comments,
docstrings) and its pydoc topics (English prose), read in a fixed order up to CORPUS_BYTES and counted with the
target's tokenizer, once per tokenizer (cached). Tokens never seen there follow by id (byte-level BPE ids run
roughly from frequent merges to rare ones), and the tokenizer's special tokens and the target's end-of-sequence
ids are always kept. `auto` chooses N by measurement: each candidate head, in the draft's format, timed as
whole one-row draft forwards side by side, weighed by how much of held-out corpus text its tokens cover
(COVERED_DEPTH draft positions in a row), kept only where that beats the full head by MIN_GAIN, and remembered
per machine and draft. The corpus is code-heavy, so a restricted head covers code better than chat answers
(benchmarks/results/xeon/draft-vocab). A smaller head saves only the head's share of the draft forward, which is
small once the draft is quantized (w4a8), while every token it leaves out costs acceptance: so the default stays
the full head, and `auto` keeps a smaller one only where it measures a gain.
"""

from __future__ import annotations

import copy
import hashlib
import os
import sysconfig
from pathlib import Path

import torch

from verispec.models import w4a8
from verispec.models.forward_cost import forward_costs
from verispec.models.loading import LoadedModel, SafetensorsWeights
from verispec.models.machine import cache_root, remembered_choice, weights_identity
from verispec.models.transformer import Transformer

CANDIDATE_SIZES = (8192, 16384, 32768)  # auto times these beside the full head
CORPUS_BYTES = 6_000_000  # of standard library text, tokenized once per tokenizer
PIECE = 4096  # characters: the corpus is split into pieces of this size, alternately counted and held out
COVERED_DEPTH = 4  # auto weighs a head's cost by its coverage to this power: a chain of this many drafts
MIN_GAIN = 0.10  # auto keeps the full head unless a smaller one's weighed cost is this much lower


def parse_vocab(value: str) -> str | int:
    """`--draft-vocab`: "full", "auto" or a number of tokens (at least 256)."""
    if value in ("full", "auto"):
        return value
    try:
        size = int(value)
    except ValueError:
        raise ValueError(f"--draft-vocab {value}: give full, auto or a number of tokens such as 16384") from None
    if size < 256:
        raise ValueError(f"--draft-vocab {value}: keep at least 256 tokens (every byte), or say full")
    return size


DRAFT_VOCAB_HELP = (
    "the draft model's output head (lossless: only acceptance changes): full, N (the N most frequent tokens) or auto "
    "(a head size timed here, weighed by how much text it covers)"
)


def argparse_vocab(value: str) -> str | int:
    """parse_vocab for argparse: a bad value is a usage error that says why."""
    import argparse

    try:
        return parse_vocab(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix(f"--draft-vocab {value}: ")) from None


def corpus_files() -> list[Path]:
    """The standard library's pydoc topics, then its sources outside tests, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    topics = stdlib / "pydoc_data" / "topics.py"
    skipped = {"test", "tests", "idle_test", "site-packages"}
    sources = sorted(p for p in stdlib.rglob("*.py") if not skipped & set(p.parts) and p != topics)
    return ([topics] if topics.exists() else []) + sources


def token_counts(tokenizer, max_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts over even-numbered pieces of corpus text, counts over odd ones), each (vocabulary,), from the first
    max_bytes (default CORPUS_BYTES) of corpus text: cached per tokenizer."""
    max_bytes = max_bytes or CORPUS_BYTES
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(repr(sorted(vocab.items())).encode()).hexdigest()[:16]
    path = cache_root() / "token-counts" / f"{digest}-{max_bytes}.pt"
    if path.exists():
        return tuple(torch.load(path))
    size = max(vocab.values()) + 1
    halves = [torch.zeros(size, dtype=torch.long), torch.zeros(size, dtype=torch.long)]
    texts, read = [], 0  # pieces of PIECE characters: even ones count into the first half, odd into the second
    for file in corpus_files():
        text = file.read_text(errors="ignore")[: max_bytes - read]
        texts += [text[start : start + PIECE] for start in range(0, len(text), PIECE)]
        read += len(text)
        if read >= max_bytes:
            break
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer: encode every file at once, quietly
    if backend is not None:
        encoded = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        encoded = [tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] for text in texts]
    for index, ids in enumerate(encoded):
        halves[index % 2] += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=size)[:size]
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")  # another process may count the same tokenizer meanwhile
    torch.save(halves, scratch)
    scratch.replace(path)  # atomic: a reader sees no file or a whole one
    return halves[0], halves[1]


def ranked_ids(counts: torch.Tensor) -> torch.Tensor:
    """Token ids, most counted first; ids never counted after them, in id order."""
    return torch.argsort(-counts * (counts.numel() + 1) + torch.arange(counts.numel()))  # count desc, id asc


def kept_ids(counts: torch.Tensor, size: int, always: list[int], vocab_size: int) -> torch.Tensor:
    """The `size` most frequent ids below vocab_size, plus `always` (special and end ids), sorted: (N,)."""
    ranked = ranked_ids(counts)
    ranked = ranked[ranked < vocab_size]
    keep = set(ranked[:size].tolist()) | {i for i in always if 0 <= i < vocab_size}
    return torch.tensor(sorted(keep), dtype=torch.long)


def coverage(train: torch.Tensor, held_out: torch.Tensor, size: int, always: list[int]) -> float:
    """The share of held-out corpus tokens that a head of the `size` ids most frequent in `train` can draft."""
    ids = kept_ids(train, size, always, train.numel())
    return float(held_out[ids].sum()) / max(1, int(held_out.sum()))


def dense_head(model: Transformer, directory: Path) -> torch.Tensor:
    """(V, C) the dense rows of a model's output head: its embedding where they are tied, else read again."""
    return model.embed if model.tied_head else SafetensorsWeights(directory).pop("lm_head.weight")


def restricted(model: Transformer, ids: torch.Tensor, head: torch.Tensor) -> Transformer:
    """A copy of `model` (sharing its layers) whose head covers `ids` only, in the model's format; head: dense_head."""
    trimmed = copy.copy(model)
    trimmed.restrict_output_vocab(ids, head[ids])
    return trimmed


def always_kept(tokenizer, eos_token_ids) -> list[int]:
    """Ids every restricted head keeps: the tokenizer's special tokens and the target's end-of-sequence ids."""
    return sorted(set(tokenizer.all_special_ids) | set(eos_token_ids))


def trim_head(draft: LoadedModel, target: LoadedModel, requested: str | int = "auto") -> dict:
    """Restrict `draft`'s head (already in its format) as `requested`: "full" keeps it, N keeps the N most frequent
    tokens, "auto" times heads of CANDIDATE_SIZES beside the full one (remembered per machine, draft and format).
    Returns {"size": N or None, "coverage": {N: held-out share}, "seconds": {head: one-row forward}}."""
    if requested == "full":
        return {"size": None}
    model = draft.model
    always = always_kept(target.tokenizer, target.eos_token_ids)
    train, held_out = token_counts(target.tokenizer)
    counts = train + held_out

    def ids_of(size: int) -> torch.Tensor:
        return kept_ids(counts, size, always, target.model.vocab_size)

    if requested == "auto":
        def measure() -> dict:
            shares = {size: coverage(train, held_out, size, always) for size in CANDIDATE_SIZES}
            head = dense_head(model, draft.directory)
            heads = {str(size): restricted(model, ids_of(size), head) for size in shares}
            seconds = {name: costs[1] for name, costs in forward_costs({"full": model} | heads, rows=(1,)).items()}
            weighed = {"full": seconds["full"]} | {
                str(size): seconds[str(size)] / shares[size] ** COVERED_DEPTH for size in shares
            }
            best = min(weighed, key=weighed.get)
            if weighed[best] > (1 - MIN_GAIN) * weighed["full"]:  # too little to pay for the tokens it cannot draft
                best = "full"
            return {"size": None if best == "full" else int(best), "coverage": {str(s): c for s, c in shares.items()},
                    "seconds": seconds}

        kind = (f"draft head among {','.join(map(str, CANDIDATE_SIZES))},full"
                f" | weights {weights_identity(draft.directory)} | {model.weight_format}-{model.activations}"
                f" {str(model.dtype).removeprefix('torch.')} | kernels {w4a8.build_digest()}")
        chosen = remembered_choice(kind, measure)
    else:
        size = int(requested)
        chosen = {"size": size, "coverage": {str(size): coverage(train, held_out, size, always)}}
    if chosen["size"] is not None:
        ids = ids_of(chosen["size"])
        model.restrict_output_vocab(ids, dense_head(model, draft.directory)[ids])
    return chosen
