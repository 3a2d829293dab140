"""Shared, session-scoped model fixtures: tiny random Hugging Face checkpoints and the embedded SmolLM2.

Everything heavy (transformers' GGUF load, exports) is built once per test session and only when a test
asks for it; torch and transformers are imported inside the fixtures, so test files that never use them
do not pay for them.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

SMOLLM = "smollm2-135m-instruct"

# First: on a machine without a TPU, this process and the ones tests start leave libtpu (the aot extra) out
# (marl_jax.jax_setup.keep_libtpu_out); libtpu's compile-only devices need no lock file (plan_aot.tpu_topology).
import marl_jax  # noqa: E402,F401

# One XLA compilation cache for the whole session, fresh each time, shared with the subprocesses tests
# start: tests build many samplers and trainers over the same tiny models, whose programs are the same
# HLO under new jit objects (a hit skips XLA's compile; a third of the suite's time is compiling).
_session_cache: list[str] = []


def pytest_configure(config):
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.environ.get("MARL_JAX_CACHE"):
        return  # the caller chose a cache (or "off"): leave it
    path = tempfile.mkdtemp(prefix="marl_jax-test-xla-")
    _session_cache.append(path)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    os.environ["MARL_JAX_CACHE"] = path  # launch/run.py and the notebooks: this cache, not ~/.cache
    if "jax" in sys.modules:  # a plugin imported JAX before this hook: its config read the environment already
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4, and at least 6 GiB of memory each (a worker holds the
    embedded model, transformers' reference copy and its compiled programs; the 8-device drivers it starts
    add more)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = 8.0
    return max(1, min(cores, 4, int(mem_gib // 6)))


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_file():
    """An xdist worker runs many test files in one process, and each file's compiled programs, arrays and freed
    heap stayed resident: two workers reached 7 GiB each and a third process tipped a 24 GiB machine over (a
    worker killed mid-file). After each file: jax's in-memory caches dropped (the persistent cache above serves
    a program again), garbage collected, freed heap returned to the OS."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def pytest_unconfigure(config):
    for path in _session_cache:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """make(family, tie=False, num_kv_heads=None, seed=0, tokenizer=False) -> folder of a tiny random
    checkpoint written by transformers' save_pretrained (cached per argument set)."""
    from hf_fixtures import make_tiny_hf, save_tiny_tokenizer

    made: dict[tuple, pathlib.Path] = {}

    def make(family: str, tie: bool = False, num_kv_heads: int | None = None, seed: int = 0,
             tokenizer: bool = False) -> pathlib.Path:
        key = (family, tie, num_kv_heads, seed, tokenizer)
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{family}-tie{int(tie)}-kv{num_kv_heads}-s{seed}")
            make_tiny_hf(family, out, tie=tie, seed=seed, num_kv_heads=num_kv_heads)
            if tokenizer:
                save_tiny_tokenizer(out)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct as load_model gives it (numpy params, GGUF tokenizer)."""
    from marl_jax.models.loading import load_model

    return load_model(SMOLLM)


@pytest.fixture(scope="session")
def smollm_hf_gguf():
    """transformers' own loading of the embedded GGUF file (float32, eval mode). About 20-30 s."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from marl_jax.models.embedded import embedded_gguf_path

    path = embedded_gguf_path(SMOLLM)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm_export_dir(smollm, tmp_path_factory):
    """The embedded model exported by save_hf_dir, tokenizer included."""
    from marl_jax.models import hf

    return hf.save_hf_dir(tmp_path_factory.mktemp("smollm-export"), smollm.cfg, smollm.params,
                          tokenizer=smollm.tokenizer)


@pytest.fixture(scope="session")
def smollm_hf_export(smollm_export_dir):
    """transformers' model loaded from the exported folder (float32, eval mode)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(smollm_export_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat_prompts(smollm):
    """Token ids of real chat prompts (mixed lengths) under the embedded model's chat template."""
    from hf_fixtures import CHAT_QUESTIONS

    return [smollm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]


@pytest.fixture(scope="session")
def torch_threads():
    """threads(n=None): a context manager that runs torch on n threads; by default all of them on an idle
    machine and one on a busy one (torch's spinning worker threads slow it several-fold when other processes
    hold the cores)."""
    torch = pytest.importorskip("torch")

    @contextlib.contextmanager
    def threads(n: int | None = None):
        before = torch.get_num_threads()
        if n is None:
            busy = os.getloadavg()[0] >= (os.cpu_count() or 1)  # this process alone adds about 1
            n = 1 if busy else before
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return threads


@pytest.fixture(scope="session")
def prompt_dir(tmp_path_factory):
    """Minimal voting prompts ("<question>" / "<k>:<solution>") for tiny-model training tests."""
    import json

    d = tmp_path_factory.mktemp("prompts")
    (d / "math.json").write_text(json.dumps({"voting": {
        "generator": {"system": "", "user": "{{question}}"},
        "aggregator": {"system": "", "user": "{{solutions}}"},
        "solution": "{{k}}:{{solution}}\n",
    }}))
    return str(d)
