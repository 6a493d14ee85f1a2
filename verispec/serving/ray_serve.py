"""verispec on Ray Serve: N replicas of the server (models + scheduler each) behind Ray Serve's HTTP proxy.

Ray Serve does the distributed work: it places the replicas (one Ray actor each, `num_cpus` = its
threads), routes each HTTP request to one of them (power of two choices on their queue lengths),
autoscales between min and max replicas on ongoing requests, health-checks the replicas and
restarts the ones that die. Each replica runs the same FastAPI app as `verispec serve` alone
(`create_app`), so routes, streaming and error shapes are the same, over its own scheduler whose
models are loaded and run in one thread (`start_in_model_thread`). Two things are added:

- every response names the replica that served it in an `x-verispec-replica` header;
- `proxy_middlewares` (installed in Ray Serve's proxy through RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH):
  a stream whose replica died mid-way ends with an OpenAI error event and `data: [DONE]` instead of
  a cut connection, and the proxy's own error pages (no replica available, backpressure) are
  answered in OpenAI's error shape.

`build_app` is the application builder for `serve run` and Serve config files
(`import_path: verispec.serving.ray_serve:build_app`); `run_replicas` is `verispec serve --replicas N`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

REPLICA_HEADER = "x-verispec-replica"
DEPLOYMENT_NAME = "VerispecReplica"
APP_NAME = "verispec"
PROXY_CALLBACK = "verispec.serving.ray_serve:proxy_middlewares"
RAY_MISSING = "Ray Serve is not installed; install the extra: pip install -e '.[ray]' (ray[serve] >= 2.40)"


def _import_serve():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise RuntimeError(RAY_MISSING) from None
    return ray, serve


class ReplicaSettings(BaseModel):
    """What one replica serves, and how many replicas: the builder's args (`serve run`, a config file's `args`)."""

    model_config = ConfigDict(extra="forbid")

    target: str = "qwen2.5-coder-1.5b-instruct"  # catalog name, .gguf file or HF directory, on every node
    draft: str | None = "qwen2.5-coder-0.5b-instruct"  # draft model ("none": plain decoding)
    drafter: str | None = None  # one of scheduler.SERVED_DRAFTERS; None: the default (composite, or none without a draft)
    dtype: str = "auto"
    quantize: str = "auto"
    draft_quantize: str = "auto"
    draft_vocab: str | int = "full"
    k: int | Literal["auto"] = "auto"
    k_max: int = Field(8, ge=1)
    draft_p_min: float = Field(0.0, ge=0.0, le=1.0)  # a row's draft ends where the draft is less sure than this
    max_batch_size: int = Field(16, ge=1)  # per replica
    max_waiting: int = Field(64, ge=1)  # per replica; beyond it the replica answers 429
    max_context: int = Field(4096, ge=1)
    prefix_cache_mb: int = Field(512, ge=0)
    chunked_prefill: bool | None = None  # None: on where the target is batch-invariant (see build_scheduler)
    max_request_bytes: int = Field(1 << 20, ge=1)
    served_model_name: str | None = None  # the model id clients send (default: the target's catalog or file name)
    api_keys: list[str] = []  # every /v1 request needs `Authorization: Bearer <one of them>` (empty: open)
    metrics_need_key: bool = False
    body_timeout: float = Field(30.0, gt=0)  # seconds a request body gets to arrive (the proxy's read)
    request_timeout: float | None = Field(600.0, gt=0)  # a request still generating then ends with finish_reason length
    keep_alive_timeout: float = Field(5.0, gt=0)  # the proxy's idle keep-alive connections
    allowed_origins: list[str] = []
    allowed_hosts: list[str] = []
    docs: bool = False
    access_log: str = "text"  # each replica's access log: text, json or off
    threads: int = Field(1, ge=1)  # torch threads per replica; also the replica's Ray num_cpus
    replicas: int = Field(1, ge=1)  # fixed replica count, unless min/max replicas ask for autoscaling
    min_replicas: int | None = Field(None, ge=0)  # autoscaling: at least this many
    max_replicas: int | None = Field(None, ge=1)  # autoscaling: at most this many
    target_ongoing_requests: float = Field(8.0, gt=0)  # autoscaling: requests in flight per replica it aims at
    max_ongoing_requests: int | None = Field(None, ge=1)  # sent to one replica at once (default max_batch_size)
    prefix_affinity: bool = False  # route requests sharing their first 1,000 characters to one replica

    @field_validator("k", mode="before")
    @classmethod
    def _k(cls, value: Any) -> Any:
        return int(value) if isinstance(value, str) and value.isdigit() else value

    @field_validator("draft_vocab", mode="before")
    @classmethod
    def _draft_vocab(cls, value: Any) -> Any:
        from verispec.drafters.draft_vocab import parse_vocab

        return parse_vocab(str(value))

    @property
    def autoscaling(self) -> dict | None:
        """Ray Serve's autoscaling_config, or None for a fixed `replicas`."""
        if self.min_replicas is None and self.max_replicas is None:
            return None
        low = self.min_replicas if self.min_replicas is not None else 1
        high = self.max_replicas if self.max_replicas is not None else max(low, self.replicas)
        if low > high:
            raise ValueError(f"min_replicas {low} exceeds max_replicas {high}")
        return {
            "min_replicas": low, "max_replicas": high, "initial_replicas": min(max(self.replicas, low), high),
            "target_ongoing_requests": self.target_ongoing_requests,
        }

    def server_settings(self):
        """How each replica's app faces its clients (verispec.serving.guard.ServerSettings)."""
        from verispec.serving.guard import ServerSettings, served_model_name

        return ServerSettings(
            model_name=self.served_model_name or served_model_name(self.target),
            max_request_bytes=self.max_request_bytes, api_keys=tuple(self.api_keys),
            metrics_need_key=self.metrics_need_key, body_timeout=self.body_timeout,
            request_timeout=self.request_timeout, allowed_origins=tuple(self.allowed_origins),
            allowed_hosts=tuple(self.allowed_hosts), docs=self.docs, access_log=self.access_log,
        )

    @property
    def drafter_name(self) -> str:
        from verispec.drafters import drafter_for

        return drafter_for(self.drafter, self.draft)


