"""libtpu (the `aot` extra) stays out of processes on a machine without a TPU (marl_jax.jax_setup.keep_libtpu_out,
run on `import marl_jax`): no TPU error lines, no libtpu loaded, so no /tmp/libtpu_lockfile taken; and libtpu's
compile-only devices (marl_jax.plan_aot.tpu_devices) are made while another process holds that lock file."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest

from marl_jax import jax_setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
ON_TPU = jax_setup.tpu_present()
NO_LIBTPU = 'libtpu is not installed (pip install -e ".[aot]"): nothing to keep out'
# What libtpu prints when it starts without a TPU (and the lock file error), none of which a CPU run may show.
TPU_LINES = ("TPU_", "libtpu", "InitGoogle", "common_lib.cc")


def _env(**extra):
    """This environment as a new user's shell has it: without the platform choice `import marl_jax` made in this
    pytest process, and without libtpu's switches."""
    drop = ("JAX_PLATFORMS", "JAX_PLATFORM_NAME", "ALLOW_MULTIPLE_LIBTPU_LOAD", "TPU_SKIP_MDS_QUERY",
            "TPU_HOST_BOUNDS", "TPU_WORKER_HOSTNAMES")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=ROOT, MARL_JAX_CACHE="off", **extra)
    return env


def _python(code: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def _tpu_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(s in line for s in TPU_LINES)]


REPORT = ("import jax; d = jax.devices(); print(d[0].platform, 'libtpu.so' in open('/proc/self/maps').read(), "
          "jax.config.jax_platforms)")


@pytest.mark.skipif(not HAS_LIBTPU, reason=NO_LIBTPU)
@pytest.mark.skipif(ON_TPU, reason="a TPU is present: JAX's own choice (the TPU) stands")
@pytest.mark.parametrize("first", ["import marl_jax", "from marl_jax.jax_setup import use_fast_allocator",
                                   "import jax; import marl_jax.plan_aot"])
def test_a_cpu_process_never_starts_libtpu(first):
    """The library imported first (colabs, library users), the launcher's first import (launch/run.py, the
    benchmarks), JAX imported before marl_jax (benchmarks/attention.py): the process runs on CPU (or a GPU), prints
    none of libtpu's errors and never loads libtpu (which would take its lock file)."""
    out = _python(f"{first}; {REPORT}")
    assert out.returncode == 0, out.stderr
    platform, loaded, platforms = out.stdout.split()
    assert platform in ("cpu", "gpu", "cuda", "rocm"), out.stdout
    assert _tpu_lines(out.stderr) == [], out.stderr
    assert loaded == "False", "libtpu was loaded: its lock file is taken"
    assert platforms.endswith("cpu")


@pytest.mark.skipif(ON_TPU, reason="a TPU is present")
def test_the_users_choice_stands():
    for value in ("cpu", ""):  # empty: JAX's own choice (libtpu included), as the user asked
        out = _python("import marl_jax, os; print(repr(os.environ['JAX_PLATFORMS']))", JAX_PLATFORMS=value)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == repr(value)


def test_the_rule(monkeypatch, tmp_path):
    """default_platforms: the user's choice, a TPU (device node or the TPU VM's variables) or no libtpu leave JAX
    alone; a GPU plugin keeps its platform ahead of cpu; a plugin it cannot name leaves JAX alone."""
    monkeypatch.setattr(jax_setup, "_TPU_DEVICE_GLOBS", (str(tmp_path / "accel[0-9]*"),))
    monkeypatch.setattr(jax_setup, "_GOOGLE_PCI_VENDOR", "no such vendor")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "libtpu" else None)
    plugins = []
    monkeypatch.setattr(jax_setup, "_jax_plugins", lambda: plugins)
    rule = jax_setup.default_platforms
    assert rule({}) == "cpu"
    assert rule({"JAX_PLATFORMS": ""}) is None and rule({"JAX_PLATFORMS": "tpu"}) is None
    assert rule({"JAX_PLATFORM_NAME": "cpu"}) is None
    assert rule({"TPU_ACCELERATOR_TYPE": "v5p-8"}) is None and rule({"JAX_FORCE_TPU_INIT": "1"}) is None
    plugins[:] = ["xla_cuda12 jax_cuda12_plugin"]
    assert rule({}) == "cuda,cpu"  # JAX itself skips cuda where no NVIDIA device is visible
    plugins[:] = ["xla_metal jax_metal"]
    assert rule({}) is None
    plugins[:] = []
    (tmp_path / "accel0").touch()  # a v4 / v5p TPU VM
    assert jax_setup.tpu_present({}) and rule({}) is None
    (tmp_path / "accel0").unlink()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert rule({}) is None  # no libtpu: nothing to keep out


def test_compile_only_switches_are_scoped(monkeypatch):
    monkeypatch.setattr(jax_setup, "tpu_present", lambda environ=None: False)
    monkeypatch.delenv("ALLOW_MULTIPLE_LIBTPU_LOAD", raising=False)
    monkeypatch.setenv("TPU_HOST_BOUNDS", "mine")
    with jax_setup.compile_only_libtpu():
        assert os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
        assert os.environ["TPU_HOST_BOUNDS"] == "mine"  # a value already set is kept
    assert "ALLOW_MULTIPLE_LIBTPU_LOAD" not in os.environ  # processes started later do not inherit it
    assert os.environ["TPU_HOST_BOUNDS"] == "mine"
    monkeypatch.setattr(jax_setup, "tpu_present", lambda environ=None: True)
    with jax_setup.compile_only_libtpu():  # a TPU VM: libtpu's lock file guards the TPU
        assert "ALLOW_MULTIPLE_LIBTPU_LOAD" not in os.environ


# Holds libtpu's lock file as a process of before the fix did (a training run, a plan --aot): loads libtpu
# without ALLOW_MULTIPLE_LIBTPU_LOAD (no TPU is touched: JAX_PLATFORMS=cpu). Says "up" once it holds it (or
# libtpu found it held already), then waits.
HOLDER = """
import sys, time
from jax.experimental import topologies
try:
    topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
except Exception as e:
    assert "lockfile" in str(e), e
print("up", flush=True)
time.sleep(float(sys.argv[1]))
"""
COMPILE = """
import jax, jax.numpy as jnp
from marl_jax.plan_aot import tpu_devices
d = tpu_devices("v5p", 4)
x = jax.ShapeDtypeStruct((8, 128), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(d[0]))
c = jax.jit(lambda x: x * 2).trace(x).lower().compile()
print(d[0].platform, len(d), flush=True)
"""


@pytest.mark.skipif(not HAS_LIBTPU, reason='libtpu is not installed (pip install -e ".[aot]"): no compile-only TPU')
@pytest.mark.skipif(ON_TPU, reason="a TPU is present: the lock file guards it")
def test_compile_only_tpu_devices_beside_a_libtpu_process():
    """Two compile-only TPU device makers at once, while a third process holds libtpu's lock file: both compile,
    neither prints libtpu's errors."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "120"], cwd=ROOT, env=_env(JAX_PLATFORMS="cpu"),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        procs = [subprocess.Popen([sys.executable, "-c", COMPILE], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        t0 = time.time()
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, 240 - (time.time() - t0)))
            assert p.returncode == 0, err[-3000:]
            assert out.split() == ["tpu", "4"]
            assert _tpu_lines(err) == [], err
    finally:
        holder.kill()
        holder.wait()
