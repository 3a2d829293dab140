"""The launcher's allocator: tcmalloc or tuned glibc (mimalloc when named) by a one-time re-execution
(marl_jax.jax_setup.use_fast_allocator).

XLA:CPU allocates a program's temporaries at every call; under glibc as it is those over 32 MiB are
mapped afresh and faulted in page by page at every call. The choice is tested on its own (what is
picked under which $MARL_JAX_MALLOC and what is installed); the restart and the faults run small
scripts in fresh processes.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from marl_jax import jax_setup
from marl_jax.jax_setup import GLIBC_TUNABLES, MALLOC_ENV, choose_allocator, find_mimalloc, find_tcmalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Calls a jitted program with a 64 MiB temporary (an [8192, 2048] float32 matmul output) 9 times and
# prints the allocator and the median page faults of the last 6 calls, each counted alone (one call now
# and then maps fresh memory under either allocator; the median is what a call usually costs).
SCRIPT = textwrap.dedent("""
    import resource, statistics, sys
    from marl_jax.jax_setup import loaded_allocator, use_fast_allocator
    use_fast_allocator()
    import jax, jax.numpy as jnp
    x = jnp.ones((8192, 256), jnp.float32)
    w = jnp.ones((256, 2048), jnp.float32) / 256
    f = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w.T)
    faults = []
    for i in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x, w).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(loaded_allocator(), "|", int(statistics.median(faults[3:])), "|", min(faults[3:]))
