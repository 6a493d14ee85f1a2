"""`verispec serve ARGS` with every scheduler step logged; SIGUSR1 writes {"steps": [...], "verify": the controller's
verify costs, "packed": the packed-chunk costs} to $STEPLOG. A step: (rows, 0, step seconds, forward seconds, tokens in
the forward, {part: seconds} of the step's timed parts, prompt-chunk tokens it carried, the scheduler's step average).
NOOP_OBSERVE=1: the draft head is handed nothing (it never drafts); CLONE_OBSERVE=1: it is handed copies, not views."""
import atexit, json, os, signal, sys, time
from verispec.serving.scheduler import Scheduler
from verispec.models.transformer import Transformer
OUT = os.environ["STEPLOG"]
LOG, FWD = [], [0.0, 0]
CHUNK = [0]
SCHED = [None]
_fp = Transformer.forward_packed
def fp(self, row_tokens, *a, **k):
    t = time.perf_counter()
    try:
        return _fp(self, row_tokens, *a, **k)
    finally:
        FWD[0] += time.perf_counter() - t; FWD[1] = sum(len(r) for r in row_tokens)
Transformer.forward_packed = fp
_step = Scheduler._step
def step(self):
    n = len(self.active); before = sum(len(s.tokens) for s in self.active); f0 = FWD[0]; t = time.perf_counter()
    PART.clear(); CHUNK[0] = 0; SCHED[0] = self
    _step(self)
    LOG.append((n, 0, time.perf_counter() - t, FWD[0] - f0, FWD[1], dict(PART), CHUNK[0], getattr(self, '_step_seconds', None)))
Scheduler._step = step
_pc = Scheduler._packed_chunk
def pc(self, *a, **k):
    r = _pc(self, *a, **k); CHUNK[0] = len(r); return r
Scheduler._packed_chunk = pc
import collections, functools
PART = collections.Counter()
def timed(cls, name):
    fn = getattr(cls, name)
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PART[name] += time.perf_counter() - t
    setattr(cls, name, wrapper)
for name in ["_sources", "_lookups_may_draft", "_choose_k", "_draft", "_commit_row", "_verify_row", "_emit", "_retire", "_admit"]:
    timed(Scheduler, name)
from verispec.drafters.batch_head import BatchedDraftHead
from verispec.policy import AdaptiveController
from verispec.serving.metrics import ServerMetrics
timed(BatchedDraftHead, "observe"); timed(AdaptiveController, "observe_step"); timed(AdaptiveController, "observe_forward"); timed(ServerMetrics, "step")
_ao = AdaptiveController.observe
def aobs(*a, **k):
    t = time.perf_counter()
    try:
        return _ao(*a, **k)
    finally:
        PART["c.observe"] += time.perf_counter() - t
AdaptiveController.observe = aobs
def dump(*_):
    json.dump(LOG, open(OUT, "w")); os._exit(0)
signal.signal(signal.SIGUSR1, lambda *_: json.dump({'steps': LOG, 'verify': SCHED[0].controller.verify_cost, 'packed': SCHED[0]._packed_seconds}, open(OUT, 'w')))
atexit.register(lambda: json.dump(LOG, open(OUT, "w")))
if os.environ.get("NOOP_OBSERVE"):
    BatchedDraftHead.observe = lambda self, row, position, features: None
if os.environ.get("CLONE_OBSERVE"):
    _obs = BatchedDraftHead.observe
    BatchedDraftHead.observe = lambda self, row, position, features: _obs(self, row, position, features.clone())
from verispec.cli import main
sys.argv = ["verispec", "serve", *sys.argv[1:]]
sys.exit(main())
