"""Tiny random-weight models (Qwen2 and Llama layouts) with a small byte-level BPE tokenizer."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

from verispec.models import w4a8
from verispec.models.linear import w8a8_available

# The batch-invariant target formats that run here: w8a8 where oneDNN's int8 sums are exact (VNNI or AMX),
# w4a8 where its kernel builds (AVX-512 VNNI or AVX2); FAST_FORMAT the first (where none runs, loading w4a8
# says why).
FAST_FORMATS = [f for f, runs in [("w8a8", w8a8_available()), ("w4a8", w4a8.unavailable_reason() is None)] if runs]
FAST_FORMAT = next(iter(FAST_FORMATS), "w4a8")

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def greet(name):\n    print('hello ' + name)\n",
    "for i in range(10):\n    total += i * i\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20


BENCHMARK_SCRIPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts"


def benchmark_script(name: str, folder: str = "scripts") -> ModuleType:
    """benchmarks/<folder>/<name>.py loaded as a module (the scripts are not a package)."""
    path = BENCHMARK_SCRIPTS.parent / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def study() -> ModuleType:
    """benchmarks/draft_head/study.py: the draft head's data, training and measurement."""
    return benchmark_script("study", folder="draft_head")


def build_tokenizer(directory: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    tokenizer.save_pretrained(directory)
    return tokenizer


def build_tiny_model(directory: Path, seed: int, model_type: str = "qwen2", layers: int = 2) -> Path:
    """Save a random-weight causal LM plus tokenizer as a Hugging Face safetensors directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    config_class = Qwen2Config if model_type == "qwen2" else LlamaConfig
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=model_type == "llama",
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # default init is too flat to give interesting distributions
        for param in model.parameters():
            param.mul_(3.0)
    model.save_pretrained(directory)
    return directory


# `make test` runs two pytest-xdist workers on these 2-core machines, a test file to a worker (--dist loadfile, with
# the scheduler below), so a module's expensive fixtures (a loaded real model, a server process, a Ray cluster)
# are built once. The tiny models' steps are Python-bound:
# one torch thread each runs them faster than two (no OpenMP hand-offs), and two workers use both cores.
# Tests of the packaged models take the cores no other worker is using (real_thread_count): two workers of two
# threads each on two cores run a real model 5-10x slower (OpenMP threads wait for a descheduled peer), and one
# thread where the other worker has finished leaves a core idle for the suite's longest stretch.
torch.set_num_threads(1)
FINISHED_WORKERS = "VERISPEC_TEST_FINISHED_WORKERS"  # a folder where each xdist worker leaves a file when it is done


def real_thread_count() -> int:
    """Torch threads for a packaged-model test now: the cores shared among the xdist workers still running."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    folder = os.environ.get(FINISHED_WORKERS)
    finished = len(os.listdir(folder)) if folder and os.path.isdir(folder) else 0
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers - finished))


def pytest_configure(config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ and FINISHED_WORKERS not in os.environ:  # the controller, before
        import tempfile                                                               # its workers start

        os.environ[FINISHED_WORKERS] = config.verispec_finished_workers = tempfile.mkdtemp(prefix="verispec-workers-")


def pytest_sessionfinish(session) -> None:
    worker, folder = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(FINISHED_WORKERS)
    if worker and folder and os.path.isdir(folder):
        Path(folder, worker).touch()


def pytest_unconfigure(config) -> None:
    folder = getattr(config, "verispec_finished_workers", None)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(FINISHED_WORKERS, None)

# Tests of the packaged models all run on one worker, one module after another: two workers that each held a float32
# pair (8 GB) or the default pair beside other loads went past 24 GB, the OOM killer ended one, and xdist then hung.
# (One worker peaks at 10.6 GB on test_real_models + test_real_loading.) They are known by name: a file or a test
# named test_real_*, which every test using a fixture below must be.
REAL_MODEL_FIXTURES = {"default_pair", "qwen_f32", "fast_pair"}


def scheduling_group(nodeid: str) -> str:
    """The worker-sharing group of a test: its file (as --dist loadfile), or one group for the packaged models."""
    path, _, name = nodeid.partition("::")
    if Path(path).name.startswith("test_real_") or name.startswith("test_real_"):
        return "real-models"
    return path


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(item.fixturenames) and scheduling_group(item.nodeid) != "real-models":
            raise pytest.UsageError(f"{item.nodeid} loads a packaged model: name it test_real_* (see conftest)")


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with every test of the packaged models in one group (scheduling_group), handed out first:
    it is the longest, so it runs beside every other file instead of alone after them."""
    from xdist.scheduler import LoadScopeScheduling

    class RealModelsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_group(nodeid)

        def _assign_work_unit(self, node) -> None:
            if "real-models" in self.workqueue:
                self.workqueue.move_to_end("real-models", last=False)
            super()._assign_work_unit(node)

    return RealModelsTogether(config, log)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen"), seed=0)


@pytest.fixture(scope="session")
def other_tiny_dir(tmp_path_factory) -> Path:
    """Same tokenizer, unrelated weights: a drafter that is almost never right."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-other"), seed=1)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=2, model_type="llama")


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A verispec cache of the test's own ($VERISPEC_CACHE): no remembered choice from other tests or runs; the
    kernels built once are shared."""
    from verispec.models.machine import cache_root

    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    return tmp_path


REPEATING_PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("


@pytest.fixture(scope="session")
def target(tiny_dir):
    """The tiny Qwen-layout model, loaded in float32 (engines and drafters keep per-request state elsewhere)."""
    from verispec.models.loading import load_model

    return load_model(tiny_dir, "float32")


REAL_TARGET, REAL_DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="session")
def default_pair():
    """The packaged pair as `verispec serve` loads it by default (the 1.5B target in bfloat16 with the format
    `auto` measures, the 0.5B draft model in its default format), loaded once for every test that runs it."""
    from verispec import load_draft_model
    from verispec.models.loading import load_model

    previous = torch.get_num_threads()
    torch.set_num_threads(real_thread_count())  # auto times the formats: on the cores this worker has
    try:
        target = load_model(REAL_TARGET, "bfloat16", quantize="auto")
        return target, load_draft_model(REAL_DRAFT, target)
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def real_threads(request):
    """A packaged-model test runs on the cores no other worker uses (real_thread_count), as torch threads; the
    previous count after it. (Their module fixtures load models the same way.)"""
    if scheduling_group(request.node.nodeid) != "real-models":
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(real_thread_count())
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def repeating_prompt() -> str:
    """A prompt that repeats itself, so lookup drafters have something to propose."""
    return REPEATING_PROMPT
