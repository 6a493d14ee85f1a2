"""The target's own answers, kept as token ids so that the head's training data grows across machines (issue 48).

What holds the head back is its data (benchmarks/results/zen4/block-drafter: on answers it trained on its first
draft passes 0.93-1.00 of the time, on new ones about half as often). Writing answers is the slow part: 60-110
tokens/s in batches of 16 on a 2-core Zen 4, against about 170 tokens/s to teacher-force them. So every answer set the
target writes is kept here, in `data/head-answers/<set>.npz` (token ids, a few hundred KB a set), and
`study.py collect` only teacher-forces a kept set on the next machine: its features and argmax come from that
machine's target, so the labels are always the target's own in the format it serves there.

A set file holds, for each answer, the whole sequence (prompt then answer) and where the answer starts, and what
wrote it (`about`: target, format, machine kind, temperature, the date it was kept).

This module also makes code prompts from the standard library (`stdlib_code_items`): functions with a docstring,
cut after the docstring for the target to complete (HumanEval's form), and whole functions with an edit to make
(code-edit's form). None of them is a measured prompt (those are HumanEval's).
"""

from __future__ import annotations

import ast
import json
import random
import textwrap
import zipfile
from pathlib import Path

import numpy as np

from verispec.bench.workloads import ADD_COMMENTS, ADD_TYPE_HINTS, code_edit_request

STORE = Path(__file__).resolve().parents[2] / "data" / "head-answers"
STORED_EDITS = (ADD_TYPE_HINTS, ADD_COMMENTS)  # code-edit's two edits that need no name from the code


def save_answers(path: Path, rows: list[tuple[list[int], int]], about: dict) -> None:
    """rows: (prompt + answer ids, where the answer starts) each, as one compressed file."""
    lengths = np.array([len(ids) for ids, _ in rows], dtype=np.int32)
    ids = np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in rows]) if rows else np.zeros(0, np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, ids=ids, lengths=lengths,
                        answer_starts=np.array([start for _, start in rows], dtype=np.int32),
                        about=np.array(json.dumps(about, sort_keys=True)))


def load_answers(path: Path) -> tuple[list[tuple[list[int], int]], dict]:
    """A kept set: its rows (prompt + answer ids, where the answer starts) and what wrote them."""
    damaged = (f"{path} is damaged: restore it (`git checkout -- {path}`), or delete it and collect the set "
               "again")
    try:
        with np.load(path, allow_pickle=False) as kept:
            ids, lengths, starts = kept["ids"], kept["lengths"], kept["answer_starts"]
            about = json.loads(str(kept["about"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        raise SystemExit(f"{damaged} ({error})") from None
    if int(lengths.sum()) != len(ids) or len(starts) != len(lengths) or (starts > lengths).any():
        raise SystemExit(f"{damaged} (its lengths do not add up)")
    ends = np.cumsum(lengths)
    rows = [(ids[end - length : end].tolist(), int(start)) for end, length, start in zip(ends, lengths, starts)]
    return rows, about


def stored_sets(store: Path) -> list[str]:
    return sorted(path.stem for path in store.glob("train-*.npz"))


def _functions_with_docstrings(source: str):
    """(the function's source, dedented; the line after its docstring, counted from the def) for each function in
    `source` with a docstring of its own and a body past it, of 6-40 lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        doc = node.body[0] if node.body else None
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if len(node.body) < 2 or not 6 <= node.end_lineno - node.lineno + 1 <= 40:
            continue
        text = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        yield text, doc.end_lineno - node.lineno + 1


def stdlib_code_items(count: int, skip: int = 0, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """`count` completion prompts (a function up to the end of its docstring: HumanEval's form) and `count` edit
    prompts (a whole function and one of STORED_EDITS: code-edit's form), from different standard-library functions,
    in a fixed order, after the first `skip` of each (so that batches written one after another do not overlap)."""
    completions, edits = _stdlib_code_items(count + skip, seed)
    return completions[skip:], edits[skip:]


ROUNDS = (slice(0, 2), slice(2, 6), slice(6, None))  # the functions each file gives in each pass over the files


def _stdlib_code_items(count: int, seed: int) -> tuple[list[dict], list[dict]]:
    import sysconfig

    from verispec.drafters.draft_vocab import corpus_files

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in corpus_files() if path != stdlib / "pydoc_data" / "topics.py"]  # not pydoc's topics
    random.Random(seed).shuffle(files)
    found: dict[Path, list] = {}  # each file's functions, parsed once
    completions, edits = [], []
    for taken in ROUNDS:  # the first two functions of every file, then more of each: many files first
        for path in files:
            if path not in found:
                found[path] = list(_functions_with_docstrings(path.read_text(errors="replace")))
            for i, (code, body_line) in list(enumerate(found[path]))[taken]:
                where = f"{path.relative_to(stdlib).as_posix()}/{i}"
                if len(completions) < count and (len(edits) >= count or len(completions) <= len(edits)):
                    head = "\n".join(code.splitlines()[:body_line]) + "\n"
                    completions.append({"id": f"stdlib/{where}", "prompt": head})
                elif len(edits) < count:
                    edit = STORED_EDITS[len(edits) % len(STORED_EDITS)]
                    edits.append({"id": f"stdlib-edit/{where}",
                                  "messages": [{"role": "user", "content": code_edit_request(code, edit)}]})
            if len(completions) >= count and len(edits) >= count:
                return completions, edits
    return completions, edits
