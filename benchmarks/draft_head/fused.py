"""Does EAGLE-3's recipe beat the shipped head's at equal training time on these CPUs? (issue 48, "measure first")

The question: issue 48 wants a draft head accepted at its first position >= 0.8 on code and >= 0.7 on chat, for
<= 0.15 of a target forward per step's whole draft. The shipped head (study.py's recipe: EAGLE-1's shape over the
target's last pre-norm hidden state, smooth-L1 on f_{t+1} + 0.1 x cross-entropy, no training-time test) reaches
0.65 / 0.48 / 0.67 (humaneval / chat / code-edit) at 0.033 of a forward a position. Arms, all with the same decoder
layer (HeadMath: fc over [feature, embedding of x_{t+1}] -> one layer -> the target's final norm and output head
over the same 32768 ids), trained for the same wall time at one thread, side by side:

- **baseline**: study.py's recipe (cmd_train's loop, batches, schedule) on the last-layer features;
- **fused-ttt** (EAGLE-3): feature = rms(fc3([rms(low), rms(mid), rms(high)])), fc3 one (3C -> C) linear over the
  target's hidden states after LAYERS = (2, 14, 25) of its 28 layers (the inputs of 0-indexed layers 2, L//2, L-3,
  where EAGLE-3's reference code and sglang/vLLM tap them); cross-entropy only, on the target's argmax; training-time
  test of depth 3 (--ttt): step j > 0 at position t reads (the head's own output at step j-1 for t, embedding of the
  true x_{t+1+j}) at rotary position t+j and attends to step 0's keys causally up to t plus steps 1..j's keys at the
  same t only (EAGLE-3/HASS's mask: step 0 as causal attention, the chain part as per-position dot products);
  the loss at step j is on the target's argmax at t+1+j;
- ablations (--arm): **fused** (fused features, CE, no TTT) and **last-ttt** (last-layer feature, CE, TTT);
- **warm-fused-ttt**: fused-ttt's recipe over the states after layers 2, 14 and 28 (the last: the feature a
  last-layer head reads), started (`train --init HEAD_FILE`) from a trained last-layer head such as the shipped
  one: fuse passes the last layer on and the others' columns start at zero, so it starts drafting exactly as that
  head drafts, and training-time test goes on from there. It reads study.py collect's rows directly (--work a
  head-work collected with --early-layers 2 14); no tap needed.

Drafting (evaluate) is as the head would draft: the target's true features up to the verified position t, then
the head's own output and its own greedy draft fed back, depth 6; alpha by position and tokens per forward at
k = 1..6 as study.py's position_acceptance / greedy_steps; cost as study.py's head_cost (one row, the served
format), with fc3 (once per verified target position) timed apart.

Data: the rows of study.py's head-work (/root/.cache/verispec/head-work: train-* and eval-*), the SAME ids
teacher-forced again through the target in its served format (load_model quantize="auto", 256-token windows as
FeatureTap), keeping the three layers' states; `tap` checks on the first rows that a full forward reproduces the
stored last features and argmax.

    python benchmarks/draft_head/fused.py tap --work /root/.cache/verispec/fused-work [--text-positions N]
    python benchmarks/draft_head/fused.py train --work /root/.cache/verispec/fused-work --arm baseline --minutes 30 &
    python benchmarks/draft_head/fused.py train --work /root/.cache/verispec/fused-work --arm fused-ttt --minutes 30
    python benchmarks/draft_head/fused.py evaluate --work /root/.cache/verispec/fused-work --arm ARM --out DIR
    python benchmarks/draft_head/fused.py cost --work /root/.cache/verispec/fused-work --tag fused-ttt --out DIR

Everything runs at --threads 1 (default). Checkpoints stay in --work (ARM.pt, or TAG.pt). Warm-started, then
written as a head file (`export --ship` makes it the one verispec ships, as study.py export --ship does):

    python benchmarks/draft_head/study.py collect --work $W --early-layers 2 14 [--more]
    python benchmarks/draft_head/fused.py train --work $W --arm warm-fused-ttt --tag warm \
        --init verispec/data/heads/qwen2.5-coder-1.5b-instruct.safetensors --minutes 35 --lr 1e-4 --threads 2
    python benchmarks/draft_head/fused.py evaluate --work $W --arm warm-fused-ttt --tag warm --out DIR
    python benchmarks/draft_head/fused.py evaluate --work $W --arm warm-fused-ttt --head HEAD_FILE --out DIR
    python benchmarks/draft_head/fused.py export --work $W --tag warm [--out FILE | --ship]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study import (  # noqa: E402
    TARGET, WINDOW, ChainTally, FeatureTap, build_head, head_cost, head_file_training, head_rows, head_vocab, log,
    padded_batch, scheduled_lr, time_forward, training_pairs, training_sets, write_head,
)

from verispec.drafters.draft_head import HEAD_WEIGHTS, DraftHead, loaded_tensors, rms  # noqa: E402

HEAD_WORK = Path("/root/.cache/verispec/head-work")
LAYERS = (2, 14, 25)  # hidden states after this many of the target's 28 layers: low, mid, high
SETS = ["eval-humaneval", "eval-chat", "eval-code-edit", "train-humaneval", "train-code-edit", "train-chat",
        "train-chat-self", "train-text"]  # tapped in this order (train-text last: the one cut if time is short)
NUM_LAYERS = 28
WARM_LAYERS = (2, 14, NUM_LAYERS)  # a fused head that can start as a last-layer head (fuse passes `high` on)
ARMS = {  # arm -> (the layers it fuses, or () for the last layer's state; training-time test depth; loss)
    "baseline": ((), 1, "study"), "fused-ttt": (LAYERS, 3, "ce"), "fused": (LAYERS, 1, "ce"),
    "last-ttt": ((), 3, "ce"), "warm-fused-ttt": (WARM_LAYERS, 3, "ce"),
}


# ---------------------------------------------------------------- tap: the target's low, middle and high states


def cmd_tap(args) -> None:
    from verispec.models.loading import load_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    loaded = load_model(TARGET, quantize="auto")  # as study.py's cmd_collect
    log(f"target {TARGET} as {loaded.format.label}, keeping the states after layers {LAYERS}")
    tap = FeatureTap(loaded, LAYERS)  # the whole forward: its last features and argmax are checked on the first rows
    check = {"rows": 0, "positions": 0, "argmax_agree": 0, "feature_cosine": [], "feature_rel_err": []}
    started, done = time.perf_counter(), 0
    for name in SETS:
        path = work / f"{name}.pt"
        if path.exists():
            log(f"{name}: already tapped")
            continue
        rows, out = torch.load(HEAD_WORK / f"{name}.pt"), []
        budget = args.text_positions if name == "train-text" else None
        for i, row in enumerate(rows):
            if budget is not None and sum(len(r["ids"]) for r in out) >= budget:
                log(f"{name}: stopped at {len(out)}/{len(rows)} rows (--text-positions {budget})")
                break
            checked = check["rows"] < args.check_rows
            tapped = tap.run(row["ids"].tolist())
            if checked:  # the full forward: does it reproduce what head-work stored?
                stored, mine = row["features"].float(), tapped["features"].float()
                check["rows"] += 1
                check["positions"] += len(stored)
                check["argmax_agree"] += int((tapped["argmax"] == row["argmax"]).sum())
                check["feature_cosine"].append(float(F.cosine_similarity(stored, mine, dim=-1).mean()))
                check["feature_rel_err"].append(float((stored - mine).norm() / stored.norm()))
            low, mid, high = (tapped[f"early{layer}"] for layer in LAYERS)
            out.append({"ids": row["ids"], "argmax": row["argmax"], "answer_start": row["answer_start"],
                        "low": low, "mid": mid, "high": high})
            done += len(row["ids"])
            if i % args.log_every == 0:
                log(f"{name}: {i + 1}/{len(rows)} rows, {done} positions in all, "
                    f"{done / (time.perf_counter() - started):.0f} positions/s")
        torch.save(out, path)
        log(f"{name}: wrote {len(out)} rows, {sum(len(r['ids']) for r in out)} positions")
        if check["rows"] and not (work / "tap-check.json").exists():
            summary = {"rows": check["rows"], "positions": check["positions"],
                       "argmax_agreement": check["argmax_agree"] / check["positions"],
                       "last_feature_cosine_mean": statistics.mean(check["feature_cosine"]),
                       "last_feature_relative_error_mean": statistics.mean(check["feature_rel_err"]),
                       "format": loaded.format.label, "layers": LAYERS}
            (work / "tap-check.json").write_text(json.dumps(summary, indent=1) + "\n")
            log(f"check against head-work: {summary}")


# ---------------------------------------------------------------- the arms


def make_head(arm: str, loaded, vocab: torch.Tensor, intermediate: int = 4096) -> DraftHead:
    """A fused arm's head reads its layers through DraftHead's own fuse (EAGLE-3's fc3, starting as `high` passed
    on): the engine drafts with such a head as saved (feature_layers), the same math."""
    if not ARMS[arm][0]:
        return build_head(loaded, vocab, intermediate)
    model, config = loaded.model, loaded.model.config
    return DraftHead(model.embed.float(), model.final_norm.float(), model.lm_head.weight.float(), vocab,
                     config.num_heads, intermediate, config.rope_theta, feature_layers=ARMS[arm][0])


def head_file_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A head file's tensors (int8 matrices back in float32) and its vocabulary."""
    from safetensors.torch import load_file

    return loaded_tensors(load_file(str(path)))


