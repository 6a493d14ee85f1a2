"""OpenAI request bodies: parsing, validation, and the one error shape every bad request gets.

Types are strict (`"temperature": "0.5"` is an error, not 0.5): a client that sends the wrong
type has a bug worth hearing about. OpenAI fields that would change the output but are not
implemented (echo, suffix, the legacy functions, ...) are refused with a 400;
tools / tool_choice become a grammar over the completion (verispec.serving.tools);
response_format json_object / json_schema constrain the output with a grammar (verispec.grammar);
presence / frequency penalties and logit_bias shape p and q alike (verispec.sampling);
fields that do not change the output (user, metadata, ...) and unknown fields are ignored.
Extensions beyond OpenAI, as in vLLM: top_k, min_p, repetition_penalty, ignore_eos; and verispec's own
max_draft_tokens (a request's cap on draft tokens per step; 0 turns speculation off for it).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, Strict, ValidationError, ValidationInfo, field_validator, model_validator,
)
from pydantic_core import PydanticCustomError

from verispec.config import GenerationConfig
from verispec.grammar import ANY_JSON_OBJECT
from verispec.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from verispec.serving.tools import tool_grammar

DEFAULT_MAX_TOKENS = 256  # when the request gives none; lowered to what the context leaves
MAX_STOP_STRINGS = 4
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit

Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]  # ints are accepted, strings and bools not
Integer = Annotated[int, Strict()]
Flag = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]


class APIError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        type: str = "invalid_request_error", headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _unsupported(detail: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", "{detail} is not supported by this server", {"detail": detail})


# Fields that would change the output in a way this server does not implement, whenever they are set
# (non-zero, non-empty, true). The message names what is not supported.
_REFUSED_WHEN_SET = {
    "echo": "echo",
    "suffix": "suffix (insertion)",
    "functions": "functions (the legacy form; send tools)",
}


def _refuse_when_set(cls, value: Any, info: ValidationInfo) -> Any:
    """A field validator: a set value of a _REFUSED_WHEN_SET field is a 400 "not supported"."""
    if value:
        raise _unsupported(_REFUSED_WHEN_SET[info.field_name])
    return value


def parse_json_object(raw: bytes) -> dict:
    """A request body: UTF-8 JSON holding one object (NaN and Infinity are not JSON)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {error.start})") from None
    if not text.strip():
        raise APIError(400, "the request body is empty; send a JSON object")

    def refuse_constant(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(text, parse_constant=refuse_constant)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}, column {error.colno}"
        raise APIError(400, f"the request body is not valid JSON: {error.msg} ({where})") from None
    except ValueError as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        kind = "null" if data is None else type(data).__name__
        raise APIError(400, f"the request body must be a JSON object, got {kind}")
    try:  # a "\ud800" escape decodes to a lone surrogate, which is no text a tokenizer can take
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request body holds a lone UTF-16 surrogate escape (e.g. \\ud800)") from None
    return data


