"""verispec on Ray Serve (verispec.serving.ray_serve): settings, the proxy's error middleware, the Serve
config file, and `verispec serve --replicas 2` itself with the packaged SmolLM2-135M (Ray marker)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:  # `make test` installs the ray extra: without it these tests fail, never skip
    import ray
except ImportError as error:
    raise ImportError("the ray extra is not installed: pip install -e '.[ray]'") from error

from verispec.cli import main  # noqa: E402
from verispec.models.catalog import CATALOG, is_installed  # noqa: E402
from verispec.serving import ray_serve  # noqa: E402
from verispec.serving.ray_serve import REPLICA_HEADER, OpenAIProxyErrors, ReplicaSettings, build_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "ray" / "serve-config.yaml"
MODEL = "smollm2-135m-instruct"


# -- settings, builder, config file ---------------------------------------------------------------


def test_fixed_replicas_and_autoscaling_settings():
    assert ReplicaSettings(replicas=3).autoscaling is None
    scaling = ReplicaSettings(replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=6).autoscaling
    assert scaling == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2, "target_ongoing_requests": 6}
    with pytest.raises(ValueError, match="min_replicas 3 exceeds max_replicas 2"):
        _ = ReplicaSettings(min_replicas=3, max_replicas=2).autoscaling
    with pytest.raises(ValueError):
        ReplicaSettings(replicas=0)
    with pytest.raises(ValueError):
        ReplicaSettings(unknown_field=1)  # a typo in a config file's args is an error, not ignored
    assert ReplicaSettings(k="4").k == 4  # `serve run ... k=4` passes strings
    assert ReplicaSettings(draft="none").drafter_name == "none"


def test_builder_sets_replicas_threads_and_batching():
    app = build_app({"target": MODEL, "draft": "none", "replicas": 2, "threads": 1, "max_batch_size": 8})
    deployment = app._bound_deployment
    assert deployment.name == "VerispecReplica"
    assert deployment.num_replicas == 2
    assert deployment.ray_actor_options["num_cpus"] == 1  # Ray places a replica where its threads fit
    assert deployment.max_ongoing_requests == 8  # beyond a replica's batch, requests wait at the proxy
    scaled = build_app({"target": MODEL, "min_replicas": 1, "max_replicas": 3, "threads": 2})._bound_deployment
    assert scaled._deployment_config.autoscaling_config.max_replicas == 3
    assert scaled._deployment_config.autoscaling_config.target_ongoing_requests == 8


@pytest.mark.parametrize("path", ["serve-config.yaml", "rayservice.yaml"])
def test_serve_config_files_are_valid_for_serve_run(path):
    """deploy/ray/serve-config.yaml (`serve run`, `serve deploy`) and the RayService's serveConfigV2 (KubeRay)."""
    import yaml
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    document = yaml.safe_load((CONFIG.parent / path).read_text())
    if document.get("kind") == "RayService":
        env = document["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "value": ray_serve.PROXY_CALLBACK} in env
        document = yaml.safe_load(document["spec"]["serveConfigV2"])
    config = ServeDeploySchema.model_validate(document)
    (application,) = config.applications
    module, name = application.import_path.split(":")
    assert (module, name) == ("verispec.serving.ray_serve", "build_app")
    app = call_user_app_builder_with_args_if_necessary(getattr(ray_serve, name), application.args)
    assert app._bound_deployment.name == application.deployments[0].name
    scaling = application.deployments[0].autoscaling_config
    assert scaling["min_replicas"] >= 1 and scaling["max_replicas"] >= scaling["min_replicas"]


def test_ray_missing_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[ray\]'"):
        ray_serve._import_serve()


def test_bad_replica_counts_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--replicas", "0"])
    assert exit_info.value.code == 2
    assert main(["serve", "--replicas", "3", "--threads", "2", "--target", MODEL, "--draft", "none"]) == 2
    assert "--threads 2 cannot be split among 3 replicas" in capsys.readouterr().err
    assert main(["serve", "--min-replicas", "3", "--max-replicas", "2", "--threads", "4", "--draft", "none"]) == 2
    assert "min_replicas 3 exceeds max_replicas 2" in capsys.readouterr().err


# -- the proxy's middleware -----------------------------------------------------------------------


def run_asgi(app) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(OpenAIProxyErrors(app)({"type": "http", "path": "/v1/completions"}, receive, send))
    return sent


def body_of(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_stream_cut_by_its_replica_ends_with_an_error_event():
    async def dying_replica(scope, receive, send):  # what Ray's proxy does when the replica dies mid-stream
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})

    sent = run_asgi(dying_replica)
    events = [line for line in body_of(sent).decode().split("\n\n") if line]
    assert events[0] == 'data: {"choices": []}'
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error"
    assert events[2] == "data: [DONE]"
    assert sent[-1]["more_body"] is False


