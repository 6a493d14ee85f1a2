"""`verispec serve` end to end: a real server process, the official openai client, raw httpx for bad input.

One server (module scope) serves the tiny float32 model with another tiny model as draft (k = 3):
drafts are often rejected, and greedy text must still equal the library's plain decoding.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import socket
import time
from typing import Callable, NamedTuple

import httpx
import jsonschema
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from verispec.cli import main
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.loading import LoadedModel
from verispec.models.transformer import PREFILL_CHUNK
from verispec.serving.app import create_app
from verispec.serving.guard import ServerSettings
from verispec.serving.metrics import ServerMetrics
from verispec.serving.protocol import validation_error
from verispec.serving.scheduler import Scheduler, SchedulerLimits

from servers import free_port, running_server

MODEL = "tiny"
MAX_BATCH_SIZE = 8
MAX_WAITING = 32  # room for the 32 concurrent clients below even before the loop admits any
MAX_REQUEST_BYTES = 64 * 1024
CONTEXT = 512  # the tiny model's max_position_embeddings
WORDS = ["def", "add", "(a, b):", "return", "class", "Point", "for i in", "range(10)", "print", "total"]
PROMPTS = [" ".join(WORDS[i % 7 : i % 7 + 1 + i % 4]) + f" {i}" for i in range(32)]  # 32 distinct, ragged


@pytest.fixture(scope="module")
def server(tiny_dir, other_tiny_dir, tmp_path_factory) -> str:
    """Base URL of a running `verispec serve`; its log is shown if it fails to come up."""
    arguments = [
        "--target", str(tiny_dir), "--draft", str(other_tiny_dir), "--dtype", "float32", "--threads", "1", "--k", "3",
        "--max-batch-size", str(MAX_BATCH_SIZE), "--max-waiting", str(MAX_WAITING),
        "--max-request-bytes", str(MAX_REQUEST_BYTES), "--served-model-name", MODEL,
    ]
    with running_server(arguments, tmp_path_factory.mktemp("server") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def library(target, prompt: str, max_new_tokens: int, stop: tuple[str, ...] = (), eos: tuple[int, ...] | None = None):
    """What the library's plain greedy decoding gives for the same prompt."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop_strings=stop, eos_token_ids=eos)
    return SpeculativeEngine(target, None).generate(prompt, config)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def total(samples: dict, name: str) -> float:
    return sum(value for (sample_name, _), value in samples.items() if sample_name == name)


