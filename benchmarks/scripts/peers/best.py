"""Print the best-throughput setting among a bench-serve run's servers: `best.py OUT PREFIX DEFAULT [CONTAINS]`.

The part of the winning server's name after PREFIX is printed (e.g. `8` for `llama-draft-8`); DEFAULT
when the run measured none of them (the peer could not run here).
"""

import json
import sys
from pathlib import Path

out, prefix, default = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
contains = sys.argv[4] if len(sys.argv) > 4 else ""
try:
    summaries = json.loads((out / "results.json").read_text())["summaries"]
except (OSError, ValueError, KeyError):
    summaries = []
candidates = [s for s in summaries if s["server"].startswith(prefix) and contains in s["server"] and s["errors"] == 0]
best = max(candidates, key=lambda s: s["throughput_tokens_per_second"], default=None)
print(best["server"][len(prefix):] if best else default)
