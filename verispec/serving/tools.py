"""Tool calling (OpenAI's `tools` / `tool_choice`) for chat templates that call tools in the Hermes style.

Qwen2.5's template (and other Hermes-style ones) lists the functions in the system prompt and has the model
answer a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

where `<tool_call>` and `</tool_call>` are single tokens of the vocabulary. A request's `tool_choice` becomes
a grammar (llguidance's Lark syntax) over the completion, so a call's arguments are valid under the
function's JSON schema and the output is still exactly the constrained target's (the grammar masks p and
q as a JSON schema does, see verispec.grammar):

- "none": text only (the call token is never allowed);
- "auto" (the default with tools): text, or one or more calls;
- "required": one or more calls, to any of the functions;
- {"type": "function", "function": {"name": ...}}: one call to that function.

The completion is then split into OpenAI `tool_calls` on the call tokens (`parse_tool_calls`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from verispec.grammar import JSON_LAYOUT

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolTokens:
    """The ids that open and close a call in this tokenizer."""

    open_id: int
    close_id: int


def tool_tokens(tokenizer: Any) -> ToolTokens | None:
    """The call tokens, when the tokenizer has them and its chat template renders tools; else None."""
    vocab = tokenizer.get_vocab()
    template = getattr(tokenizer, "chat_template", None) or ""
    if CALL_OPEN in vocab and CALL_CLOSE in vocab and "tools" in template:
        return ToolTokens(vocab[CALL_OPEN], vocab[CALL_CLOSE])
    return None


def call_schema(functions: list[dict]) -> dict:
    """The JSON schema of one call's body: {"name": one of the functions, "arguments": its parameters}.

    Each function's parameters sit under the root's $defs (as "f0", "f1", ...), their local references
    ("#", "#/$defs/item", ...) pointed there, so parameters that use $defs and $ref mean what they mean
    in response_format.
    """
    definitions = {
        f"f{i}": _rebase_refs(function.get("parameters") or {"type": "object"}, f"#/$defs/f{i}")
        for i, function in enumerate(functions)
    }
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": {"$ref": f"#/$defs/f{i}"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, function in enumerate(functions)
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": definitions, "x-guidance": JSON_LAYOUT}


def _rebase_refs(schema: Any, root: str) -> Any:
    """schema with every local "$ref" ("#" or "#/...") made relative to `root` instead of the document."""
    if isinstance(schema, list):
        return [_rebase_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            rebased[key] = root + value[1:]
        else:
            rebased[key] = _rebase_refs(value, root)
    return rebased


def tool_grammar(functions: list[dict], choice: str, parallel: bool = True, name: str | None = None) -> str:
    """Lark source for a completion under tool_choice `choice`: "none", "auto", "required" or "function"
    (then `name` is the function to call).

    functions: OpenAI function objects ({"name", "description", "parameters"}); a named choice must be one.
    """
    if choice not in ("none", "auto", "required", "function"):
        raise ValueError(f"tool_choice must be none, auto, required or function, got {choice!r}")
    text = "TEXT: /(?s:.+)/\n"
    if choice == "none":
        return "%llguidance {}\nstart: TEXT\n" + text
    called = functions if choice != "function" else [f for f in functions if f["name"] == name]
    if not called:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    several = parallel and choice in ("auto", "required")
    calls = 'calls: call ("\\n" call)*\n' if several else "calls: call\n"
    start = "start: TEXT | calls\n" if choice == "auto" else "start: calls\n"
    return (
        "%llguidance {}\n" + start + (text if choice == "auto" else "") + calls
        + f'call: {CALL_OPEN} "\\n" body "\\n" {CALL_CLOSE}\n'
        + f"body: %json {json.dumps(call_schema(called))}\n"
    )


def parse_tool_calls(
    token_ids: list[int], tokens: ToolTokens, decode: Callable[[list[int]], str]
) -> tuple[str | None, list[dict]]:
    """(content before the calls or None, OpenAI tool_calls) of a completion; without calls: (its text, []).

    Split on the call tokens themselves (a tokenizer may mark them special, so decoded text can lack them);
    only closed calls whose body is {"name": ..., "arguments": ...} JSON count.
    """
    calls = []
    start = None  # index after the latest open token
    for index, token in enumerate(token_ids):
        if token == tokens.open_id:
            start = index + 1
        elif token == tokens.close_id and start is not None:
            body = _call_body(decode(token_ids[start:index]))
            if body is not None:
                calls.append({
                    "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": body["name"],
                                 "arguments": json.dumps(body.get("arguments", {}), ensure_ascii=False)},
                })
            start = None
    if not calls:
        return decode(token_ids), []
    content = decode(token_ids[: token_ids.index(tokens.open_id)]).strip()
    return content or None, calls


def _call_body(text: str) -> dict | None:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return None  # an unconstrained model's malformed call stays out
    return body if isinstance(body, dict) and isinstance(body.get("name"), str) else None


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as chat templates expect them: a call's arguments as an object, not a JSON string."""
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**call, "function": {**call["function"], "arguments": _arguments(call["function"].get("arguments"))}}
                for call in calls
            ]}
        rendered.append(message)
    return rendered


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