def wait_idle(url: str, timeout: float = 10.0) -> dict:
    """/health once no request is active or waiting; fails the test if that does not happen in time."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health").json()
        if health["active"] == 0 and health["waiting"] == 0:
            return health
        if time.monotonic() > deadline:
            pytest.fail(f"requests still running after {timeout}s: {health}")
        time.sleep(0.05)


def good(**extra) -> dict:
    """A small valid completion request, with changes."""
    return {"model": MODEL, "prompt": "def", "max_tokens": 2, **extra}


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def check_speculative(speculative: dict, completion_tokens: int) -> None:
    assert 0 < speculative["drafted_tokens"]  # k = 3: every request with room drafts
    assert 0 <= speculative["accepted_tokens"] <= speculative["drafted_tokens"]
    rate = speculative["accepted_tokens"] / speculative["drafted_tokens"]
    assert speculative["acceptance_rate"] == pytest.approx(rate, abs=1e-4)
    assert 1 <= speculative["target_forwards"] <= completion_tokens
    per_forward = completion_tokens / speculative["target_forwards"]
    assert speculative["tokens_per_target_forward"] == pytest.approx(per_forward, abs=1e-4)
    assert 0 < speculative["time_to_first_token"] <= speculative["total_seconds"] + 1e-4  # total is rounded


# -- output --------------------------------------------------------------------------------------


def test_completion_greedy_equals_library(client, target):
    prompt = "def add(a, b):"
    expected = library(target, prompt, 40)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    choice = response.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.object == "text_completion" and response.model == MODEL and response.id.startswith("cmpl-")
    assert response.usage.prompt_tokens == len(target.encode(prompt))
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.usage.prompt_tokens_details.cached_tokens == 0  # shorter than a prefix cache block
    check_speculative(response.model_extra["speculative"], len(expected.token_ids))


def test_a_request_caps_or_turns_off_its_own_speculation(server, client, target):
    """max_draft_tokens (an extension, like vLLM's extra parameters): 0 decodes the request plainly while the others
    in its batch draft, 1 caps its drafts at one a step; greedy text is the same, its usage says what it drafted."""
    prompt = "def add(a, b):"
    expected = library(target, prompt, 32)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # together: one batch, capped and free rows side by side
        futures = {cap: pool.submit(client.completions.create, model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                    extra_body={} if cap is None else {"max_draft_tokens": cap}) for cap in (0, 1, None)}
        responses = {cap: future.result() for cap, future in futures.items()}
    assert all(response.choices[0].text == expected.text for response in responses.values())
    off, one, free = (responses[cap].model_extra["speculative"] for cap in (0, 1, None))
    assert off["drafted_tokens"] == 0 and off["target_forwards"] == len(expected.token_ids)
    assert 0 < one["drafted_tokens"] <= one["target_forwards"]  # at most one draft token a step
    assert free["drafted_tokens"] > one["target_forwards"]  # the server's k = 3 where the request sets no cap
    wrong = httpx.post(f"{server}/v1/completions", json={"prompt": prompt, "max_draft_tokens": -1}, timeout=30)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "max_draft_tokens"


def target_logprobs(target, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """log-softmax of the target's scores for each of token_ids after prompt_ids, from one plain forward: (T, V)."""
    model = target.model
    cache = model.new_cache(1, len(prompt_ids) + len(token_ids) + 1)
    logits = model.forward(torch.tensor([prompt_ids + token_ids[:-1]]), cache)[0]  # (P + T - 1, V)
    return torch.log_softmax(logits[len(prompt_ids) - 1 :].float(), dim=-1)


def test_completion_logprobs_are_the_targets_for_every_token_accepted_drafts_included(client, target):
    prompt = "def add(a, b):"
    expected = library(target, prompt, 24)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=3)
    choice = response.choices[0]
    assert choice.text == expected.text  # asking for logprobs changes nothing else
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(expected.token_ids) == len(logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == target.decode(expected.token_ids)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    reference = target_logprobs(target, target.encode(prompt), expected.token_ids)  # (T, V)
    assert response.model_extra["speculative"]["drafted_tokens"] > 0
    entries = zip(expected.token_ids, logprobs.token_logprobs, logprobs.top_logprobs)
    for position, (token, logprob, top) in enumerate(entries):
        assert logprob == pytest.approx(float(reference[position, token]), abs=1e-4)
        best = reference[position].topk(3).values.tolist()  # (tokens that decode alike share one key)
        assert 1 <= len(top) <= 3 and all(any(abs(v - b) < 1e-4 for b in best) for v in top.values())
        assert logprob == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the chosen token is the likeliest
        assert logprob == pytest.approx(best[0], abs=1e-4)


def test_streamed_chat_logprobs_cover_every_token_once(client, target):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a loop"}], max_completion_tokens=20,
        temperature=0, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
    )
    text, entries, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                entries.extend(choice.logprobs.content)
    assert len(entries) == usage.completion_tokens > 0
    assert "".join(e.token for e in entries) == text
    for entry in entries:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)  # greedy
        assert bytes(entry.bytes) == entry.token.encode("utf-8")
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a loop"}], max_completion_tokens=20, temperature=0,
    )
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


def test_a_shared_long_prefix_is_reused_and_the_output_stays_the_librarys(client, target, server):
    system = " ".join(f"{WORDS[i % len(WORDS)]} {i}" for i in range(60))  # ~200 tokens, shared by both requests
    assert len(target.encode(system)) > 2 * PREFILL_CHUNK
    before = scrape(server)
    responses = []
    for question in ("def add(a, b):", "class Point:"):
        prompt = system + "\n" + question
        expected = library(target, prompt, 12)
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert response.choices[0].text == expected.text
        responses.append(response)
    assert responses[0].usage.prompt_tokens_details.cached_tokens == 0
    cached = responses[1].usage.prompt_tokens_details.cached_tokens
    assert cached >= 2 * PREFILL_CHUNK and cached % PREFILL_CHUNK == 0
    assert responses[1].model_extra["speculative"]["cached_prompt_tokens"] == cached
    after = scrape(server)
    hits = ("verispec_prefix_cache_tokens_total", (("result", "hit"),))
    assert after[hits] - before.get(hits, 0.0) == cached
    assert after[("verispec_prefix_cache_bytes", ())] > 0


