"""Writes benchmarks/workloads/tenants.jsonl: the support workload as four stores, each with its own system
prompt (issue 13, item 3).

The four system prompts differ in their first sentence (the store's name), so their keys and values
cannot be shared: each store's ~1,000-token prefix is reused only by that store's requests. The
requests take the stores in turn (A, B, C, D, A, ...), 4 questions each.
    .venv/bin/python benchmarks/scripts/ray-replicas/make_tenants.py
"""

import json
from pathlib import Path

WORKLOADS = Path(__file__).parents[2] / "workloads"  # benchmarks/scripts/ray-replicas/ -> benchmarks/workloads
SOURCE = WORKLOADS / "support-system-prompt.jsonl"
STORES = ["Northwind Outfitters", "Alder Peak Supply", "Bluewater Trail Co.", "Cedar Ridge Gear"]
QUESTIONS_PER_STORE = 4

rows = [json.loads(line) for line in SOURCE.read_text().splitlines() if line.strip()]
with open(WORKLOADS / "tenants.jsonl", "w") as out:
    for number in range(QUESTIONS_PER_STORE * len(STORES)):
        store = STORES[number % len(STORES)]
        row = rows[number]
        system, user = row["messages"]
        messages = [{"role": "system", "content": system["content"].replace(STORES[0], store)}, user]
        out.write(json.dumps({"id": f"tenants/{store.split()[0].lower()}-{number}", "messages": messages}) + "\n")