class ReplicaHeader:
    """ASGI middleware: every HTTP response carries `x-verispec-replica: <replica id>`.

    claim: with prefix affinity, called with the request's prefix key (Ray Serve's multiplexed model
    id) before it is served, so the router learns that this replica holds that prefix.
    """

    def __init__(self, app, replica: str, claim: Callable[[str], Any] | None = None) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())
        self.claim = claim

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.claim is not None:
            from ray import serve

            key = serve.get_multiplexed_model_id()
            if key:
                await self.claim(key)

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def _error_body(status: int, message: str, code: str) -> bytes:
    kind = "rate_limit_error" if status == 429 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class OpenAIProxyErrors:
    """ASGI middleware for Ray Serve's proxy: failures that happen outside any replica, in OpenAI's shapes.

    - A streamed response (text/event-stream) that stops before its last body message (its replica
      died: Ray Serve's proxy then just returns) ends with an error event and `data: [DONE]`, as a
      replica's own failing stream does, so clients see an error instead of a cut connection.
    - An error response of the proxy itself (not JSON: no replica available, backpressure, a replica
      that died before answering) is answered as {"error": {...}} with the same status.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"start": None, "streaming": False, "rewrite": False, "done": False}

        async def guarded_send(message) -> None:
            if message["type"] == "http.response.start":
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                content_type = headers.get(b"content-type", b"").split(b";")[0].strip()
                state["streaming"] = content_type == b"text/event-stream"
                state["rewrite"] = message["status"] >= 400 and not content_type.endswith(b"json")
                if state["rewrite"]:
                    state["start"] = message  # sent once the body is known
                    return
                state["start"] = message
            elif message["type"] == "http.response.body":
                if state["rewrite"]:
                    if message.get("more_body", False):
                        return  # the proxy's text body is replaced whole
                    await _send_error(send, state["start"]["status"], state["start"].get("headers", []))
                    state["done"] = True
                    return
                if not message.get("more_body", False):
                    state["done"] = True
            await send(message)

        await self.app(scope, receive, guarded_send)
        if state["start"] is not None and not state["done"] and state["streaming"]:
            body = _error_body(502, "the replica serving this stream failed before it finished", "replica_failed")
            await send({"type": "http.response.body", "body": b"data: " + body + b"\n\ndata: [DONE]\n\n",
                        "more_body": False})


async def _send_error(send, status: int, headers: list) -> None:
    code = {429: "rate_limit_exceeded", 503: "unavailable", 504: "timeout", 408: "timeout"}.get(status, "proxy_error")
    messages = {
        429: "too many requests are queued for the replicas; retry later",
        503: "no replica can take the request now (starting, restarting or overloaded); retry later",
    }
    body = _error_body(status, messages.get(status, f"the Ray Serve proxy answered HTTP {status}"), code)
    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"content-length")]
    await send({"type": "http.response.start", "status": status,
                "headers": [*kept, (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


AFFINITY_HEADER = b"serve_multiplexed_model_id"  # Ray Serve routes on it (model multiplexing)
AFFINITY_PATHS = ("/v1/completions", "/v1/chat/completions")
AFFINITY_CHARS = 1000  # requests whose text agrees on this many first characters share a key
AFFINITY_MAX_BODY = 1 << 20  # larger bodies get no key (the replica refuses them anyway)


def prefix_key(body: bytes, chars: int = AFFINITY_CHARS) -> str | None:
    """The affinity key of an OpenAI request body: a hash of its text's first `chars` characters, or None."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if isinstance(request.get("messages"), list):
        text = "".join(
            f"<{m.get('role')}>{m.get('content') if isinstance(m.get('content'), str) else json.dumps(m.get('content'))}"
            for m in request["messages"] if isinstance(m, dict)
        )
    elif isinstance(request.get("prompt"), str):
        text = request["prompt"]
    elif isinstance(request.get("prompt"), list):
        text = json.dumps(request["prompt"][:chars])
    else:
        return None
    import hashlib

    return "prefix-" + hashlib.blake2b(text[:chars].encode(), digest_size=8).hexdigest()