""")


def clean_env(**kw) -> dict:
    """This environment without allocator settings of its own (a restart's marker included); the
    repository first on the path."""
    env = dict(os.environ)
    # No compilation cache: an executable loaded from it lays its buffers out otherwise (glibc+tunables then
    # faults half the output per call, not none), and a fault count should not depend on what ran before.
    for k in ("LD_PRELOAD", "GLIBC_TUNABLES", "_MARL_JAX_MALLOC_REEXEC", "TCMALLOC_RELEASE_RATE",
              "MIMALLOC_PURGE_DELAY", MALLOC_ENV, "JAX_COMPILATION_CACHE_DIR", "MARL_JAX_CACHE"):
        env.pop(k, None)
    env["MARL_JAX_CACHE"] = "off"  # unset, the default cache folder (~/.cache/marl_jax) would still be read
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env.update(kw)
    return env


def run(malloc: str, script: str = SCRIPT, low: bool = False) -> tuple[str, int]:
    """(allocator, median page faults per call), or the fewest of any call with low."""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=clean_env(**{MALLOC_ENV: malloc}), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    name, faults, least = p.stdout.strip().splitlines()[-1].split(" | ")
    return name, int(faults) if not low else int(least)


linux_glibc = pytest.mark.skipif(not jax_setup._glibc(), reason="Linux with glibc only")
FAST = [pytest.param("tcmalloc", marks=pytest.mark.skipif(
            find_tcmalloc() is None, reason="tcmalloc not installed (apt-get install libtcmalloc-minimal4)")),
        pytest.param("mimalloc", marks=pytest.mark.skipif(
            find_mimalloc() is None, reason="the cmeel-mimalloc wheel is not installed (pip install cmeel-mimalloc)")),
        "glibc+tunables"]


# ---- the choice, on its own ----

@pytest.fixture
def installed(monkeypatch):
    """Pretend which of tcmalloc and mimalloc are installed: installed(tcmalloc=path|None, mimalloc=...)."""
    def set_(tcmalloc=None, mimalloc=None, glibc=True):
        monkeypatch.setattr(jax_setup, "find_tcmalloc", lambda: tcmalloc)
        monkeypatch.setattr(jax_setup, "find_mimalloc", lambda: mimalloc)
        monkeypatch.setattr(jax_setup, "_glibc", lambda: glibc)
    return set_


TC, MI = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/venv/site-packages/cmeel.prefix/lib/libmimalloc.so.3"


@pytest.mark.parametrize("have_tc, have_mi, want", [
    (True, True, "tcmalloc"), (True, False, "tcmalloc"), (False, True, "glibc+tunables"), (False, False, "glibc+tunables")])
def test_auto_picks_tcmalloc_then_tuned_glibc(installed, have_tc, have_mi, want):
    """mimalloc, even when installed, only runs when named (it cost more kernel time than glibc)."""
    installed(tcmalloc=TC if have_tc else None, mimalloc=MI if have_mi else None)
    for environ in ({}, {MALLOC_ENV: "auto"}):
        a = choose_allocator(environ)
        env = dict(a.env)
        assert a.name == want
        if want == "tcmalloc":
            assert a.library == TC and env == {"LD_PRELOAD": TC, "TCMALLOC_RELEASE_RATE": "0"}
        elif want == "mimalloc":
            assert a.library == MI and env == {"LD_PRELOAD": MI, "MIMALLOC_PURGE_DELAY": "-1"}
        else:
            assert a.library is None and env == {"GLIBC_TUNABLES": GLIBC_TUNABLES}


def test_choice_keeps_the_users_settings(installed):
    installed(tcmalloc=None, mimalloc=MI)
    env = dict(choose_allocator({MALLOC_ENV: "mimalloc", "LD_PRELOAD": "/x/libfoo.so", "MIMALLOC_PURGE_DELAY": "10"}).env)
    assert env == {"LD_PRELOAD": f"{MI}:/x/libfoo.so"}  # preloaded first; the user's purge delay is kept
    installed(tcmalloc=None, mimalloc=None)
    # other tunables are kept and the malloc ones appended; the user's own malloc tunables win outright
    assert dict(choose_allocator({"GLIBC_TUNABLES": "glibc.cpu.x86_rep_movsb_threshold=4096"}).env) == {
        "GLIBC_TUNABLES": "glibc.cpu.x86_rep_movsb_threshold=4096:" + GLIBC_TUNABLES}
    a = choose_allocator({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert a.name == "glibc+tunables" and a.env == ()


def test_off_named_and_path_choices(installed, tmp_path):
    installed(tcmalloc=TC, mimalloc=MI)
    assert choose_allocator({MALLOC_ENV: "off"}) == jax_setup.Allocator("glibc")
    assert choose_allocator({MALLOC_ENV: "mimalloc"}).library == MI
    assert choose_allocator({MALLOC_ENV: "tcmalloc"}).library == TC
    for name in ("glibc+tunables", "tuned"):
        assert dict(choose_allocator({MALLOC_ENV: name}).env) == {"GLIBC_TUNABLES": GLIBC_TUNABLES}
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    a = choose_allocator({MALLOC_ENV: str(lib)})
    assert (a.name, a.library, dict(a.env)) == ("jemalloc", str(lib), {"LD_PRELOAD": str(lib)})
    installed(tcmalloc=None, mimalloc=None, glibc=False)  # musl, say: nothing to tune, no restart
    assert choose_allocator({}) == jax_setup.Allocator("glibc")


@pytest.mark.parametrize("value, fix", [
    ("/no/such/libtcmalloc.so", "no such library"),
    ("tcmalloc", "apt-get install libtcmalloc-minimal4"),
    ("mimalloc", "pip install cmeel-mimalloc")])
def test_a_named_allocator_that_is_missing_names_the_fix(installed, value, fix):
    installed(tcmalloc=None, mimalloc=None)
    with pytest.raises(FileNotFoundError) as e:
        choose_allocator({MALLOC_ENV: value})
    assert fix in str(e.value) and f"{MALLOC_ENV}=off" in str(e.value) and f"{MALLOC_ENV}=auto" in str(e.value)


def test_find_mimalloc_looks_in_the_wheels_prefix(monkeypatch, tmp_path):
    lib = tmp_path / "cmeel.prefix" / "lib" / "libmimalloc.so.3"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    assert find_mimalloc() == str(lib)
    monkeypatch.setattr(sys, "path", [])
    assert find_mimalloc() is None


# ---- the restart, in fresh processes ----

@linux_glibc
@pytest.mark.parametrize("malloc", FAST)
def test_restart_keeps_temporaries_resident(malloc):
    """Each fast allocator, picked by name, reuses the temporary; glibc as it is faults it in at every call."""
    glibc, glibc_faults = run("off")
    # glibc+tunables keeps the freed output in its heap, but where the next one lands varies from run to run
    # (some calls fault half or all of it in again): the fewest faults of a call shows the reuse.
    name, faults = run(malloc, low=malloc == "glibc+tunables")
    assert glibc == "glibc malloc"
    assert name.split(" ")[0] == malloc, name
    if malloc == "glibc+tunables":
        assert GLIBC_TUNABLES in name
    page = os.sysconf("SC_PAGE_SIZE")
    assert glibc_faults >= (64 << 20) // page, glibc_faults  # the 64 MiB output, page by page, every call
    assert faults < glibc_faults // 8, (malloc, faults, glibc_faults)


@linux_glibc
def test_auto_runs_the_first_installed():
    name, _ = run("auto")
    assert name.split(" ")[0] == choose_allocator({}).name, name


@pytest.mark.skipif(find_tcmalloc() is None and find_mimalloc() is None, reason="neither tcmalloc nor mimalloc installed")
def test_explicit_library_path_and_jax_already_imported():
    lib = find_tcmalloc() or find_mimalloc()
    name, _ = run(lib)
    assert name.startswith("tcmalloc" if "tcmalloc" in lib else "mimalloc"), name
    # Once JAX is imported a restart would lose state: use_fast_allocator leaves the process as it is.
    late = "import jax\n" + SCRIPT
    name, _ = run("auto", late)
    assert name == "glibc malloc"


COUNT = textwrap.dedent("""
    import os, sys
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()}\\n")
    from marl_jax.jax_setup import loaded_allocator, use_fast_allocator
    use_fast_allocator()
    print(loaded_allocator())
