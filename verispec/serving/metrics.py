"""Prometheus metrics of one server: what the scheduler reports each step, and what the HTTP layer sees.

Every instance has its own registry, so servers (and tests) never share counters. Draft
positions are 0-based: position 0 is the first token of a draft; accepted / drafted per
position is the acceptance rate at that depth (it includes rejections further up the draft).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from verispec.core.step_record import StepRecord

CONTENT_TYPE = CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self._target = Info("verispec_target", "how the target runs: weight format, dtype, load time", registry=registry)
        # The HTTP layer.
        self._http_requests = Counter(
            "verispec_http_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"],
            registry=registry,
        )
        self._errors = Counter(
            "verispec_errors", "error responses by OpenAI error type and code", ["type", "code"], registry=registry
        )
        # Requests and tokens.
        self._requests_finished = Counter(
            "verispec_requests", "generation requests finished, by finish reason", ["finish_reason"],
            registry=registry,
        )
        self._prompt_tokens = Counter("verispec_prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self._generation_tokens = Counter("verispec_generation_tokens", "tokens generated", registry=registry)
        # Speculation.
        self._drafted = Counter(
            "verispec_draft_tokens", "draft tokens proposed, by draft position (0-based)", ["position"],
            registry=registry,
        )
        self._accepted = Counter(
            "verispec_accepted_tokens", "draft tokens accepted, by draft position (0-based)", ["position"],
            registry=registry,
        )
        self._target_forwards = Counter(
            "verispec_target_forwards", "batched target forwards (one per scheduler step)", registry=registry
        )
        self._steps = Counter(
            "verispec_steps", "scheduler steps by batch size and draft length k (how the controller adapts)",
            ["batch_size", "k"], registry=registry,
        )
        # Latency and batching.
        self._time_to_first_token = Histogram(
            "verispec_time_to_first_token_seconds", "submit to first generated token", buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._token_latency = Histogram(
            "verispec_time_per_output_token_seconds", "inter-token latency (a step's time spread over its tokens)",
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self._batch_size = Histogram(
            "verispec_batch_size", "sequences per batched target forward", buckets=BATCH_BUCKETS, registry=registry
        )
        self._step_duration = Histogram(
            "verispec_step_duration_seconds", "one scheduler step: draft, verify, accept", buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._active = Gauge("verispec_requests_active", "requests being decoded", registry=registry)
        # Prefix reuse.
        self._prefix_tokens = Counter(
            "verispec_prefix_cache_tokens", "prompt tokens looked up in the prefix cache: hit (keys and values "
            "reused) or miss (prefilled)", ["result"], registry=registry,
        )
        self._prefix_bytes = Gauge("verispec_prefix_cache_bytes", "memory the prefix cache holds", registry=registry)
        self._waiting = Gauge("verispec_requests_waiting", "requests queued for a batch slot", registry=registry)

    # -- called by the scheduler (its thread) -----------------------------------------------------

    def set_target(self, model_format: dict) -> None:
        """model_format: LoadedModel.format.as_dict(); exported as labels of verispec_target_info."""
        self._target.info({k: str(v) for k, v in model_format.items() if not isinstance(v, dict)})

    def step(self, record: StepRecord) -> None:
        """One batched target forward: its rows, the draft positions they drafted and had accepted, its seconds."""
        batch_size, drafted_by_position = len(record.rows), record.drafted_by_position
        self._target_forwards.inc()
        self._steps.labels(batch_size=str(batch_size), k=str(len(drafted_by_position))).inc()
        self._batch_size.observe(batch_size)
        self._step_duration.observe(record.seconds)
        for position, count in enumerate(drafted_by_position):
            if count:
                self._drafted.labels(position=str(position)).inc(count)
        for position, count in enumerate(record.accepted_by_position):
            if count:
                self._accepted.labels(position=str(position)).inc(count)

    def first_token(self, seconds: float) -> None:
        self._time_to_first_token.observe(seconds)

    def token_latency(self, seconds_per_token: float, tokens: int) -> None:
        for _ in range(tokens):
            self._token_latency.observe(seconds_per_token)

    def tokens_generated(self, count: int) -> None:
        self._generation_tokens.inc(count)

    def request_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """completion_tokens is already counted, token by token, through tokens_generated."""
        self._requests_finished.labels(finish_reason=finish_reason).inc()
        self._prompt_tokens.inc(prompt_tokens)

    def prefix_lookup(self, hit_tokens: int, missed_tokens: int, cache_bytes: int) -> None:
        self._prefix_tokens.labels(result="hit").inc(hit_tokens)
        self._prefix_tokens.labels(result="miss").inc(missed_tokens)
        self._prefix_bytes.set(cache_bytes)

    def set_queue(self, active: int, waiting: int) -> None:
        self._active.set(active)
        self._waiting.set(waiting)

    # -- called by the HTTP layer -----------------------------------------------------------------

    def http_request(self, endpoint: str, status: int) -> None:
        self._http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    def error(self, type: str, code: str | None) -> None:
        self._errors.labels(type=type, code=code or "").inc()

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode("utf-8")
