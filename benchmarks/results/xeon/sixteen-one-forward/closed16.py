"""Closed loop: 16 clients, each sends its next chat request when its last ends; plain vs defaults alternated.
Prints wall seconds and time inside scheduler phases."""
import glob, collections, sys, time, functools, torch
from verispec.bench.workloads import load_workload, render_prompt
from verispec.engine import GenerationConfig
from verispec.serving.scheduler import SchedulerLimits, build_scheduler, Scheduler
import verispec.drafters.batch_head as bh
torch.set_num_threads(2)
TIMES = collections.Counter()
def timed(cls, name):
    fn = getattr(cls, name)
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name] += time.perf_counter() - t
    setattr(cls, name, wrapper)
for name in ["_sources", "_draft", "_retire", "_admit", "_step", "_begin_decoding", "_prefill_some", "_start_prefill", "_emit", "_verify_row"]:
    timed(Scheduler, name)
timed(bh.BatchedDraftHead, "observe")
timed(bh.BatchedDraftHead, "move")
from verispec.models.transformer import Transformer
timed(Transformer, "forward_packed")
from verispec.models.kv_cache import KVCache
timed(KVCache, "move_row")

STEPLOG = []
_orig_step = Scheduler._step
def logged_step(self):
    seqs = list(self.active)
    before = sum(len(q.tokens) for q in seqs)
    t0 = time.perf_counter(); f0 = TIMES["forward_packed"]; d0 = TIMES["_draft"]
    _orig_step(self)
    STEPLOG.append((len(seqs), sum(len(q.tokens) for q in seqs) - before, time.perf_counter() - t0, TIMES["forward_packed"] - f0, TIMES["_draft"] - d0, LASTTOK[0]))
Scheduler._step = logged_step
LASTTOK = [0]
from verispec.models.transformer import Transformer as _T
_ofp = _T.forward_packed
def fp(self, row_tokens, *a, **k):
    LASTTOK[0] = sum(len(r) for r in row_tokens)
    return _ofp(self, row_tokens, *a, **k)
_T.forward_packed = fp
import gc
GC = {"t": 0.0, "n": [0, 0, 0], "start": 0.0}
def gccb(phase, info):
    if phase == "start":
        GC["start"] = time.perf_counter()
    else:
        GC["t"] += time.perf_counter() - GC["start"]; GC["n"][info["generation"]] += 1
gc.callbacks.append(gccb)
modes = sys.argv[1].split(",")
requests = int(sys.argv[2]) if len(sys.argv) > 2 else 48
clients = int(sys.argv[3]) if len(sys.argv) > 3 else 16
items = load_workload("chat")
limits = SchedulerLimits(16, 256, 2048)
built = {}
for mode in dict.fromkeys(modes):
    built[mode] = build_scheduler("qwen2.5-coder-1.5b-instruct", None, "none", k=0, limits=limits) if mode == "plain" else \
        build_scheduler("qwen2.5-coder-1.5b-instruct", "head", "composite", limits=limits)
    if mode == "dclone":
        original = built[mode].draft.observe
        built[mode].draft.observe = lambda row, position, features, original=original: original(row, position, features.clone())
for mode in modes:
    s = built[mode]
    ids = [s.target.encode(render_prompt(s.target.tokenizer, it)) for it in items]
    TIMES.clear(); STEPLOG.clear(); GC['t'] = 0.0; GC['n'] = [0, 0, 0]
    before = collections.Counter(s.controller.chosen)
    stats_total = collections.Counter()
    started = time.perf_counter()
    sent, live, tokens = 0, [], 0
    def send():
        global sent
        h = s.submit(ids[sent % len(ids)], GenerationConfig(max_new_tokens=128))
        sent += 1
        return h
    live = [send() for _ in range(clients)]
    done = 0
    while live:
        s.run_once()
        still = []
        for h in live:
            finished = False
            while not h._sync_queue.empty():
                e = h._sync_queue.get()
                if e.finish_reason is not None:
                    stats_total['drafted'] += e.stats.drafted_tokens; stats_total['accepted'] += e.stats.accepted_tokens; stats_total['forwards'] += e.stats.target_forwards
                tokens += len(e.token_ids)
                if e.finish_reason is not None:
                    finished = True
            if finished:
                done += 1
                if sent < requests:
                    still.append(send())
            else:
                still.append(h)
        live = still
    wall = time.perf_counter() - started
    fp = TIMES["forward_packed"] / max(1, stats_total["forwards"]) * 16000
    print(mode, f"{fp:.1f} ms/fwd {wall:.2f} s {tokens / wall:.2f} tok/s", " ".join(f"{k}={v:.2f}" for k, v in TIMES.most_common()), flush=True)
    import json; json.dump(STEPLOG, open(f"/tmp/s29/steps-{mode}-{len(glob.glob(f'/tmp/s29/steps-{mode}-*'))}.json", "w"))
    c = s.controller; print("  verify", {k: round(v*1000,1) for k, v in sorted(c.verify_cost.items())}); print("  overhead", {k: round(v*1000,1) for k, v in c.step_overhead.items()}); print("  alpha", {n: ([round(a,2) for a in v.alpha[:4]], {b: round(x*1000,2) for b, x in v.draft_cost.items()}) for n, v in c.sources.items()})
    print("  gc", round(GC["t"], 2), GC["n"])
    print("  chosen", dict(s.controller.chosen - before), dict(stats_total), flush=True)
