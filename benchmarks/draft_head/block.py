"""Does a block drafter (DFlash's form) beat the head's chain on this CPU? (issue 48, "measure first")

The head's chain drafts k positions in k forwards of its layer, each fed its own previous draft. On these CPUs
the layer is memory-bound: over k rows at once it costs about what one row costs (benchmarks/results/zen4/
head-vocab, section 4). A block drafter drafts all k positions in one forward, fed no draft of its own:

- row 0 is the head's own first position: (f_t, x_{t+1}) at position t, the head's step as it drafts now;
- rows d = 1..k-1 are a learned input per depth (`masks`, the layer's input in place of fc's output; --row-input carry:
  added to row 0's input) at rotary position t + d, scored against x_{t+2+d};
- each row attends to the head's keys over the true positions up to t (causal, as the chain's first position) and
  to the block's rows before it (causal inside the block, so row 0 stays the chain's first position exactly).

It shares the head's layer and output rows, so a head file plus k-1 vectors drafts a block. It starts from a head
file (`--init`, the shipped head by default) and trains on study.py's rows (the target's own answers and text; none
of the measured prompts): row 0 keeps study.py's loss (smooth-L1 on f_{t+1} + ce-weight x cross-entropy), each
block row adds cross-entropy on the target's argmax at t+1+d, weighted by --block-weight; --anchors block starts
a window, drawn at random each step, keep the block rows' share of the work small.

`evaluate` drafts as an engine would: the true features up to the verified position t, then one block; the same
weights' greedy chain beside it, and the starting head's chain. Acceptance is counted at step starts (the engine's
count, study.ChainTally); the cost of k rows in one forward (study.head_cost) and the target's verify forwards are
timed side by side, and each k's speed-up over plain predicted as study.py vocab predicts it. --rows train measures
the same on answers it trained on (the first --limit of train-humaneval, train-chat and train-code-edit).

    python benchmarks/draft_head/block.py train --work ~/.cache/verispec/head-work --minutes 40
    python benchmarks/draft_head/block.py evaluate --work ~/.cache/verispec/head-work --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study import (  # noqa: E402
    TARGET, ChainTally, chains, file_head, head_cost, head_rows, load_rows, log, padded_batch, predicted_speedups,
    scheduled_lr, training_pairs, training_sets, verify_forwards_ms,
)

from verispec.drafters.draft_head import SHIPPED_HEADS, DraftHead, rms  # noqa: E402


ROW_INPUTS = ("mask", "carry")  # a block row's input: its depth's vector alone, or added to row 0's input


class BlockDrafter(torch.nn.Module):
    """A head (DraftHead) and the layer's input at block rows 1..depth-1: `masks` (depth-1, C) alone (row_input="mask"),
    or each added to row 0's input, fc(f_t, x_{t+1}) (row_input="carry": every row reads the verified state
    directly)."""

    def __init__(self, head: DraftHead, depth: int, row_input: str = "mask") -> None:
        super().__init__()
        if row_input not in ROW_INPUTS:
            raise ValueError(f"row_input must be one of {ROW_INPUTS}, not {row_input!r}")
        self.head, self.depth, self.row_input = head, depth, row_input
        self.masks = torch.nn.Parameter(torch.zeros(depth - 1, head.embed.shape[1]))

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor, anchors: torch.Tensor) -> list[torch.Tensor]:
        """features (B, T, C) normalized f_0..f_{T-1}, next_ids (B, T) x_1..x_T, anchors (A,) block starts t ->
        the predicted normalized features: [(B, T, C) row 0 at every t (the chain's first position), then (B, A, C)
        for each block row d = 1..depth-1 at the anchors]. Row d drafts x_{t+2+d}."""
        head = self.head
        B, T, _ = features.shape
        x = head.layer_input(features, next_ids)  # (B, T, C)
        q, k, v = head.project(x, torch.arange(T))  # (B, H, T, D)
        out = [head.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))]
        v = v.float()
        seen = torch.arange(T)[None, :] <= anchors[:, None]  # (A, T): the true keys each block sees
        scale = head.head_dim**-0.5
        block_k, block_v = [], []
        for d in range(1, self.depth):
            xd = self.masks[d - 1].to(x.dtype).expand(B, len(anchors), -1)  # (B, A, C)
            if self.row_input == "carry":
                xd = xd + x[:, anchors]
            qd, kd, vd = head.project(xd, anchors + d)  # (B, H, A, D) each
            block_k.append(kd)
            block_v.append(vd.float())
            scores = (qd @ k.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))  # (B, H, A, T)
            own = torch.stack([(qd * ki).sum(-1) for ki in block_k], -1) * scale  # (B, H, A, d): rows 1..d
            weights = torch.cat([scores, own], -1).softmax(-1)
            attended = weights[..., :T] @ v + sum(weights[..., T + i, None] * vi for i, vi in enumerate(block_v))
            # (the block's row 0 is the true key at t itself: `seen` holds it)
            out.append(head.finish(xd, attended))
        return out


def drafter_from(path: Path, dense, depth: int, row_input: str = "mask") -> tuple[BlockDrafter, dict]:
    """A block drafter: from a block.py checkpoint (.pt: its own depth and row input), or a head file's weights with
    its masks at zero."""
    if path.suffix == ".pt":
        saved = torch.load(path)
        drafter = BlockDrafter(file_head(dense, Path(saved["init"])), saved["depth"], saved.get("row_input", "mask"))
        drafter.load_state_dict(saved["state"])
        return drafter.eval(), saved
    return BlockDrafter(file_head(dense, path), depth, row_input).eval(), {"init": str(path)}


@torch.no_grad()
def block_drafts(drafter: BlockDrafter, row: dict) -> torch.Tensor:
    """For every answer position t (as study.unroll): the block drafted after the target chose x_{t+1}, seeing
    the true features up to t: (N, depth) target ids."""
    head = drafter.head
    f = rms(row["features"].float())  # (T, C)
    ids = row["ids"]
    T = len(ids)
    anchors = torch.arange(row["answer_start"] - 1, T - 1)  # (N,)
    predicted = drafter(f[None, : T - 1], ids[None, 1:T], anchors)
    rows = [predicted[0][0, anchors]] + [p[0] for p in predicted[1:]]  # each (N, C)
    return torch.stack([head.vocab[head.logits(p).argmax(-1)] for p in rows], 1)


def cmd_train(args) -> None:
    from verispec.models.loading import load_model

    work = Path(args.work)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dense = load_model(TARGET)
    drafter, _ = drafter_from(Path(args.init), dense, args.depth, args.row_input)
    head = drafter.head
    vocab = head.vocab
    index = head_rows(vocab, dense.model.vocab_size)
    names = training_sets(work)
    pairs = training_pairs(load_rows(work, names))
    tokens = sum(len(p[1]) for p in pairs)
    log(f"{names}: {len(pairs)} windows, {tokens} positions; block of {args.depth}, {args.anchors} anchors a window")
    with torch.no_grad():  # the block rows start from the layer's mean input over some windows (carry: added to it,
        # else a block row starts as row 0 at a later position, and its loss pulls row 0 down: 0.98 -> 0.44 top-1 in
        # 40 steps from zero)
        f, nxt, _, labels = padded_batch(pairs[:16])
        drafter.masks.copy_(head.layer_input(f, nxt)[labels >= 0].mean(0).expand_as(drafter.masks))
    groups = [{"params": [p for n, p in drafter.named_parameters() if n != "masks"], "lr": args.lr},
              {"params": [drafter.masks], "lr": args.mask_lr}]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    budget = args.minutes * 60
    started = time.perf_counter()
    step = seen = epoch = 0
    history, order = [], list(range(len(pairs)))
    while time.perf_counter() - started < budget:
        random.Random(epoch).shuffle(order)
        for start in range(0, len(order), args.batch):
            if time.perf_counter() - started >= budget:
                break
            f, nxt, f_next, labels = padded_batch([pairs[i] for i in order[start : start + args.batch]])
            B, T = labels.shape
            anchors = torch.randperm(T)[: args.anchors].sort().values  # (A,)
            fraction = min((time.perf_counter() - started) / budget, 1.0)
            for group, base in zip(optimizer.param_groups, (args.lr, args.mask_lr)):
                group["lr"] = scheduled_lr(base, step, fraction)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                predicted = drafter(f, nxt, anchors)
            real = labels >= 0  # (B, T)
            per_position = F.smooth_l1_loss(predicted[0].float(), f_next, beta=0.1, reduction="none").mean(-1)
            loss = (per_position * real).sum() / real.sum()
            hits = []
            for d, p in enumerate(predicted):
                at = torch.arange(T) if d == 0 else anchors + d  # the label row: the target's argmax at t+1+d
                shown = torch.full((B, len(at)), -1, dtype=torch.long)
                inside = at < T
                shown[:, inside] = labels[:, at[inside]]
                classes = torch.where(shown >= 0, index[shown.clamp(min=0)], -100)
                logits = head.logits(p)
                ce = F.cross_entropy(logits.float().flatten(0, 1), classes.flatten(), ignore_index=-100)
                loss = loss + (args.ce_weight if d == 0 else args.block_weight) * ce
                with torch.no_grad():
                    counted = classes >= 0
                    hits.append((int((logits.argmax(-1) == classes)[counted].sum()), int(counted.sum())))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            step += 1
            seen += int(real.sum())
            history.append(hits)
            if step % 20 == 0:
                recent = history[-20:]
                top1 = [sum(h[d][0] for h in recent) / max(1, sum(h[d][1] for h in recent)) for d in range(args.depth)]
                log(f"epoch {epoch} step {step}: top-1 by row {[round(t, 3) for t in top1]} "
                    f"({seen / (time.perf_counter() - started):.0f} positions/s)")
        epoch += 1
    last = history[-50:]
    top1 = [sum(h[d][0] for h in last) / max(1, sum(h[d][1] for h in last)) for d in range(args.depth)]
    torch.save({"state": drafter.state_dict(), "init": args.init, "depth": args.depth, "row_input": args.row_input,
                "steps": step, "positions": seen, "epochs": epoch, "passes": seen / tokens, "minutes": args.minutes,
                "train_positions": tokens, "sets": names, "lr": args.lr, "mask_lr": args.mask_lr,
                "batch": args.batch, "anchors": args.anchors, "ce_weight": args.ce_weight,
                "block_weight": args.block_weight, "threads": args.threads, "last_50_steps_top1_by_row": top1},
               work / f"{args.tag}.pt")
    log(f"saved {args.tag}.pt after {step} steps, {seen} positions ({seen / tokens:.2f} passes)")


def cmd_evaluate(args) -> None:
    from verispec.bench.machine import machine_description
    from verispec.models.loading import load_model

    work = Path(args.work)
    torch.set_num_threads(args.threads)
    dense = load_model(TARGET)
    drafter, saved = drafter_from(work / f"{args.tag}.pt", dense, args.depth)
    depth = drafter.depth
    start_head = file_head(dense, Path(saved["init"]))
    target = load_model(TARGET, quantize="auto").model
    verify_ms = verify_forwards_ms(target, depth)
    block_ms = [head_cost(drafter.head, target, rows=k)["head_ms"] for k in range(1, depth + 1)]
    chain_ms = head_cost(drafter.head, target)["head_ms"]  # one position; a chain of k pays k
    results = {"training": {k: v for k, v in saved.items() if k != "state"}, "rows": args.rows,
               "verify_ms": verify_ms,
               "block_ms_by_rows": block_ms, "chain_position_ms": chain_ms, "workloads": {}}
    drafters = {"block": lambda row: block_drafts(drafter, row),
                "chain, same weights": lambda row: chains(drafter.head, row, depth),
                "chain, starting head": lambda row: chains(start_head, row, depth)}
    for name in ("humaneval", "chat", "code-edit"):
        rows = torch.load(work / f"{args.rows}-{name}.pt")[: args.limit]
        measured = {}
        for form, draft in drafters.items():
            tally = ChainTally(depth)
            for row in rows:
                tally.add(row["ids"][row["answer_start"] :], draft(row))
            per_forward = list(tally.tokens_per_forward().values())  # k = 1..depth
            cost = block_ms if form == "block" else [k * chain_ms for k in range(1, depth + 1)]
            measured[form] = {
                f"alpha_at_steps_k{depth}": tally.alpha_at_steps(), "alpha_by_position": tally.alpha_by_position(),
                "tokens_per_forward": per_forward,
                "speedup_by_k": predicted_speedups(per_forward, verify_ms, cost),
            }
            log(f"{name} {form}: at step starts {[round(a, 3) for a in tally.alpha_at_steps()]}, tokens/forward "
                f"{[round(t, 2) for t in per_forward]}, best x{max(measured[form]['speedup_by_k']):.3f}")
        results["workloads"][name] = measured
    results["machine"] = machine_description()
    results["command"] = " ".join(sys.argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train")
    train.add_argument("--init", default=str(SHIPPED_HEADS / f"{TARGET}.safetensors"), help="a last-layer head file")
    train.add_argument("--depth", type=int, default=4, help="rows in a block: the chain of k it replaces")
    train.add_argument("--row-input", choices=ROW_INPUTS, default="mask", help="a block row's input (BlockDrafter)")
    train.add_argument("--minutes", type=float, default=40)
    train.add_argument("--batch", type=int, default=8)
    train.add_argument("--anchors", type=int, default=64, help="blocks trained per window and step")
    train.add_argument("--lr", type=float, default=1e-4, help="the head's layer (it starts trained)")
    train.add_argument("--mask-lr", type=float, default=1e-3, help="the block rows' inputs")
    train.add_argument("--ce-weight", type=float, default=0.1, help="row 0's cross-entropy, as study.py trains")
    train.add_argument("--block-weight", type=float, default=0.3, help="each block row's cross-entropy")
    evaluate = commands.add_parser("evaluate")
    evaluate.add_argument("--out", required=True)
    evaluate.add_argument("--depth", type=int, default=4, help="for a head file given as --tag's checkpoint")
    evaluate.add_argument("--rows", choices=("eval", "train"), default="eval",
                          help="the measured prompts' answers, or the training prompts' (how far it generalizes)")
    evaluate.add_argument("--limit", type=int, default=16, help="answers a workload")
    for command in (train, evaluate):
        command.add_argument("--work", required=True)
        command.add_argument("--tag", default="block")
        command.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    {"train": cmd_train, "evaluate": cmd_evaluate}[args.command](args)


if __name__ == "__main__":
    main()