def test_complete_streams_and_json_errors_pass_untouched():
    async def finished_stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    assert body_of(run_asgi(finished_stream)) == b"data: [DONE]\n\n"

    async def replica_error(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {"code": "model_not_found"}}'})

    sent = run_asgi(replica_error)
    assert sent[0]["status"] == 404 and json.loads(body_of(sent))["error"]["code"] == "model_not_found"


def test_the_proxys_own_errors_get_the_openai_shape():
    async def no_replica(scope, receive, send):  # Ray Serve's proxy: text bodies for 503 / backpressure
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": b"Service ", "more_body": True})
        await send({"type": "http.response.body", "body": b"unavailable", "more_body": False})

    sent = run_asgi(no_replica)
    assert sent[0]["status"] == 503
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"] == b"application/json" and headers[b"retry-after"] == b"1"
    error = json.loads(body_of(sent))["error"]
    assert error["code"] == "unavailable" and error["type"] == "server_error"


def test_prefix_keys_follow_the_first_characters_of_the_text():
    system = {"role": "system", "content": "You are the support assistant of a store. " * 40}
    ask = lambda question: json.dumps({"messages": [system, {"role": "user", "content": question}]}).encode()  # noqa: E731
    assert ray_serve.prefix_key(ask("Where is my order?")) == ray_serve.prefix_key(ask("Can I return boots?"))
    other = {"role": "system", "content": "You are the support assistant of another store. " * 40}
    assert ray_serve.prefix_key(json.dumps({"messages": [other]}).encode()) != ray_serve.prefix_key(ask("x"))
    assert ray_serve.prefix_key(b'{"prompt": "def f():"}') != ray_serve.prefix_key(b'{"prompt": "def g():"}')
    assert ray_serve.prefix_key(b"not json") is None and ray_serve.prefix_key(b'{"model": "m"}') is None


def test_the_proxy_tags_completions_with_their_prefix_key_and_replays_the_body():
    body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 4}).encode()
    seen = {}

    async def replica(scope, receive, send):
        seen["headers"] = dict(scope["headers"])
        seen["body"] = b""
        while True:
            message = await receive()
            seen["body"] += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    chunks = [{"type": "http.request", "body": body[:10], "more_body": True},
              {"type": "http.request", "body": body[10:], "more_body": False}]

    async def receive():
        return chunks.pop(0)

    async def send(message):
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-type", b"application/json")]}
    asyncio.run(ray_serve.PrefixAffinityKey(replica)(scope, receive, send))
    assert seen["body"] == body  # the replica reads the whole body, as sent
    assert seen["headers"][b"serve_multiplexed_model_id"] == ray_serve.prefix_key(body).encode()


# -- `verispec serve --replicas 2`, for real ------------------------------------------------------

RAY_PROCESS_MARKS = ("ray::", "/raylet", "gcs_server", "ray/dashboard", "log_monitor.py", "ray/autoscaler")


def ray_processes() -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(mark in cmdline for mark in RAY_PROCESS_MARKS):
            found.add(int(entry.name))
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.before = ray_processes()
        command = [
            sys.executable, "-m", "verispec.cli", "serve", "--replicas", "2", "--threads", "2", "--target", MODEL,
            "--draft", "none", "--quantize", "none", "--max-context", "2048", "--port", str(self.port),
            "--ray-metrics-port", str(self.metrics_port), "--prefix-affinity",
        ]
        self.log = open(os.environ.get("VERISPEC_RAY_TEST_LOG", os.devnull), "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, timeout: float = 300) -> None:
        """Until both replicas answer through the proxy: the first one up makes /health answer 200 while the
        second may still be loading (on a slow CPU, tens of seconds), and the router sends it nothing till then."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"verispec serve --replicas exited with {self.process.returncode}"
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200 and len(replica_pids(self.url)) == 2:
                    return
            except (httpx.HTTPError, ValueError):  # not up yet, or an error page instead of JSON
                pass
            time.sleep(1)
        raise AssertionError(f"the two replicas were not both up within {timeout} s")

    def stop(self, timeout: float = 90) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            self.log.close()

    def leftovers(self, timeout: float = 30) -> set[int]:
        """Ray processes started since the cluster was, still there after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := ray_processes() - self.before) and time.monotonic() < deadline:
            time.sleep(1)
        return left


@pytest.fixture(scope="module")
def cluster():
    if not is_installed(CATALOG[MODEL]):
        pytest.fail(f"{MODEL} is not installed: run `make models`")
    running = Cluster()
    try:
        running.wait_ready()
        yield running
    finally:
        if running.process.poll() is None:  # a test failed before the shutdown test: clean up anyway
            try:
                running.stop()
            except subprocess.TimeoutExpired:
                running.process.kill()
            for pid in running.leftovers(10):
                os.kill(pid, signal.SIGKILL)