""")


@linux_glibc
@pytest.mark.parametrize("malloc, starts", [("auto", 2), ("off", 1), ("not-a-library", 2)])
def test_restarts_at_most_once(tmp_path, malloc, starts):
    """One restart (same process id: exec), none under off, and no loop when the preload does not take
    (a file that is not a library: the loader ignores it with a warning)."""
    log = tmp_path / "starts"
    if malloc == "not-a-library":
        malloc = str(tmp_path / "libnot.so")
        (tmp_path / "libnot.so").write_text("not ELF")
    p = subprocess.run([sys.executable, "-c", COUNT, str(log)], capture_output=True, text=True,
                       env=clean_env(**{MALLOC_ENV: malloc}), timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    pids = log.read_text().split()
    assert len(pids) == starts and len(set(pids)) == 1, (pids, p.stderr[-2000:])
    if starts == 1:
        assert p.stdout.strip() == "glibc malloc"


def test_missing_library_names_the_fix():
    p = subprocess.run([sys.executable, "-c", "from marl_jax.jax_setup import use_fast_allocator; use_fast_allocator()"],
                       capture_output=True, text=True, env=clean_env(**{MALLOC_ENV: "/no/such/libtcmalloc.so"}),
                       timeout=60)
    assert p.returncode != 0
    assert "no such library" in p.stderr and f"{MALLOC_ENV}=off" in p.stderr


@pytest.mark.parametrize("malloc", ["auto", "off"])
def test_launcher_reports_its_allocator(tmp_path, malloc):
    """launch/run.py restarts under the first fast allocator installed (auto) and names it on its first
    line; off never restarts. A malformed task file stops the run right after that line."""
    f = tmp_path / "tasks.jsonl"
    f.write_text("{oops\n")
    env = clean_env(**{MALLOC_ENV: malloc}, JAX_PLATFORMS="cpu", MARL_JAX_CACHE="off")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "run.py"), "--config=configs/voting.py",
                        "--config.task.source=file", f"--config.task.path={f}", f"--workdir={tmp_path / 'run'}",
                        "--noprogress"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 2 and "line 1 is not valid JSON" in p.stderr, p.stderr[-2000:]
    want = choose_allocator({MALLOC_ENV: malloc}).name if sys.platform.startswith("linux") else "glibc"
    first = p.stdout.splitlines()[0]
    assert first.startswith("workflow=") and first.endswith(f"allocator={want}"), p.stdout


@pytest.mark.parametrize("tunables, inline", [("glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1", True),
                                              ("glibc.malloc.arena_max=2", False), ("", False)])
def test_programs_run_inline_where_glibc_never_maps(tunables, inline):
    """Under tunables that never mmap, `import marl_jax` turns JAX's asynchronous CPU dispatch off (the calling
    thread's temporaries come from the main heap, which keeps its pages); elsewhere JAX's default stays."""
    script = ("import marl_jax, jax\nfrom jax._src import xla_bridge\n"
              "print(not xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value)")
    env = clean_env(GLIBC_TUNABLES=tunables, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == str(inline)