def warm_head(arm: str, loaded, path: Path) -> DraftHead:
    """An arm's head starting from the head file `path` (its vocabulary, width and weights). A fused arm over a
    last-layer head's file starts with fuse passing the last layer on, the other layers' columns zero: it drafts
    as the file's head does until training moves it (its last layer must be the target's last)."""
    tensors = head_file_tensors(path)
    head = make_head(arm, loaded, tensors["vocab"].long(), tensors["gate_up"].shape[0] // 2)
    mine = head.trained_tensors()
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name != "vocab":
                mine[name].copy_(tensor)
        if head.feature_layers and "fuse" not in tensors:
            last = loaded.model.config.num_layers
            if head.feature_layers[-1] != last:
                raise ValueError(f"{arm} reads layers {head.feature_layers}: a last-layer head starts only a fused "
                                 f"head whose last layer is the target's last ({last})")
            width = head.fuse.weight.shape[0]
            head.fuse.weight.zero_()
            head.fuse.weight[:, -width:].copy_(torch.eye(width))
    return head


def arm_rows(arm: str, work: Path, names: list[str]) -> list[dict]:
    """The rows an arm reads: fused-work's (low, mid, high) for a fused arm, head-work's last features otherwise;
    the same ids either way (head-work's rows cut to as many as were tapped)."""
    rows = []
    for name in names:
        tapped = torch.load(work / f"{name}.pt")
        if tapped and "features" in tapped[0]:  # --work is study.py collect's: last features, early{L} states
            rows.extend(study_rows(tapped, ARMS[arm][0]))
            continue
        if ARMS[arm][0]:
            rows.extend(tapped)
            continue
        stored = torch.load(HEAD_WORK / f"{name}.pt")[: len(tapped)]
        for mine, theirs in zip(tapped, stored):
            assert torch.equal(mine["ids"], theirs["ids"]), name
        rows.extend({k: r[k] for k in ("ids", "features", "argmax", "answer_start")} for r in stored)
    return rows


def study_rows(rows: list[dict], layers: tuple[int, ...]) -> list[dict]:
    """study.py collect's rows (collected with --early-layers holding each of `layers` but the last) as an arm reads
    them: low, mid and high the states after `layers` (the last layer's: the stored features, not copied)."""
    out = []
    for row in rows:
        kept = {key: row[key] for key in ("ids", "features", "argmax", "answer_start")}
        for name, layer in zip(("low", "mid", "high"), layers):
            if layer != NUM_LAYERS and f"early{layer}" not in row:
                raise SystemExit(f"these rows lack the states after layer {layer}: collect them again with study.py "
                                 f"collect --early-layers {' '.join(map(str, layers[:-1]))} (into an empty --work)")
            kept[name] = row["features"] if layer == NUM_LAYERS else row[f"early{layer}"]
        out.append(kept)
    return out


def step0_features(head: DraftHead, arm: str, row_or_batch: dict) -> torch.Tensor:
    """The layer's feature input at verified positions: fused, or the normalized last hidden state."""
    if ARMS[arm][0]:
        return head.target_features(torch.cat([row_or_batch[name] for name in ("low", "mid", "high")], -1))
    return head.target_features(row_or_batch["features"])


def chain_windows(rows: list[dict], depth: int) -> list[tuple[int, int, int]]:
    """(row, start, stop): windows of WINDOW input positions t as study.training_pairs cuts them."""
    windows = []
    for r, row in enumerate(rows):
        n = len(row["ids"])
        for start in range(0, n - 1, WINDOW):
            stop = min(start + WINDOW, n - 1)
            if stop - start >= 8:
                windows.append((r, start, stop))
    return windows


def chain_batch(rows: list[dict], windows: list[tuple[int, int, int]], arm: str, depth: int) -> dict:
    """A batch of windows padded on the right: the step-0 inputs (B, T, C) each, tokens (B, T + depth - 1):
    x_{t+1} .. (0 past the row), labels (B, T + depth - 1): the target's argmax at t+1 .. (-1 past the row or
    window padding). Step j reads tokens[:, j : j + T] and is scored on labels[:, j : j + T]."""
    length = max(stop - start for _, start, stop in windows)
    span = length + depth - 1
    keys = ("low", "mid", "high") if ARMS[arm][0] else ("features",)
    out = {key: [] for key in keys}
    tokens = torch.zeros(len(windows), span, dtype=torch.long)
    labels = torch.full((len(windows), span), -1, dtype=torch.long)
    for b, (r, start, stop) in enumerate(windows):
        row = rows[r]
        for key in keys:
            out[key].append(F.pad(row[key][start:stop], (0, 0, 0, length - (stop - start))))
        n = stop - start
        ids, argmax = row["ids"][start + 1 : start + n + depth], row["argmax"][start + 1 : start + n + depth]
        tokens[b, : len(ids)] = ids
        labels[b, : len(argmax)] = argmax  # inputs t >= n (window padding) are masked at every step (ttt_losses)
    batch = {key: torch.stack(v) for key, v in out.items()}
    batch["tokens"], batch["labels"] = tokens, labels
    batch["lengths"] = torch.tensor([stop - start for _, start, stop in windows])
    return batch


def ttt_losses(head: DraftHead, arm: str, batch: dict, depth: int, index: torch.Tensor, noise: float = 0.0):
    """Cross-entropy at each training-time-test step (EAGLE-3 / HASS): step 0 over the batch's step-0 features,
    step j > 0 over the head's own step j-1 outputs, the true token x_{t+1+j}, rotary position t + j, attending to
    step 0's keys causally and to steps 1..j's keys at the same t. Returns per-step (loss, top-1 hits, counted).
    noise: uniform noise of +-noise added to the step-0 features (normalized: about 1 an element), as EAGLE-1
    trains against a head that memorizes its training answers."""
    g = step0_features(head, arm, batch)  # (B, T, C)
    if noise:
        g = g + torch.empty_like(g).uniform_(-noise, noise)
    B, T, _ = g.shape
    valid = torch.arange(T)[None, :] < batch["lengths"][:, None]  # (B, T) real input positions
    positions = torch.arange(T)
    scale = head.head_dim**-0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    results, chain_k, chain_v = [], [], []
    feature = g
    for j in range(depth):
        x = head.layer_input(feature, batch["tokens"][:, j : j + T])
        q, k, v = head.project(x, positions + j)  # (B, H, T, D)
        if j == 0:
            k0, v0 = k, v
            attended = F.scaled_dot_product_attention(q, k, v.to(q.dtype), is_causal=True)
        else:
            chain_k.append(k)
            chain_v.append(v.float())
            scores0 = (q @ k0.transpose(-1, -2)) * scale  # (B, H, T, T)
            scores0 = scores0.masked_fill(~causal, float("-inf"))
            diag = torch.stack([(q * ki).sum(-1) for ki in chain_k], -1) * scale  # (B, H, T, j)
            weights = torch.cat([scores0, diag], -1).softmax(-1)
            attended = weights[..., :T] @ v0.float()
            attended = attended + sum(weights[..., T + i, None] * vi for i, vi in enumerate(chain_v))
        feature = head.finish(x, attended)  # (B, T, C) normalized, float32
        logits = head.logits(feature)  # (B, T, V')
        labels = batch["labels"][:, j : j + T]
        classes = torch.where(valid & (labels >= 0), index[labels.clamp(min=0)], -100)
        counted = classes >= 0
        loss = F.cross_entropy(logits.float().flatten(0, 1), classes.flatten(), ignore_index=-100)
        with torch.no_grad():
            hits = int((logits.argmax(-1) == classes)[counted].sum())
        results.append((loss, hits, int(counted.sum()), feature))
    return results


def cmd_train(args) -> None:
    from verispec.models.loading import load_model

    work = Path(args.work)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fused_arm, depth, loss_kind = ARMS[args.arm]
    depth = args.ttt or depth
    loaded = load_model(TARGET)  # dense: the embedding, final norm and output head, as study.cmd_train
    names = args.sets or training_sets(work)  # every set there, as study.py
    rows = arm_rows(args.arm, work, names)
    if args.init:  # go on from a head file: its vocabulary and weights
        head = warm_head(args.arm, loaded, Path(args.init))
        vocab = head.vocab
        log(f"starting from {args.init}")
    else:
        vocab = head_vocab(rows, args.vocab, loaded.model.vocab_size)  # the same rows, the same ids for every arm
        head = make_head(args.arm, loaded, vocab)
    index = head_rows(vocab, loaded.model.vocab_size)
    del loaded  # the head holds its own copies of the embedding, norm and head rows: 3 GB less (two arms at once)
    gc.collect()
    if loss_kind == "study":
        pairs = training_pairs(rows)
        count = len(pairs)
        tokens = sum(len(p[1]) for p in pairs)
    else:
        windows = chain_windows(rows, depth)
        count = len(windows)
        tokens = sum(stop - start for _, start, stop in windows)
    log(f"arm {args.arm}: {names}, {count} windows, {tokens} positions; depth {depth}, loss {loss_kind}")
    params = [p for p in head.parameters() if p.requires_grad]
    log(f"{sum(p.numel() for p in params) / 1e6:.1f}M trained parameters")
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    budget = args.minutes * 60
    started = time.perf_counter()
    deadline = started + budget
    step = seen = real_seen = epoch = 0
    history, order = [], list(range(count))
    saved_at = started

    def save(final: bool) -> None:
        """The head so far in work/<tag>.pt (final: the budget is spent; else a checkpoint, every --save-every
        minutes, that a run stopped early leaves)."""
        last = history[-50:]
        top1 = [sum(h[j][1] for h in last) / max(1, sum(h[j][2] for h in last)) for j in range(len(last[0]))]
        torch.save({"state": head.state_dict(), "vocab": vocab, "arm": args.arm, "depth": depth, "loss": loss_kind,
                    "steps": step, "positions": seen, "real_positions": real_seen, "epochs": epoch,
                    "passes": real_seen / tokens, "minutes": args.minutes, "train_positions": tokens, "lr": args.lr,
                    "batch": args.batch, "threads": args.threads, "sets": names, "last_50_steps_top1_by_step": top1,
                    "feature_noise": args.feature_noise, "init": args.init, "intermediate": head.down.weight.shape[1],
                    "final": final, "elapsed_minutes": (time.perf_counter() - started) / 60},
                   work / f"{args.tag or args.arm}.pt")
    while time.perf_counter() < deadline:
        random.Random(epoch).shuffle(order)
        for start in range(0, len(order), args.batch):
            if time.perf_counter() >= deadline:
                break
            chosen = order[start : start + args.batch]
            fraction = min((time.perf_counter() - started) / budget, 1.0)
            for group in optimizer.param_groups:
                group["lr"] = scheduled_lr(args.lr, step, fraction)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if loss_kind == "study":  # study.cmd_train's loss, as it computes it
                    f, nxt, f_next, labels = padded_batch([pairs[i] for i in chosen])
                    real = labels >= 0
                    predicted = head(f, nxt)
                    logits = head.logits(predicted)
                    per_position = F.smooth_l1_loss(predicted.float(), f_next, beta=0.1, reduction="none").mean(-1)
                    regression = (per_position * real).sum() / real.sum()
                    classes = torch.where(real, index[labels.clamp(min=0)], -100)
                    ce = F.cross_entropy(logits.float().flatten(0, 1), classes.flatten(), ignore_index=-100)
                    loss = regression + args.ce_weight * ce
                    with torch.no_grad():
                        counted = classes >= 0
                        steps = [(float(ce), int((logits.argmax(-1) == classes)[counted].sum()), int(counted.sum()))]
                    positions, real_positions = labels.numel(), int(real.sum())
                else:
                    batch = chain_batch(rows, [windows[i] for i in chosen], args.arm, depth)
                    results = ttt_losses(head, args.arm, batch, depth, index, args.feature_noise)
                    loss = sum(args.step_decay**j * r[0] for j, r in enumerate(results))  # EAGLE-3: 0.8 ** j
                    steps = [(float(r[0].detach()), r[1], r[2]) for r in results]
                    positions = len(chosen) * int(batch["lengths"].max())  # padded, as study counts
                    real_positions = int(batch["lengths"].sum())
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            seen += positions
            real_seen += real_positions
            history.append(steps)
            if step % 20 == 0:
                recent = history[-20:]
                by_step = [(statistics.mean(h[j][0] for h in recent),
                            sum(h[j][1] for h in recent) / max(1, sum(h[j][2] for h in recent)))
                           for j in range(len(recent[0]))]
                shown = " ".join(f"ce{j} {c:.2f} top1-{j} {t:.3f}" for j, (c, t) in enumerate(by_step))
                log(f"{args.arm} epoch {epoch} step {step}: {shown} "
                    f"({real_seen / (time.perf_counter() - started):.0f} positions/s)")
            if args.save_every and time.perf_counter() - saved_at > args.save_every * 60:
                save(final=False)
                saved_at = time.perf_counter()
                log(f"checkpoint after {step} steps, {real_seen} positions")
        epoch += 1
    save(final=True)
    log(f"saved {args.tag or args.arm}.pt after {step} steps, {real_seen} positions ({real_seen / tokens:.2f} passes)")


# ---------------------------------------------------------------- evaluation, as the head drafts


@torch.no_grad()
def draft_chains(head: DraftHead, g: torch.Tensor, ids: torch.Tensor, answer_start: int, depth: int) -> torch.Tensor:
    """study.unroll(fed="draft") over step-0 features g (T, C): for each answer position t, the head's `depth`
    greedy drafts after the target chose x_{t+1}, seeing the true features up to t, then its own outputs and
    drafts. (N, depth) target ids."""
    T = len(ids)
    first = answer_start - 1
    x = head.layer_input(g[None, : T - 1], ids[None, 1:T])
    positions = torch.arange(T - 1)
    q, k, v = head.project(x, positions)
    predicted = head.finish(x, F.scaled_dot_product_attention(q, k, v.to(q.dtype), is_causal=True))[0]
    queries = torch.arange(first, T - 1)
    n = len(queries)
    drafts = torch.zeros(n, depth, dtype=torch.long)
    feature, token = predicted[queries], None
    chain_k, chain_v = [], []
    mask = positions[None, :] <= queries[:, None]
    for d in range(depth):
        if d > 0:
            xi = head.layer_input(feature[:, None], token[:, None])
            qi, ki, vi = head.project(xi, (queries + d)[:, None])
            chain_k.append(ki)
            chain_v.append(vi)
            keys = torch.cat([k[0].transpose(0, 1).expand(n, -1, -1, -1), torch.cat(chain_k, 2).transpose(1, 2)], 1)
            values = torch.cat([v[0].transpose(0, 1).expand(n, -1, -1, -1), torch.cat(chain_v, 2).transpose(1, 2)], 1)
            visible = torch.cat([mask, torch.ones(n, d, dtype=torch.bool)], 1)
            scores = torch.einsum("nhd,nshd->nhs", qi[:, :, 0], keys) / head.head_dim**0.5
            scores = scores.masked_fill(~visible[:, None], float("-inf"))
            out = torch.einsum("nhs,nshd->nhd", scores.softmax(-1), values.float())
            feature = head.finish(xi, out[:, :, None])[:, 0]
        drafts[:, d] = head.vocab[head.logits(feature).argmax(-1)]
        token = drafts[:, d]
    return drafts


def trained(arm_file: Path, loaded) -> tuple[DraftHead, dict]:
    saved = torch.load(arm_file)
    head = make_head(saved["arm"], loaded, saved["vocab"], saved.get("intermediate", 4096))
    head.load_state_dict(saved["state"])
    return head.eval(), saved


def cmd_evaluate(args) -> None:
    from verispec.bench.machine import machine_description
    from verispec.models.loading import load_model

    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    if args.head:  # a head file as it is (the shipped head: the arms' starting point), read as --arm reads
        head, saved = warm_head(args.arm, load_model(TARGET), Path(args.head)).eval(), {"head": args.head}
        arm = args.arm
    else:
        head, saved = trained(work / f"{args.tag or args.arm}.pt", load_model(TARGET))
        arm = saved["arm"]
    results = {"arm": arm, "training": {k: v for k, v in saved.items() if k not in ("state", "vocab")},
               "depth": args.depth, "workloads": {}}
    for name in ("humaneval", "chat", "code-edit"):
        rows = arm_rows(arm, work, [f"eval-{name}"])
        tally = ChainTally(args.depth)
        for row in rows:
            truth = row["ids"][row["answer_start"] :]
            with torch.no_grad():
                g = step0_features(head, arm, row)
            tally.add(truth, draft_chains(head, g, row["ids"], row["answer_start"], args.depth))
        per_position, at_steps = tally.alpha_by_position(), tally.alpha_at_steps()
        per_forward = tally.tokens_per_forward()
        results["workloads"][name] = {"answer_tokens": tally.tokens, "alpha_by_position": per_position,
                                      f"alpha_by_position_at_steps_k{args.depth}": at_steps,
                                      "tokens_per_forward": per_forward}
        log(f"{arm} {name}: alpha {[round(a, 3) for a in per_position]}, at step starts "
            f"{[round(a, 3) for a in at_steps]}, tokens/forward "
            f"{ {k: round(v, 2) for k, v in per_forward.items()} }")
    results["machine"] = machine_description()
    results["command"] = " ".join(sys.argv)
    (out / "results.json").write_text(json.dumps(rounded(results), indent=1) + "\n")


def rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    return value


def cmd_cost(args) -> None:
    """One draft position (study.head_cost: the layer and the restricted head as the target's Linears in its served
    format, one row, 256 cached keys) against the target's one-token forward, timed in one process; and fc3 over
    1..8 verified positions (a fused head's extra, once per position the target verifies)."""
    from verispec.bench.machine import machine_description
    from verispec.models.linear import Linear
    from verispec.models.loading import load_model

    torch.set_num_threads(args.threads)
    dense = load_model(TARGET)
    served = load_model(TARGET, quantize="auto")
    head, _ = trained(Path(args.work) / f"{args.tag}.pt", dense)
    results = {"format": served.format.label, "per_position": [head_cost(head, served.model) for _ in range(2)]}
    model = served.model
    if head.feature_layers:
        fc3 = Linear(head.fuse.weight.detach().to(model.dtype).contiguous())
        fc3.quantize(model.weight_format, model.activations)
        fc3_ms = {}
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, len(LAYERS), head.fuse.weight.shape[0], dtype=model.dtype)  # low, mid, high

            def fuse(x=x):
                with torch.inference_mode():
                    rms(fc3(rms(x).flatten(1)))

            fc3_ms[rows] = time_forward(fuse) * 1e3
        results["fc3_ms_by_rows"] = fc3_ms
    log(f"cost {results}")
    results["machine"] = machine_description()
    results["command"] = " ".join(sys.argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost.json").write_text(json.dumps(rounded(results), indent=1) + "\n")


def cmd_export(args) -> None:
    """A trained arm as a head file (study.cmd_export's: --ship makes it the head verispec ships for the target)."""
    from verispec.bench.machine import machine_line
    from verispec.drafters.draft_head import SHIPPED_HEADS, SHIPPED_MANIFEST
    from verispec.models.loading import load_model

    head, saved = trained(Path(args.work) / f"{args.tag}.pt", load_model(TARGET))
    about = {key: value for key, value in saved.items() if key not in ("state", "vocab")}
    about["recipe"] = "benchmarks/draft_head/fused.py"
    about["machine"] = machine_line()
    shipped = json.loads((SHIPPED_HEADS / SHIPPED_MANIFEST).read_text()).get(TARGET)
    init = Path(saved["init"]) if saved.get("init") else None
    if shipped and init and init.resolve() == (SHIPPED_HEADS / shipped["file"]).resolve():
        about["started_from"] = {"sha256": shipped["sha256"], "trained": shipped["trained"]}  # the head it went on from
    elif init and init.is_file():  # a head file study.py trained (`make head`'s first part): its runs and data
        about["started_from"] = {"file": init.name, "trained": head_file_training(init)}
    write_head(head, about, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tap = commands.add_parser("tap")
    tap.add_argument("--text-positions", type=int, default=None, help="tap only about this many of train-text")
    tap.add_argument("--check-rows", type=int, default=4, help="the first rows checked against head-work")
    tap.add_argument("--log-every", type=int, default=10)
    train = commands.add_parser("train")
    train.add_argument("--arm", choices=sorted(ARMS), required=True)
    train.add_argument("--minutes", type=float, default=38)
    train.add_argument("--ttt", type=int, default=None, help="training-time test depth (default: the arm's)")
    train.add_argument("--vocab", type=int, default=32768)
    train.add_argument("--batch", type=int, default=8)
    train.add_argument("--lr", type=float, default=5e-4)
    train.add_argument("--ce-weight", type=float, default=0.1, help="baseline: study.py's CE weight")
    train.add_argument("--sets", nargs="*", default=None, help="default: every train-* in --work")
    train.add_argument("--step-decay", type=float, default=0.8, help="TTT step j's loss weight: this ** j")
    train.add_argument("--feature-noise", type=float, default=0.0, metavar="A",
                       help="TTT arms: uniform noise of +-A on the step-0 features (EAGLE-1's regularizer; 0: none)")
    train.add_argument("--save-every", type=float, default=20, metavar="MINUTES",
                       help="save the head so far this often (0: only at the end)")
    train.add_argument("--init", default=None, metavar="HEAD_FILE",
                       help="start from this head file (its vocabulary and weights), e.g. the shipped head")
    evaluate = commands.add_parser("evaluate")
    evaluate.add_argument("--arm", choices=sorted(ARMS), required=True)
    evaluate.add_argument("--out", required=True)
    evaluate.add_argument("--depth", type=int, default=6)
    evaluate.add_argument("--head", default=None, metavar="HEAD_FILE",
                          help="evaluate this head file (read as --arm's head) instead of a trained checkpoint")
    cost = commands.add_parser("cost")
    cost.add_argument("--out", required=True)
    export = commands.add_parser("export")
    export.add_argument("--out", default=None, help="a .safetensors path; default where `make head` puts it")
    export.add_argument("--ship", action="store_true", help="replace the head verispec ships for the target")
    export.add_argument("--weights", choices=HEAD_WEIGHTS, default="int8")
    for command in (tap, train, evaluate, cost, export):
        command.add_argument("--work", required=True)
        command.add_argument("--threads", type=int, default=1)
    for command in (train, evaluate, cost, export):
        command.add_argument("--tag", default=None, help="the checkpoint's name in --work (default: the arm's)")
    args = parser.parse_args()
    if args.command == "export" and not args.tag:
        parser.error("export needs --tag: the trained checkpoint (<work>/<tag>.pt) to write as a head file")
    run = {"tap": cmd_tap, "train": cmd_train, "evaluate": cmd_evaluate, "cost": cmd_cost, "export": cmd_export}
    run[args.command](args)


if __name__ == "__main__":
    main()