def param_path(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic (or FastAPI) error as a 400 naming the offending parameter."""
    first = errors[0]
    loc = tuple(part for part in first.get("loc", ()) if part != "body")
    param = param_path(loc) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    code = "unsupported_parameter" if first.get("type") == "unsupported_parameter" else None
    return APIError(400, f"{param}: {message}" if param else message, param, code)


def validate(model: type[BaseModel], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Flag = False


class JSONSchemaFormat(BaseModel):
    """response_format.json_schema. The schema is enforced exactly whether or not strict is set."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Text = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    json_schema: dict[str, Any] = Field(default_factory=lambda: dict(ANY_JSON_OBJECT), alias="schema")
    strict: Flag | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object ({'name': ..., 'schema': {...}})")
        return self

    def required_schema(self) -> dict[str, Any] | None:
        """The JSON schema the completion must follow; None for plain text."""
        if self.type == "json_object":
            return dict(ANY_JSON_OBJECT)
        return self.json_schema.json_schema if self.type == "json_schema" else None


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None  # None: the one model served
    max_tokens: Integer | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)  # None: 1, as OpenAI
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: Integer | None = Field(None, ge=0)  # extension; 0 = off
    min_p: Number | None = Field(None, ge=0, le=1)  # extension; 0 = off
    seed: Integer | None = Field(None, ge=-(2**63), le=2**64 - 1)  # None: a fresh random seed
    stop: list[Text] = []  # a string or a list of strings in the request
    n: Integer | None = Field(None, ge=1)  # choices; at most the server's batch (one prefill shared by all)
    stream: Flag | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: Flag | None = None  # extension: generate max_tokens tokens even past end-of-sequence
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(None, gt=0, le=10)  # extension (vLLM); 1 = off
    # extension: this request's cap on draft tokens per step (0: decoded plainly, even in a batch that speculates)
    max_draft_tokens: Integer | None = Field(None, ge=0, le=64)
    logit_bias: dict[str, Number] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None  # structured output: json_object or json_schema
    user: Text | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens may be biased, got {len(value)}")
        ids = set()
        for key, bias in value.items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if int(key) in ids:
                raise ValueError(f"token id {int(key)} appears twice")
            ids.add(int(key))
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return value

    @model_validator(mode="after")
    def _structured_output_ends(self) -> "_GenerationRequest":
        if self.ignore_eos and self.response_format is not None and self.response_format.required_schema() is not None:
            raise ValueError("ignore_eos cannot be combined with a JSON response_format: the document ends at eos")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The requested completion length (None: not given) and the parameter that gave it."""
        return self.max_tokens, "max_tokens"

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple(sorted((int(key), bias) for key, bias in (self.logit_bias or {}).items())),
        )

    def requested_logprobs(self) -> int | None:
        """How many alternatives to report with each token's log-probability; None: no logprobs."""
        return None

    def lark_grammar(self) -> str | None:
        """A grammar the completion must follow besides response_format (chat: tool calls)."""
        return None

    @property
    def choices(self) -> int:
        return self.n or 1

    def generation_configs(self, max_new_tokens: int) -> list[GenerationConfig]:
        """The engine settings of each choice; k is the server's (the scheduler ignores a per-request k).

        Choice i samples with seed + i (a fresh random seed when the request gives none), so a seeded
        request repeats, choice by choice.
        """
        seed = secrets.randbits(63) if self.seed is None else self.seed
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            sampling=self.sampling(),
            seed=seed,
            stop_strings=tuple(self.stop),
            eos_token_ids=() if self.ignore_eos else None,
            logprobs=self.requested_logprobs(),
            json_schema=self.response_format.required_schema() if self.response_format is not None else None,
            lark_grammar=self.lark_grammar(),
            max_draft_tokens=self.max_draft_tokens,
        )
        seeds = [seed + i if seed + i < 2**64 else seed + i - 2**64 for i in range(self.choices)]
        return [dataclasses.replace(config, seed=choice_seed) for choice_seed in seeds]


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]  # a string, a list of one string, token ids or a list of one list of token ids
    best_of: Integer | None = None
    echo: Flag | None = None
    logprobs: Integer | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token (0: the token's own)
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and all(isinstance(item, (str, list)) for item in value):
            if len(value) > 1:
                raise ValueError(f"one prompt per request is supported, got a batch of {len(value)}")
            value = value[0]
        if value == "" or value == []:
            raise ValueError("the prompt is empty")
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            return value
        raise ValueError("prompt must be a string, a list of one string, or a list of token ids (integers >= 0)")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise _unsupported(f"best_of={value}")
        return value

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    _refuse_completion_fields = field_validator("echo", "suffix")(_refuse_when_set)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Text
    arguments: Text  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Text = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    strict: Flag | None = None  # the arguments follow the schema whether or not it is set


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    class Name(BaseModel):
        model_config = ConfigDict(extra="ignore")
        name: Text

    type: Literal["function"]
    function: Name


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str = ""  # a string, a list of text parts (joined) or null
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # a tool's answer: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str:
        if value is None or isinstance(value, str):
            return value or ""
        if not isinstance(value, list) or not all(_is_text_part(part) for part in value):
            raise ValueError("content must be a string or a list of text parts ({'type': 'text', 'text': ...})")
        return "".join(part["text"] for part in value)

    def to_template(self) -> dict:
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    logprobs: Flag | None = None
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Flag | None = None  # None: true, as OpenAI
    functions: list[Any] | None = None

    _refuse_chat_fields = field_validator("functions")(_refuse_when_set)

    @model_validator(mode="after")
    def _tool_choice_needs_its_tool(self) -> "ChatCompletionRequest":
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice is only allowed when tools are given")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: function names must be distinct")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not in tools")
        if self.calls_tools and self.response_format is not None and self.response_format.required_schema():
            raise ValueError("response_format JSON cannot be combined with tools unless tool_choice is 'none'")
        return self

    @property
    def tool_choice_name(self) -> str | None:
        """None without tools; else "none", "auto" (the default), "required" or "function" (a named one)."""
        if not self.tools:
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice or "auto"

    @property
    def calls_tools(self) -> bool:
        """Whether the completion may hold tool calls (to be returned as tool_calls)."""
        return self.tool_choice_name not in (None, "none")

    def functions_for_template(self) -> list[dict] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def lark_grammar(self) -> str | None:
        if self.tool_choice_name is None:
            return None
        if not self.calls_tools and self.response_format is not None and self.response_format.required_schema():
            return None  # the JSON schema already leaves no room for a call
        functions = [tool.function.model_dump(exclude_none=True) for tool in self.tools]
        name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        return tool_grammar(functions, self.tool_choice_name, self.parallel_tool_calls is not False, name)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def resolve_max_tokens(
    requested: tuple[int | None, str], prompt_tokens: int, context: int, prompt_param: str
) -> int:
    """Tokens to generate: the request's, or DEFAULT_MAX_TOKENS lowered to what the context leaves.

    requested is (value or None, its parameter name); prompt_param names the prompt in errors.
    """
    requested, param = requested
    room = context - prompt_tokens
    if room < 1:
        raise APIError(
            400, f"This model's maximum context length is {context} tokens. However, your prompt is "
            f"{prompt_tokens} tokens, which leaves no room for a completion. Please shorten the prompt.",
            prompt_param, "context_length_exceeded",
        )
    if requested is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if requested > room:
        raise APIError(
            400, f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the completion). "
            f"Please reduce the prompt or {param}.",
            param, "context_length_exceeded",
        )
    return requested
