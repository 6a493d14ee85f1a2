"""benchmarks/ as data: every run.json follows the one schema and benchmarks/INDEX.md is what they say."""

from __future__ import annotations

import json

from conftest import benchmark_script


def test_every_run_json_follows_the_schema_and_the_index_is_current(capsys):
    index = benchmark_script("index")
    assert index.runs(), "no run.json found under benchmarks/"
    assert index.main(["--check"]) == 0, capsys.readouterr().err


def test_the_check_finds_a_run_json_that_breaks_the_schema(tmp_path):
    index = benchmark_script("index")
    run = json.loads(index.runs()[0].read_text())
    problems = index.check(index.runs()[0], run)
    assert problems == []
    del run["question"]
    run["figures"] = [{"workload": "chat", "mode": "verispec-defaults", "vs": "verispec-plain"}]  # no speedup
    broken = index.check(index.runs()[0], run)
    assert any("question" in problem for problem in broken) and any("speedup" in problem for problem in broken)