def replica_pids(url: str) -> dict[str, int]:
    """{replica id: pid}, asked through the proxy concurrently until both replicas answered."""
    import httpx

    pids: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(10):
            for answer in pool.map(lambda _: httpx.get(f"{url}/replica", timeout=10).json(), range(16)):
                pids[answer["replica"]] = answer["pid"]
            if len(pids) >= 2:
                break
    return pids


@pytest.mark.ray
@pytest.mark.real
def test_requests_spread_over_both_replicas_with_the_same_routes(cluster):
    import httpx

    def complete(index: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"def add_{index}(a, b):", "max_tokens": 24, "temperature": 0}
        return httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(complete, range(16)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    assert all(r.json()["object"] == "text_completion" and r.json()["usage"]["completion_tokens"] > 0
               for r in responses)
    assert len({r.headers[REPLICA_HEADER] for r in responses}) == 2  # both replicas served

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=chat, timeout=120) as stream:
        assert stream.status_code == 200 and stream.headers[REPLICA_HEADER]
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0].removeprefix("data: "))
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"

    wrong = httpx.post(f"{cluster.url}/v1/completions", json={"model": "gpt-4", "prompt": "x"}, timeout=60)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    assert wrong.headers[REPLICA_HEADER]


@pytest.mark.ray
@pytest.mark.real
def test_prefix_affinity_keeps_each_prefix_on_one_replica(cluster):
    import httpx

    def served_by(store: str, question: str) -> str:
        system = {"role": "system", "content": f"You answer for {store}. Be brief and exact. " * 30}
        body = {"messages": [system, {"role": "user", "content": question}], "max_tokens": 2}
        response = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.headers[REPLICA_HEADER]

    served = {"north": [], "south": [], "east": []}
    for question in ("Hi", "Where is my order?", "Can I return it?", "Thanks"):
        for store in served:
            served[store].append(served_by(store, question))
            time.sleep(0.5)  # the router learns a replica's keys through the controller
    assert all(len(set(replicas[1:])) == 1 for replicas in served.values()), served
    # A new key goes to a replica with the fewest keys. The earlier tests may have left one replica with
    # more keys than the other (their requests came at once, before the router learned any), so new keys
    # go to the other replica until both hold as many; after that, new keys reach both replicas.
    new_keys = []
    for store in range(48):
        new_keys.append(served_by(f"store {store}", "Hi"))
        time.sleep(0.5)
        if len(set(new_keys)) == 2:
            break
    assert len(set(new_keys)) == 2, new_keys


@pytest.mark.ray
@pytest.mark.real
def test_metrics_per_replica_through_rays_metrics(cluster):
    """The Ray node's Prometheus endpoint: each replica's verispec counters and Ray Serve's own, tagged replica."""
    import httpx

    pids = replica_pids(cluster.url)
    deadline = time.monotonic() + 90  # replicas copy every 5 s, Ray's agent exports every ~10 s
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).text
        ours = {replica: [line for line in text.splitlines()
                          if line.startswith("ray_verispec_generation_tokens_total{") and replica in line]
                for replica in pids}
        healthy = [line for line in text.splitlines() if line.startswith("ray_serve_deployment_replica_healthy{")]
        if all(ours.values()) and len(healthy) >= 2:
            break
        time.sleep(3)
    assert all(ours.values()), f"no per-replica verispec metrics for {[r for r, v in ours.items() if not v]}"
    assert sum(float(lines[0].rsplit(" ", 1)[1]) for lines in ours.values()) > 0  # the tokens generated above
    assert len(healthy) >= 2


@pytest.mark.ray
@pytest.mark.real
def test_a_replica_killed_mid_stream(cluster):
    """Its stream ends with an error event; new requests go to the survivor; Ray Serve starts a new replica."""
    import httpx

    pids = replica_pids(cluster.url)
    assert len(pids) == 2, pids
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0.8, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as stream:
        victim = stream.headers[REPLICA_HEADER]
        for line in stream.iter_lines():  # a read that waits 60 s fails the test: a hang
            if not line:
                continue
            events.append(line)
            if len(events) == 5:
                os.kill(pids[victim], signal.SIGKILL)
                killed = time.monotonic()
    assert time.monotonic() - killed < 30
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed"
    assert len(events) < 1000  # cut well before its 1,500 tokens

    survivor = next(replica for replica in pids if replica != victim)
    for index in range(4):  # new requests: the survivor answers, none fails
        response = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": f"{index} + 1 =", "max_tokens": 4},
                              timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers[REPLICA_HEADER] != victim
    deadline = time.monotonic() + 300  # a new replica starts as the first ones did (wait_ready): minutes under load
    while time.monotonic() < deadline:
        now = replica_pids(cluster.url)
        if len(now) == 2 and victim not in now:
            break
        time.sleep(2)
    assert len(now) == 2 and victim not in now and survivor in now, now  # a new replica replaced the dead one


@pytest.mark.ray
@pytest.mark.real
def test_clean_shutdown_leaves_no_ray_processes(cluster):
    assert cluster.stop() == 0
    assert cluster.leftovers() == set()