def test_chat_greedy_equals_library(client, target):
    expected = library(target, target.apply_chat_template("Write a loop"), 30)
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a loop"}], max_completion_tokens=30, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.usage.completion_tokens == len(expected.token_ids)
    check_speculative(response.model_extra["speculative"], len(expected.token_ids))


RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count", "ok"],
    "additionalProperties": False,
}


def test_chat_json_schema_equals_library_and_validates(client, target):
    """Greedy with a schema, with speculation on: the library's constrained plain decoding, a valid document."""
    prompt = target.apply_chat_template("Describe a point")
    config = GenerationConfig(max_new_tokens=60, json_schema=RECORD_SCHEMA)
    expected = SpeculativeEngine(target).generate(prompt, config)
    named_schema = {"name": "record", "schema": RECORD_SCHEMA, "strict": True}
    response_format = {"type": "json_schema", "json_schema": named_schema}
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a point"}], max_completion_tokens=60,
        temperature=0, response_format=response_format,
    )
    content = response.choices[0].message.content
    assert content == expected.text and response.choices[0].finish_reason == "stop"
    document = json.loads(content)
    jsonschema.validate(document, RECORD_SCHEMA)
    assert list(document) == ["name", "count", "ok"]  # properties come in the schema's order
    assert response.model_extra["speculative"]["drafted_tokens"] > 0


def test_penalties_and_logit_bias_equal_the_library(client, target):
    """Greedy with every penalty and a logit_bias, served with speculation: the library's plain decoding under
    the same settings, which differs from decoding without them."""
    from verispec.sampling import SamplingParams

    bias = {str(target.encode(" return")[0]): 3.0, str(target.encode("def")[0]): -100}
    params = SamplingParams(presence_penalty=0.6, frequency_penalty=0.9, repetition_penalty=1.4,
                            logit_bias=tuple(sorted((int(key), value) for key, value in bias.items())))
    prompt = "def add(a, b):\n    return a + b\n\ndef"
    expected = SpeculativeEngine(target).generate(prompt, GenerationConfig(max_new_tokens=40, sampling=params)).text
    unpenalized = SpeculativeEngine(target).generate(prompt, GenerationConfig(max_new_tokens=40)).text
    assert expected != unpenalized
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, presence_penalty=0.6, frequency_penalty=0.9,
        logit_bias=bias, extra_body={"repetition_penalty": 1.4},
    )
    assert response.choices[0].text == expected
    assert response.model_extra["speculative"]["drafted_tokens"] > 0


