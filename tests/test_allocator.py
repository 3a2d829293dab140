"""The launcher's allocator: tcmalloc preloaded by a one-time re-execution (marl_jax.jax_setup.use_tcmalloc).

XLA:CPU allocates a program's temporaries at every call; under glibc those over 32 MiB are mapped
afresh and faulted in page by page at every call. These tests run small scripts in fresh processes.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from marl_jax.jax_setup import MALLOC_ENV, find_tcmalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Calls a jitted program with a 64 MiB temporary (an [8192, 2048] float32 matmul output) 9 times and
# prints the allocator and the median page faults of the last 6 calls, each counted alone (one call now
# and then maps fresh memory under either allocator; the median is what a call usually costs).
SCRIPT = textwrap.dedent("""
    import resource, statistics, sys
    from marl_jax.jax_setup import loaded_allocator, use_tcmalloc
    use_tcmalloc()
    import jax, jax.numpy as jnp
    x = jnp.ones((8192, 256), jnp.float32)
    w = jnp.ones((256, 2048), jnp.float32) / 256
    f = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w.T)
    faults = []
    for i in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x, w).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(loaded_allocator(), "|", int(statistics.median(faults[3:])))
""")


def run(malloc: str, script: str = SCRIPT) -> tuple[str, int]:
    env = dict(os.environ, **{MALLOC_ENV: malloc}, PYTHONPATH=ROOT)
    env.pop("LD_PRELOAD", None)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    name, faults = p.stdout.strip().splitlines()[-1].split(" | ")
    return name, int(faults)


needs_tcmalloc = pytest.mark.skipif(
    find_tcmalloc() is None or not sys.platform.startswith("linux"),
    reason="tcmalloc not installed (Debian/Ubuntu: apt-get install libtcmalloc-minimal4)")


@needs_tcmalloc
def test_tcmalloc_reexec_keeps_temporaries_resident():
    """auto restarts the process with tcmalloc, whose calls reuse the temporary; glibc faults it in per call."""
    glibc, glibc_faults = run("off")
    tc, tc_faults = run("auto")
    assert glibc == "glibc malloc"
    assert tc.startswith("tcmalloc (") and find_tcmalloc().rsplit("/", 1)[-1].split(".so")[0] in tc
    page = os.sysconf("SC_PAGE_SIZE")
    assert glibc_faults >= (64 << 20) // page, glibc_faults  # the 64 MiB output, page by page, every call
    assert tc_faults < glibc_faults // 8, (tc_faults, glibc_faults)


@needs_tcmalloc
def test_explicit_library_path_and_jax_already_imported():
    name, _ = run(find_tcmalloc())
    assert name.startswith("tcmalloc")
    # Once JAX is imported a restart would lose state: use_tcmalloc leaves the process as it is.
    late = "import jax\n" + SCRIPT
    name, _ = run("auto", late)
    assert name == "glibc malloc"


def test_missing_library_names_the_fix():
    env = dict(os.environ, **{MALLOC_ENV: "/no/such/libtcmalloc.so"}, PYTHONPATH=ROOT)
    env.pop("LD_PRELOAD", None)
    p = subprocess.run([sys.executable, "-c", "from marl_jax.jax_setup import use_tcmalloc; use_tcmalloc()"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode != 0
    assert "no such library" in p.stderr and f"{MALLOC_ENV}=off" in p.stderr


@pytest.mark.parametrize("malloc", ["auto", "off"])
def test_launcher_reports_its_allocator(tmp_path, malloc):
    """launch/run.py restarts under tcmalloc when installed (auto) and names its allocator; off never restarts.
    A malformed task file stops the run right after that line."""
    f = tmp_path / "tasks.jsonl"
    f.write_text("{oops\n")
    env = dict(os.environ, **{MALLOC_ENV: malloc}, JAX_PLATFORMS="cpu", MARL_JAX_CACHE="off")
    env.pop("LD_PRELOAD", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "run.py"), "--config=configs/voting.py",
                        "--config.task.source=file", f"--config.task.path={f}", f"--workdir={tmp_path / 'run'}",
                        "--noprogress"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 2 and "line 1 is not valid JSON" in p.stderr, p.stderr[-2000:]
    want = "tcmalloc" if malloc == "auto" and find_tcmalloc() and sys.platform.startswith("linux") else "glibc"
    assert f"allocator={want}" in p.stdout, p.stdout