class PrefixAffinityKey:
    """ASGI middleware for Ray Serve's proxy: tags each completion request with its prompt prefix's key.

    The key goes in the `serve_multiplexed_model_id` header, so Ray Serve's router sends requests with
    the same key to the replica that served it before (while that replica has room below
    max_ongoing_requests), where the prefix cache holds its keys and values. Replicas only claim keys
    when their settings have prefix_affinity on; otherwise the header routes nothing.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").endswith(AFFINITY_PATHS) \
                or any(name.lower() == AFFINITY_HEADER for name, _ in scope.get("headers", [])):
            await self.app(scope, receive, send)
            return
        buffered, size = [], 0
        while True:  # the body, kept to be replayed to the replica
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if not message.get("more_body", False) or size > AFFINITY_MAX_BODY:
                break
        key = None
        if size <= AFFINITY_MAX_BODY and buffered[-1]["type"] == "http.request":
            key = prefix_key(b"".join(m.get("body", b"") for m in buffered))
        if key is not None:
            scope = {**scope, "headers": [*scope.get("headers", []), (AFFINITY_HEADER, key.encode())]}

        async def replay():
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)


def proxy_middlewares() -> list:
    """RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH's callback: the middlewares Ray Serve's proxies install."""
    from starlette.middleware import Middleware

    return [Middleware(OpenAIProxyErrors), Middleware(PrefixAffinityKey)]


class RayMetricsBridge:
    """Copies a replica's verispec metrics into Ray's metrics every `period` seconds, tagged with the replica.

    Ray exports them with every node's metrics (its metrics export port, which Prometheus scrapes:
    see deploy/ray/README.md) as `ray_<sample name>` gauges, tagged deployment, replica and
    application beside verispec's own labels: counters and histogram buckets keep their cumulative
    values, so rate() and histogram_quantile() work on them as on the single server's /metrics.
    """

    def __init__(self, metrics, scheduler, period: float = 5.0) -> None:
        self.metrics = metrics
        self.scheduler = scheduler
        self.period = period
        self._gauges: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verispec-ray-metrics", daemon=True)
        self._thread.start()

    def copy(self) -> None:
        from ray.serve.metrics import Gauge

        self.metrics.set_queue(self.scheduler.num_active, self.scheduler.num_waiting)
        for family in self.metrics.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                gauge = self._gauges.get(sample.name)
                if gauge is None:
                    description = f"{family.documentation} ({family.type} sample, per replica)"
                    gauge = Gauge(sample.name, description, tag_keys=tuple(sorted(sample.labels)))
                    self._gauges[sample.name] = gauge
                gauge.set(sample.value, tags=dict(sample.labels))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.copy()

    def stop(self) -> None:
        self._stop.set()


class VerispecReplica:
    """One replica: the models and scheduler (one thread of their own) and the OpenAI app over them."""

    def __init__(self, settings: dict) -> None:
        from ray import serve

        from verispec.serving.metrics import ServerMetrics
        from verispec.serving.scheduler import SchedulerLimits, build_scheduler, start_in_model_thread

        self.settings = s = ReplicaSettings.model_validate(settings)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.metrics = ServerMetrics()
        drafter = s.drafter_name
        limits = SchedulerLimits(s.max_batch_size, s.max_waiting, s.max_context, s.prefix_cache_mb << 20)
        self.scheduler = start_in_model_thread(lambda: build_scheduler(
            s.target, s.draft, drafter, s.dtype, s.draft_quantize, s.k, s.k_max, limits, self.metrics,
            quantize=s.quantize, chunked_prefill=s.chunked_prefill, draft_vocab=s.draft_vocab,
            foreign_draft_crosses=s.drafter is None, draft_p_min=s.draft_p_min,
        ), s.threads)
        if self.scheduler.target.format is not None:
            self.metrics.set_target(self.scheduler.target.format.as_dict())
        self.metrics_bridge = RayMetricsBridge(self.metrics, self.scheduler)
        self.claim_prefix = None
        if s.prefix_affinity:  # Ray Serve's model multiplexing, with prefix keys for models: the last 64 stay

            async def hold(key: str) -> str:
                return key

            self.claim_prefix = serve.multiplexed(max_num_models_per_replica=64)(hold)

    def __serve_build_asgi_app__(self):
        from verispec.serving.app import create_app
        from verispec.serving.http import configure_server_logging

        s = self.settings
        configure_server_logging()
        app = create_app(self.scheduler, self.metrics, s.server_settings())

        @app.get("/replica")
        async def replica() -> dict:
            """Which replica answered, its process and load (through the proxy: any one replica)."""
            return {
                "replica": self.replica_id, "pid": os.getpid(), "threads": s.threads,
                "healthy": self.scheduler.healthy, "active": self.scheduler.num_active,
                "waiting": self.scheduler.num_waiting,
            }

        return ReplicaHeader(app, self.replica_id, self.claim_prefix)

    def check_health(self) -> None:
        """Ray Serve calls this every health_check_period_s; raising marks the replica unhealthy (restarted)."""
        if not self.scheduler.healthy:
            raise RuntimeError(f"replica {self.replica_id}: the decoding loop died: {self.scheduler.failure!r}")

    def __del__(self) -> None:
        bridge = getattr(self, "metrics_bridge", None)
        if bridge is not None:
            bridge.stop()
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.stop()


def deployment(settings: ReplicaSettings):
    """The Ray Serve deployment of VerispecReplica, with its replica count (or autoscaling) and resources."""
    _, serve = _import_serve()
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": settings.threads},
        "max_ongoing_requests": settings.max_ongoing_requests or settings.max_batch_size,
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": 10,
    }
    autoscaling = settings.autoscaling
    if autoscaling is None:
        options["num_replicas"] = settings.replicas
    else:
        options["autoscaling_config"] = autoscaling
    return serve.deployment(serve.ingress()(VerispecReplica), **options)


def build_app(args: ReplicaSettings):
    """Application builder: `serve run verispec.serving.ray_serve:build_app target=... replicas=2`."""
    settings = args if isinstance(args, ReplicaSettings) else ReplicaSettings.model_validate(args)
    return deployment(settings).bind(settings.model_dump())


def run_replicas(
    settings: ReplicaSettings, host: str, port: int, ray_address: str | None = None,
    ready: Callable[[str], None] | None = None, metrics_port: int | None = None,
) -> None:
    """Serve `settings` on Ray Serve until SIGINT or SIGTERM, then delete the app (and stop a local Ray).

    ray_address None starts a local Ray instance with settings.threads x replicas CPUs (stopped at the
    end); an address ("auto", "ray://host:10001", "host:6379") joins that cluster, whose nodes need
    verispec and the models installed, and leaves it running. metrics_port: where the local Ray node
    exports its metrics (Ray's, and each replica's verispec metrics) for Prometheus; None: Ray picks one.
    """
    ray, serve = _import_serve()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    local = ray_address is None
    try:
        if local:
            # The proxy installs OpenAIProxyErrors; its actor inherits this process's environment.
            os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", PROXY_CALLBACK)
            autoscaling = settings.autoscaling
            most = autoscaling["max_replicas"] if autoscaling else settings.replicas
            ray.init(num_cpus=settings.threads * most, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _metrics_export_port=metrics_port)
        else:
            ray.init(address=ray_address, log_to_driver=False, configure_logging=False)
        for sig in previous:  # again: ray.init installed Ray's own SIGTERM handler, which skips the cleanup below
            signal.signal(sig, lambda *_: stop.set())
        serve.start(http_options={"host": host, "port": port, "keep_alive_timeout_s": settings.keep_alive_timeout})
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
        if ready is not None:
            ready(f"http://{host}:{port}/v1")
        while not stop.wait(0.5):
            pass
    finally:
        try:
            if ray.is_initialized():
                if local:
                    serve.shutdown()
                else:
                    serve.delete(APP_NAME)
        finally:
            if ray.is_initialized():
                ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