def test_n_choices_whole_and_streamed(client, target):
    """n = 3 sampled choices with a seed: indexed 0..2, usage counts the prompt once and every choice; the
    streamed response carries the same three texts, interleaved by index; greedy choices are all plain."""
    messages = [{"role": "user", "content": "def add(a, b):"}]
    common = dict(model=MODEL, messages=messages, max_completion_tokens=24, temperature=1.0, seed=11, n=3)
    whole = client.chat.completions.create(**common)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1
    single = client.chat.completions.create(**{**common, "n": 1})
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert 3 <= whole.usage.completion_tokens <= 3 * 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert len(whole.model_extra["speculative_choices"]) == 3
    streamed = ["", "", ""]
    finished = set()
    for chunk in client.chat.completions.create(**common, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert streamed == texts and finished == {0, 1, 2}
    plain = SpeculativeEngine(target).generate(
        target.apply_chat_template("def add(a, b):"), GenerationConfig(max_new_tokens=24)
    ).text
    greedy = client.chat.completions.create(**{**common, "temperature": 0})
    assert [c.message.content for c in greedy.choices] == [plain] * 3


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_json_object_streams_sampled_documents_that_parse(client, endpoint):
    """Sampled (temperature 1) json_object documents from both endpoints, streamed: each that ends parses as an
    object; one cut by max_tokens used them all."""
    finished = 0
    for seed in range(8):  # a seed gives the same sample every run (k is fixed), so this is no coin flip
        common = {"model": MODEL, "max_tokens": 150, "temperature": 1.0, "seed": seed, "stream": True,
                  "stream_options": {"include_usage": True}}
        json_object = {"type": "json_object"}
        if endpoint == "chat":
            stream = client.chat.completions.create(
                messages=[{"role": "user", "content": "def add(a, b):"}], response_format=json_object, **common
            )
        else:  # the client's completions have no response_format argument; the server takes it (as vLLM does)
            stream = client.completions.create(
                prompt="def add(a, b):", extra_body={"response_format": json_object}, **common
            )
        text, finish_reason, usage = "", None, None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += (choice.delta.content or "") if endpoint == "chat" else choice.text
                finish_reason = choice.finish_reason or finish_reason
        if finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
        else:
            assert finish_reason == "length" and usage.completion_tokens == 150
    assert finished >= 1


def test_token_id_prompt_and_stop_string_match_library(client, target):
    prompt = "class Point:"
    full = library(target, prompt, 30).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = library(target, prompt, 30, stop=(stop,))
    assert len(expected.text) < len(full)  # the stop string really cuts the text
    response = client.completions.create(
        model=MODEL, prompt=target.encode(prompt), max_tokens=30, temperature=0, stop=[stop]
    )
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_concatenation_equals_whole_response(client, endpoint):
    def create(**kwargs):
        if endpoint == "chat":
            messages = [{"role": "user", "content": "for i in"}]
            return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
        return client.completions.create(model=MODEL, prompt="for i in", **kwargs)

    whole = create(max_tokens=48, temperature=0)
    chunks = list(create(max_tokens=48, temperature=0, stream=True, stream_options={"include_usage": True}))
    if endpoint == "chat":
        assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
    else:
        assert chunks[0].object == "text_completion"
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert len({c.id for c in chunks}) == 1
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == whole.choices[0].finish_reason and set(finish[:-1]) == {None}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    check_speculative(usage_chunk.model_extra["speculative"], whole.usage.completion_tokens)


def test_sse_wire_format(server):
    body = chat(max_tokens=12, temperature=0, stream=True)
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert all(event.startswith("data: ") for event in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = payloads[-1]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] in ("stop", "length")
    assert all(p["object"] == "chat.completion.chunk" and "usage" not in p for p in payloads)


def test_same_seed_same_sample(client):
    kwargs = dict(model=MODEL, prompt="print", max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_extensions_top_k_and_ignore_eos(client, target):
    """Sampling with top_k=1 is greedy; ignore_eos runs to max_tokens like the library without eos ids."""
    expected = library(target, "def greet(name):", 60, eos=())
    response = client.completions.create(
        model=MODEL, prompt="def greet(name):", max_tokens=60, temperature=1.0, seed=5,
        extra_body={"top_k": 1, "ignore_eos": True},
    )
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 60


def test_32_concurrent_streams_each_equal_their_single_output(server, target):
    expected = [library(target, prompt, 16).text for prompt in PROMPTS]
    before = scrape(server)

    async def stream(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        chunks = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in chunks if chunk.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60) as aclient:
            return await asyncio.gather(*(stream(aclient, prompt) for prompt in PROMPTS))

    outputs = asyncio.run(run_all())
    assert outputs == expected
    health = wait_idle(server)
    assert health["status"] == "ok"
    after = scrape(server)
    steps = total(after, "verispec_batch_size_count") - total(before, "verispec_batch_size_count")
    sequences = total(after, "verispec_batch_size_sum") - total(before, "verispec_batch_size_sum")
    assert sequences / steps > 1.5  # the requests really shared target forwards
    drafted = total(after, "verispec_draft_tokens_total") - total(before, "verispec_draft_tokens_total")
    accepted = total(after, "verispec_accepted_tokens_total") - total(before, "verispec_accepted_tokens_total")
    assert 0 < accepted < drafted  # drafts were both kept and rejected on the way
    buckets = {labels: value for (name, labels), value in after.items() if name == "verispec_batch_size_bucket"}
    assert buckets[(("le", "8.0"),)] == buckets[(("le", "+Inf"),)]  # never more than --max-batch-size


# -- models, health, metrics ---------------------------------------------------------------------


def test_models_and_health(client, server):
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(f"{server}/health").status_code == 200
    assert wait_idle(server) == {"status": "ok", "active": 0, "waiting": 0}


def test_metrics_count_what_responses_report(client, server):
    wait_idle(server)
    before = scrape(server)
    response = client.completions.create(model=MODEL, prompt="total", max_tokens=20, temperature=0)
    wait_idle(server)  # the scheduler retires a request (and counts it) just after sending its last event
    after = scrape(server)
    for name in (
        "verispec_requests_total", "verispec_prompt_tokens_total", "verispec_generation_tokens_total",
        "verispec_draft_tokens_total", "verispec_accepted_tokens_total", "verispec_time_to_first_token_seconds_count",
        "verispec_time_per_output_token_seconds_count", "verispec_batch_size_count",
        "verispec_step_duration_seconds_count",
        "verispec_requests_active", "verispec_requests_waiting", "verispec_http_requests_total",
    ):
        assert any(sample_name == name for sample_name, _ in after), name

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    speculative = response.model_extra["speculative"]
    assert delta("verispec_requests_total") == 1
    assert delta("verispec_prompt_tokens_total") == response.usage.prompt_tokens
    assert delta("verispec_generation_tokens_total") == response.usage.completion_tokens
    assert delta("verispec_draft_tokens_total") == speculative["drafted_tokens"]
    assert delta("verispec_accepted_tokens_total") == speculative["accepted_tokens"]
    assert delta("verispec_batch_size_count") == speculative["target_forwards"]
    assert delta("verispec_steps_total") == speculative["target_forwards"]
    alone_k3 = ("verispec_steps_total", (("batch_size", "1"), ("k", "3")))  # --k 3, the only request
    assert after.get(alone_k3, 0) - before.get(alone_k3, 0) >= 1
    assert delta("verispec_time_to_first_token_seconds_count") == 1
    ok = ("verispec_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert after[ok] == before.get(ok, 0) + 1


# -- bad input -----------------------------------------------------------------------------------

LONG_PROMPT = "def add(a, b): " * 200  # well over the 512-token context


def oversized_chunks():
    """A body without Content-Length (chunked), larger than --max-request-bytes."""
    yield b'{"prompt": "'
    for _ in range(MAX_REQUEST_BYTES // 1024 + 1):
        yield b"a" * 1024
    yield b'"}'


class Bad(NamedTuple):
    request: str  # "METHOD /path"
    body: dict | bytes | Callable | None  # JSON, raw bytes, or a generator of chunks
    status: int
    code: str | None = None
    param: str | None = None
    content_type: str = "application/json"


COMPLETIONS, CHAT = "POST /v1/completions", "POST /v1/chat/completions"
CONTEXT_EXCEEDED, UNSUPPORTED = "context_length_exceeded", "unsupported_parameter"
IMAGE = [{"role": "user", "content": [{"type": "image_url"}]}]
LONG_CHAT = [{"role": "user", "content": LONG_PROMPT}]

BAD_REQUESTS = {
    "malformed-json": Bad(COMPLETIONS, b'{"prompt": ', 400),
    "body-is-a-list": Bad(COMPLETIONS, b"[1, 2]", 400),
    "body-is-null": Bad(CHAT, b"null", 400),
    "empty-body": Bad(COMPLETIONS, b"", 400),
    "not-utf8": Bad(COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400),
    "lone-surrogate": Bad(COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400),
    "deeply-nested": Bad(COMPLETIONS, b"[" * 50_000, 400),
    "nan": Bad(COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400),
    "text-content-type": Bad(COMPLETIONS, good(), 415, "unsupported_media_type", content_type="text/plain"),
    "unknown-model": Bad(COMPLETIONS, good(model="gpt-4"), 404, "model_not_found", "model"),
    "chat-unknown-model": Bad(CHAT, chat(model="gpt-4"), 404, "model_not_found", "model"),
    "missing-prompt": Bad(COMPLETIONS, {"model": MODEL}, 400, "missing_required_parameter", "prompt"),
    "missing-messages": Bad(CHAT, {"model": MODEL}, 400, "missing_required_parameter", "messages"),
    "empty-prompt": Bad(COMPLETIONS, good(prompt=""), 400, None, "prompt"),
    "empty-token-list": Bad(COMPLETIONS, good(prompt=[]), 400, None, "prompt"),
    "batched-prompts": Bad(COMPLETIONS, good(prompt=["a", "b"]), 400, None, "prompt"),
    "token-out-of-vocabulary": Bad(COMPLETIONS, good(prompt=[1, 10**9]), 400, None, "prompt"),
    "prompt-wrong-type": Bad(COMPLETIONS, good(prompt={"text": "x"}), 400, None, "prompt"),
    "empty-messages": Bad(CHAT, chat(messages=[]), 400, None, "messages"),
    "bad-role": Bad(CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, None, "messages[0].role"),
    "image-content": Bad(CHAT, chat(messages=IMAGE), 400, None, "messages[0].content"),
    "prompt-too-long": Bad(COMPLETIONS, good(prompt=LONG_PROMPT), 400, CONTEXT_EXCEEDED, "prompt"),
    "chat-too-long": Bad(CHAT, chat(messages=LONG_CHAT), 400, CONTEXT_EXCEEDED, "messages"),
    "max-tokens-zero": Bad(COMPLETIONS, good(max_tokens=0), 400, None, "max_tokens"),
    "max-tokens-negative": Bad(CHAT, chat(max_completion_tokens=-5), 400, None, "max_completion_tokens"),
    "max-tokens-float": Bad(COMPLETIONS, good(max_tokens=2.5), 400, None, "max_tokens"),
    "max-tokens-past-context": Bad(COMPLETIONS, good(max_tokens=CONTEXT), 400, CONTEXT_EXCEEDED, "max_tokens"),
    "chat-past-context": Bad(CHAT, chat(max_completion_tokens=CONTEXT), 400, CONTEXT_EXCEEDED, "max_completion_tokens"),
    "temperature-string": Bad(COMPLETIONS, good(temperature="hot"), 400, None, "temperature"),
    "temperature-high": Bad(CHAT, chat(temperature=2.5), 400, None, "temperature"),
    "temperature-negative": Bad(COMPLETIONS, good(temperature=-0.1), 400, None, "temperature"),
    "top-p-zero": Bad(COMPLETIONS, good(top_p=0), 400, None, "top_p"),
    "top-p-high": Bad(CHAT, chat(top_p=1.5), 400, None, "top_p"),
    "seed-string": Bad(COMPLETIONS, good(seed="abc"), 400, None, "seed"),
    "stream-string": Bad(COMPLETIONS, good(stream="yes"), 400, None, "stream"),
    "stop-number": Bad(COMPLETIONS, good(stop=5), 400, None, "stop"),
    "five-stops": Bad(COMPLETIONS, good(stop=["a", "b", "c", "d", "e"]), 400, None, "stop"),
    "n-past-the-batch": Bad(CHAT, chat(n=MAX_BATCH_SIZE + 1), 400, None, "n"),
    "n-zero": Bad(COMPLETIONS, good(n=0), 400, None, "n"),
    "best-of": Bad(COMPLETIONS, good(best_of=3), 400, UNSUPPORTED, "best_of"),
    "echo": Bad(COMPLETIONS, good(echo=True), 400, UNSUPPORTED, "echo"),
    "logprobs-too-many": Bad(COMPLETIONS, good(logprobs=21), 400, None, "logprobs"),
    "logprobs-negative": Bad(COMPLETIONS, good(logprobs=-1), 400, None, "logprobs"),
    "chat-top-logprobs-too-many": Bad(CHAT, chat(logprobs=True, top_logprobs=21), 400, None, "top_logprobs"),
    "chat-top-logprobs-without-logprobs": Bad(CHAT, chat(top_logprobs=2), 400, None, None),
    "presence-penalty-high": Bad(COMPLETIONS, good(presence_penalty=2.5), 400, None, "presence_penalty"),
    "frequency-penalty-string": Bad(CHAT, chat(frequency_penalty="-1"), 400, None, "frequency_penalty"),
    "repetition-penalty-zero": Bad(COMPLETIONS, good(repetition_penalty=0), 400, None, "repetition_penalty"),
    # Settings that overflow the scores to infinity (NaN probabilities) once ended every request in the batch.
    "temperature-tiny": Bad(COMPLETIONS, good(temperature=1e-40), 400, None, "temperature"),
    "repetition-penalty-tiny": Bad(CHAT, chat(repetition_penalty=1e-40), 400, None, "repetition_penalty"),
    "logit-bias-key": Bad(COMPLETIONS, good(logit_bias={"hello": 1}), 400, None, "logit_bias"),
    "logit-bias-value": Bad(CHAT, chat(logit_bias={"5": 150}), 400, None, "logit_bias"),
    "logit-bias-duplicate": Bad(CHAT, chat(logit_bias={"5": 1, "05": 2}), 400, None, "logit_bias"),
    "logit-bias-outside-vocabulary": Bad(COMPLETIONS, good(logit_bias={str(10**9): 1}), 400, None, "logit_bias"),
    "tools-without-tool-tokens": Bad(CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, None,
                                     "tools"),
    "functions-legacy": Bad(CHAT, chat(functions=[{"name": "f"}]), 400, UNSUPPORTED, "functions"),
    "schema-invalid": Bad(
        CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no"}}}),
        400, "invalid_json_schema", "response_format",
    ),
    "schema-missing": Bad(CHAT, chat(response_format={"type": "json_schema"}), 400, None, "response_format"),
    # A pattern too complex for the grammar's lexer compiles, gives a first mask, and fails once the string opens.
    **{f"schema-lexer-fails-after-the-first-token{'-streamed' * stream}": Bad(
        CHAT, chat(stream=stream, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}),
        400, "invalid_json_schema", "response_format",
    ) for stream in (False, True)},
    "schema-admits-no-value": Bad(
        COMPLETIONS, good(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
        400, "invalid_json_schema", "response_format",
    ),
    "schema-unnamed": Bad(
        COMPLETIONS, good(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), 400,
        "missing_required_parameter", "response_format.json_schema.name",
    ),
    "response-format-type": Bad(CHAT, chat(response_format={"type": "yaml"}), 400, None, "response_format.type"),
    "schema-with-ignore-eos": Bad(COMPLETIONS, good(response_format={"type": "json_object"}, ignore_eos=True), 400),
    "too-large": Bad(COMPLETIONS, good(prompt="a" * MAX_REQUEST_BYTES), 413, "request_too_large"),
    "too-large-chunked": Bad(COMPLETIONS, oversized_chunks, 413, "request_too_large"),
    "unknown-path": Bad("POST /v1/engines", good(), 404, "not_found"),
    "wrong-method": Bad("GET /v1/completions", None, 405, "method_not_allowed"),
    "post-to-health": Bad("POST /health", good(), 405, "method_not_allowed"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_gets_openai_error_and_server_keeps_serving(server, case):
    method, path = case.request.split()
    content = json.dumps(case.body).encode() if isinstance(case.body, dict) else case.body
    content = content() if callable(content) else content  # a generator: sent chunked, without Content-Length
    headers = {"content-type": case.content_type}
    response = httpx.request(method, f"{server}{path}", content=content, headers=headers, timeout=30)
    assert response.status_code == case.status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["code"] == case.code and error["param"] == case.param
    if case.status == 405:
        assert response.headers["allow"]
    after = httpx.post(f"{server}/v1/completions", json=good(), timeout=30)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] >= 1


# -- load and disconnects ------------------------------------------------------------------------


def test_full_queue_answers_429_and_closed_streams_free_their_slots(server):
    """More streams than batch + queue: the rest get 429; closing the accepted ones cancels them all."""
    body = good(max_tokens=CONTEXT - 16, temperature=0, stream=True, ignore_eos=True)
    count = 2 * (MAX_BATCH_SIZE + MAX_WAITING)
    wait_idle(server)
    before = scrape(server)

    async def run_all() -> list[tuple[int, dict | None, dict]]:
        answered = 0
        everyone_answered = asyncio.Event()

        async def one(client: httpx.AsyncClient) -> tuple[int, dict | None, dict]:
            nonlocal answered
            async with client.stream("POST", "/v1/completions", json=body) as response:
                payload = json.loads(await response.aread()) if response.status_code != 200 else None
                answered += 1
                if answered == count:
                    everyone_answered.set()
                await everyone_answered.wait()  # hold accepted streams open until all have an answer
                return response.status_code, payload, dict(response.headers)

        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(base_url=server, limits=limits, timeout=30) as client:
            return await asyncio.gather(*(one(client) for _ in range(count)))

    results = asyncio.run(run_all())
    statuses = [status for status, _, _ in results]
    assert set(statuses) == {200, 429}
    assert statuses.count(200) >= MAX_BATCH_SIZE + MAX_WAITING
    for status, payload, headers in results:
        if status == 429:
            assert payload["error"]["type"] == "rate_limit_error" and payload["error"]["code"] == "rate_limit_exceeded"
            assert headers["retry-after"] == "1"
    wait_idle(server, timeout=20)
    after = scrape(server)

    def finished(reason: str) -> float:
        key = ("verispec_requests_total", (("finish_reason", reason),))
        return after.get(key, 0) - before.get(key, 0)

    assert finished("cancelled") >= 1
    assert finished("cancelled") + finished("length") == statuses.count(200)  # every accepted stream ended


def test_client_leaving_a_stream_frees_its_slot(server):
    cancelled = ("verispec_requests_total", (("finish_reason", "cancelled"),))
    wait_idle(server)
    before = scrape(server).get(cancelled, 0)
    body = good(max_tokens=CONTEXT - 16, temperature=0, stream=True, ignore_eos=True)
    with httpx.Client(base_url=server, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            first = next(response.iter_lines())
            assert response.status_code == 200 and first.startswith("data: ")
    assert wait_idle(server)["status"] == "ok"
    assert scrape(server).get(cancelled, 0) == before + 1


def test_client_leaving_a_whole_response_frees_its_slot(server):
    cancelled = ("verispec_requests_total", (("finish_reason", "cancelled"),))
    wait_idle(server)
    before = scrape(server).get(cancelled, 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=good(max_tokens=CONTEXT - 16, ignore_eos=True), timeout=0.1)
    assert wait_idle(server)["status"] == "ok"
    assert scrape(server).get(cancelled, 0) == before + 1


# -- in-process: states the live server cannot show ----------------------------------------------


def test_no_chat_template_and_stopped_loop(target):
    """A model without a chat template answers chat with a 400; a scheduler that is not running gives 503s."""
    tokenizer = copy.deepcopy(target.tokenizer)
    tokenizer.chat_template = None
    plain = LoadedModel(target.name, target.model, tokenizer, target.eos_token_ids, target.directory)
    scheduler = Scheduler(plain, limits=SchedulerLimits(max_batch_size=1, max_context=64))  # never started
    app = create_app(scheduler, ServerMetrics(), ServerSettings(MODEL, MAX_REQUEST_BYTES))
    with TestClient(app) as http:
        response = http.post("/v1/chat/completions", json=chat())
        assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json=good())
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"


def test_framework_validation_errors_become_openai_400s():
    """FastAPI's own validation errors (loc starts with 'body') get the same 400 shape as ours."""
    fastapi_error = {"loc": ("body", "messages", 0, "role"), "msg": "Input should be 'user'", "type": "literal_error"}
    error = validation_error([fastapi_error])
    assert error.status == 400 and error.param == "messages[0].role"
    assert error.body()["error"] == {
        "message": "messages[0].role: Input should be 'user'", "type": "invalid_request_error",
        "param": "messages[0].role", "code": None,
    }


def test_serve_errors_are_messages_not_tracebacks(capsys, tiny_dir):
    assert main(["serve", "--target", "no-such-model", "--drafter", "none"]) == 2
    err = capsys.readouterr().err
    assert "neither a catalog name" in err and "Traceback" not in err
    assert main(["serve", "--target", str(tiny_dir), "--draft", "no-such-draft"]) == 2
    assert "no-such-draft" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", "--target", str(tiny_dir), "--drafter", "none", "--port", port]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "70000"])
    assert exit_info.value.code == 2


# -- the load benchmark --------------------------------------------------------------------------


def test_bench_serve_measures_each_level(server, tmp_path):
    workload = tmp_path / "prompts.jsonl"
    items = [{"id": "c1", "prompt": "def add(a, b):"}, {"id": "m1", "messages": [{"role": "user", "content": "hi"}]}]
    workload.write_text("\n".join(json.dumps(item) for item in items))
    out = tmp_path / "out"
    code = main([
        "bench-serve", "--server", f"a={server}/v1", "--server", f"b={server}/v1", "--workload", str(workload),
        "--concurrency", "1,3", "--requests-per-client", "1", "--max-tokens", "8", "--temperature", "0", "--out", str(out),
    ])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    levels = [(s["server"], s["concurrency"]) for s in results["summaries"]]
    assert sorted(levels) == [("a", 1), ("a", 3), ("b", 1), ("b", 3)]
    for summary, raw in zip(results["summaries"], results["raw"]):
        assert summary["errors"] == 0 and summary["requests"] == summary["concurrency"]
        assert summary["throughput_tokens_per_second"] > 0
        assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in raw["requests"])
        for record in raw["requests"]:
            assert 0 < record["completion_tokens"] <= 8 and record["text"]
            assert record["speculative"]["accepted_tokens"] <= record["speculative"]["drafted_tokens"]
            assert record["first_token"] <= record["finished"]
    assert "| a | 3 |" in (out / "report.md").read_text()
    assert all(s["same_text_as_a"] == 1.0 for s in results["summaries"])  # one greedy server, asked twice
    assert (out / "serving.png").stat().st_size > 0


def test_bench_serve_reports_an_unreachable_server(tmp_path, capsys):
    code = main(["bench-serve", "--server", f"x=http://127.0.0.1:{free_port()}/v1", "--out", str(tmp_path)])
    assert code == 2
    assert "is the server running" in capsys.readouterr().err
