"""The servers `verispec bench-serve` measures: started per turn when given a command, and their own counters.

A server named with `--start NAME=COMMAND` is started fresh for each of its turns and stopped after
it, so servers that would not fit in memory together (vLLM, llama.cpp, verispec) still take turns
in one run, and each turn starts from the same cold state. A start command that exits before the
server answers means the server cannot run here: its last output line is the reason, and the run
goes on with the others.

Speculative-decoding counters come from each server's own Prometheus endpoint, read before and after
a turn: llama.cpp (`llamacpp:spec_decode_*`) and vLLM (`vllm:spec_decode_*`) use the same names.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

# suffix of the counter's sample name -> our name for it
SPEC_COUNTERS = {
    "spec_decode_num_drafts_total": "drafts",
    "spec_decode_num_draft_tokens_total": "draft_tokens",
    "spec_decode_num_accepted_tokens_total": "accepted_tokens",
}


@dataclass(frozen=True)
class ServerSpec:
    name: str
    url: str  # the OpenAI base URL, e.g. http://127.0.0.1:8000/v1
    start_command: str | None = None  # shell command that starts it; None: already running

    @property
    def root(self) -> str:
        """The URL without the trailing /v1, where /metrics and /health live."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


class ServerUnavailable(RuntimeError):
    """A server that cannot be started or reached; the message says why in one line."""


class StartedServer:
    """A server process started for one turn (or nothing, for a server that runs on its own)."""

    def __init__(self, spec: ServerSpec, log_path: Path, timeout: float):
        self.spec = spec
        self.startup_seconds: float | None = None
        self._process: subprocess.Popen | None = None
        if spec.start_command is None:
            return
        log_path.parent.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        with open(log_path, "ab") as log:
            log.write(f"\n$ {spec.start_command}\n".encode())
            log.flush()
            # Its own process group, so stopping it stops whatever it started (workers, engine cores).
            self._process = subprocess.Popen(
                spec.start_command, shell=True, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_ready(log_path, timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - began

    def _wait_ready(self, log_path: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerUnavailable(
                    f"exited with code {self._process.returncode} before serving: {_last_line(log_path)}"
                )
            try:
                if httpx.get(self.spec.url.rstrip("/") + "/models", timeout=5, headers=client_headers()).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise ServerUnavailable(f"not serving {self.spec.url}/models after {timeout:.0f} s (log: {log_path})")

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self._process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self._process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        _wait_group_gone(self._process.pid)


def _wait_group_gone(group: int, timeout: float = 10.0) -> None:
    """Workers of the group can outlive its leader for a moment; the next server needs their memory."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no output)"
    return lines[-1][:300] if lines else "(no output)"


def client_headers() -> dict[str, str]:
    """What a benchmark client sends every server: the key in $VERISPEC_API_KEY (its first, if several) or
    $OPENAI_API_KEY, for servers started with keys; servers without keys ignore it."""
    key = (os.environ.get("VERISPEC_API_KEY", "").split(",")[0] or os.environ.get("OPENAI_API_KEY", "")).strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def model_of(url: str) -> str:
    """The first model a server lists; also checks that the server answers at all."""
    try:
        response = httpx.get(url.rstrip("/") + "/models", timeout=30, headers=client_headers())
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        raise ServerUnavailable(f"cannot list models at {url}/models ({error}); is the server running?") from None


def spec_counters(root: str) -> dict[str, float] | None:
    """The server's speculative-decoding counters (summed over labels), or None if it exports none."""
    try:
        response = httpx.get(root + "/metrics", timeout=10, headers=client_headers())
        if response.status_code != 200:
            return None
        families = list(text_string_to_metric_families(response.text))
    except (httpx.HTTPError, ValueError):
        return None
    counters: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            for suffix, key in SPEC_COUNTERS.items():
                if sample.name.endswith(suffix):
                    counters[key] = counters.get(key, 0.0) + sample.value
    return counters or None


def counter_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if after is None:
        return None
    before = before or {}
    return {key: value - before.get(key, 0.0) for key, value in after.items()}
