"""Tool calling served: tools / tool_choice become a grammar, calls come back as OpenAI tool_calls.

A tiny model whose tokenizer has `<tool_call>` / `</tool_call>` tokens and a chat template that renders
tools (Hermes style, as Qwen2.5's does) is served in-process (scheduler + app) to the official openai client;
random weights cannot choose to call, so required and named choices show the constrained path, and greedy
served output equals the library's plain decoding under the same grammar. The packaged Qwen pair proves the
whole path on a real template (marked real).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from conftest import CORPUS
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.loading import load_model
from verispec.serving.app import create_app
from verispec.serving.guard import ServerSettings
from verispec.serving.metrics import ServerMetrics
from verispec.serving.scheduler import Scheduler, SchedulerLimits
from verispec.serving.tools import parse_tool_calls, tool_grammar, tool_tokens

TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for call in m.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}\n{% endfor %}<assistant>"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False,
    }},
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 200


def build_tool_model(directory: Path, seed: int) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    directory.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<tool_call>", "</tool_call>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = load_model(str(build_tool_model(tmp_path_factory.mktemp("tool-target"), 0)), "float32")
    draft = load_model(str(build_tool_model(tmp_path_factory.mktemp("tool-draft"), 1)), "float32")
    return target, draft


@pytest.fixture(scope="module")
def client(models):
    target, draft = models
    scheduler = Scheduler(target, draft.model, "draft-model", k=3,
                          limits=SchedulerLimits(max_batch_size=4, max_context=2048))
    scheduler.start()
    app = create_app(scheduler, ServerMetrics(), ServerSettings("tiny-tools", 1 << 20))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
    scheduler.stop()


def chat(client, **fields):
    return client.chat.completions.create(model="tiny-tools", messages=MESSAGES, max_completion_tokens=MAX_TOKENS,
                                          temperature=0, **fields)


def check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_choices_return_valid_calls_equal_to_the_library(client, models, choice):
    target, _ = models
    response = chat(client, tools=[WEATHER, ADD], tool_choice=choice, parallel_tool_calls=False)  # random weights
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls
    for call in message.tool_calls:
        check_call(call, WEATHER if call.function.name == "get_weather" else ADD)
    if isinstance(choice, dict):
        assert {call.function.name for call in message.tool_calls} == {"add"}
    # Lossless: the library's plain decoding under the same grammar gives the same calls.
    kind, name = (choice, None) if isinstance(choice, str) else ("function", "add")
    functions = [WEATHER["function"], ADD["function"]]
    prompt = target.tokenizer.apply_chat_template(MESSAGES, tools=[WEATHER, ADD], tokenize=False,
                                                  add_generation_prompt=True)
    grammar = tool_grammar(functions, kind, parallel=False, name=name)
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, lark_grammar=grammar)
    ids = SpeculativeEngine(target).generate(prompt, config).token_ids
    _, expected = parse_tool_calls(ids, tool_tokens(target.tokenizer), target.decode)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in expected
    ]
    assert response.model_extra["speculative"]["drafted_tokens"] > 0


def test_none_and_auto_answer_text_or_valid_calls(client):
    none = chat(client, tools=[WEATHER], tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.message.content and "<tool_call>" not in none.message.content
    for seed in range(6):  # sampled: auto may answer either way; whichever it is must be well formed
        choice = client.chat.completions.create(
            model="tiny-tools", messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            tools=[WEATHER], parallel_tool_calls=False,
        ).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                check_call(call, WEATHER)
        else:
            assert "<tool_call>" not in (choice.message.content or "")


def test_streamed_calls_equal_the_whole_response(client):
    fields = dict(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False)
    whole = chat(client, **fields).choices[0].message.tool_calls
    streamed, reasons = {}, []
    for chunk in chat(client, **fields, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                streamed[call.index] = (call.function.name, call.function.arguments)
            assert not choice.delta.content
            reasons.append(choice.finish_reason)
    assert [streamed[i] for i in sorted(streamed)] == [(c.function.name, c.function.arguments) for c in whole]
    assert reasons[-1] == "tool_calls"


def test_a_function_named_like_a_choice_is_still_a_named_choice(client):
    """A function called "none" chosen by name must be called (not read as tool_choice "none")."""
    none_named = {"type": "function", "function": {**ADD["function"], "name": "none"}}
    response = chat(client, tools=[none_named], tool_choice={"type": "function", "function": {"name": "none"}})
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "none" and response.choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_calls_and_their_results_renders(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    response = client.chat.completions.create(model="tiny-tools", messages=history, max_completion_tokens=8,
                                              temperature=0, tools=[WEATHER])
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tool_choice": "required"}, None),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, None),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, None),
])
def test_bad_tool_requests_are_400s(client, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, **fields)
    assert error.value.body["param"] == param and error.value.body["message"]


def test_a_model_without_tool_tokens_refuses_tools(target):
    scheduler = Scheduler(target, limits=SchedulerLimits(max_batch_size=1, max_context=64))  # never started
    app = create_app(scheduler, ServerMetrics(), ServerSettings("tiny", 1 << 20))
    with TestClient(app) as http:
        response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


@pytest.mark.real
def test_real_model_calls_the_weather_tool(default_pair, real_threads):
    """The packaged pair, Qwen2.5's own template: required and named choices give one valid call with the city
    asked about. (Under auto this coder model answers with a fenced JSON text rather than its call tokens, which
    auto allows: that is the model's own choice, and it comes back as content.)"""
    target, draft = default_pair
    scheduler = Scheduler(target, draft.model, "draft-model", limits=SchedulerLimits(max_batch_size=2,
                                                                                     max_context=2048))
    scheduler.start()
    try:
        with TestClient(create_app(scheduler, ServerMetrics(), ServerSettings("qwen", 1 << 20))) as http:
            client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http)
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                response = client.chat.completions.create(
                    model="qwen", messages=MESSAGES, tools=[WEATHER, ADD], tool_choice=choice, temperature=0,
                    max_completion_tokens=64, parallel_tool_calls=False,
                )
                assert response.choices[0].finish_reason == "tool_calls"
                (call,) = response.choices[0].message.tool_calls
                assert check_call(call, WEATHER)["city"] == "Paris"
            auto = client.chat.completions.create(
                model="qwen", messages=MESSAGES, tools=[WEATHER, ADD], temperature=0, max_completion_tokens=64,
            ).choices[0]
            for call in auto.message.tool_calls or []:
                check_call(call, WEATHER if call.function.name == "get_weather" else ADD)
            assert auto.message.tool_calls or auto.message.content
    finally:
        scheduler.stop()
