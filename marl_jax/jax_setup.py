"""Process-wide JAX settings the command-line tools share."""
from __future__ import annotations

import dataclasses
import os
import sys


def enable_compilation_cache(path: str | None = None) -> str:
    """Persist compiled programs across runs (XLA compiles dominate short CPU runs).

    Location: $MARL_JAX_CACHE, else ~/.cache/marl_jax/xla. Set MARL_JAX_CACHE=off to disable.
    """
    import jax

    path = path or os.environ.get("MARL_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "marl_jax", "xla")
    if path == "off":
        return ""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


# ---- memory allocator ----
# XLA:CPU allocates a program's temporaries afresh at every call (gigabytes for an update step). glibc
# serves allocations over 32 MiB with mmap and unmaps them on free, so every call faults its
# temporaries in again, 4 KiB at a time: ~700k page faults and ~1.1 s of kernel time in a 7 s update
# step (benchmarks/train_step.py), 3.3 s per thread right after a PyTorch step in the same process.
# tcmalloc keeps freed pages for reuse (TPU VM images preload tcmalloc for the same reason);
# so does glibc itself once told never to mmap (mmap_max=0), never to trim the heap, and to serve every
# thread from its one brk heap (arena_max=1: other arenas' heaps are capped at 64 MiB, beyond which
# glibc maps chunks directly again). The launcher restarts itself once under tcmalloc when installed,
# else under glibc with those tunables, which needs no library (use_fast_allocator).
MALLOC_ENV = "MARL_JAX_MALLOC"
_REEXEC_ENV = "_MARL_JAX_MALLOC_REEXEC"
_TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
_MIMALLOC = ("libmimalloc.so.3", "libmimalloc.so.2", "libmimalloc.so")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_KNOWN = ("tcmalloc", "mimalloc", "jemalloc")  # allocators loaded_allocator() names from /proc/self/maps
# glibc's own allocator without the per-call faults (see above); no extra library.
GLIBC_TUNABLES = ("glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776:"
                  "glibc.malloc.arena_max=1")
# Set by the restart unless already set: keep freed pages with the process rather than hand them back to
# the kernel bit by bit (gperftools' default release rate 1 faults some temporaries in again; mimalloc 3
# decommits memory left free for 1 s, e.g. the update's temporaries while the next step samples).
_TCMALLOC_ENV = {"TCMALLOC_RELEASE_RATE": "0"}
_MIMALLOC_ENV = {"MIMALLOC_PURGE_DELAY": "-1"}


@dataclasses.dataclass(frozen=True)
class Allocator:
    """What use_fast_allocator runs under: `name` as launch/run.py prints it (tcmalloc, mimalloc,
    glibc+tunables, glibc, or a preloaded library's file name), the library to preload (None: glibc),
    and the variables the restart sets (preload and tunables included)."""
    name: str
    library: str | None = None
    env: tuple[tuple[str, str], ...] = ()


def find_tcmalloc() -> str | None:
    """Path of an installed tcmalloc (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`), or None."""
    for d in _LIB_DIRS:
        for name in _TCMALLOC:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return path
    return None


def find_mimalloc() -> str | None:
    """Path of mimalloc from the `cmeel-mimalloc` wheel (`pip install cmeel-mimalloc`), or None."""
    roots = []
    try:
        from importlib import metadata

        roots.append(str(metadata.distribution("cmeel-mimalloc").locate_file("")))
    except Exception:  # not installed, or metadata unreadable: look along sys.path too
        pass
    roots += [p for p in sys.path if p and os.path.isdir(p)]
    for root in roots:
        for name in _MIMALLOC:
            path = os.path.join(root, "cmeel.prefix", "lib", name)
            if os.path.isfile(path):
                return os.path.realpath(path)
    return None


def _malloc_tunables(environ) -> str:
    """The glibc.malloc.* part of $GLIBC_TUNABLES ('' when none)."""
    return ":".join(t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc."))


def loaded_allocator() -> str:
    """The allocator this process runs under, read from /proc/self/maps and its environment:
    'tcmalloc (<path>)', 'mimalloc (<path>)' or 'jemalloc (<path>)' (the first mapped in LD_PRELOAD's
    order, which is the one whose malloc wins), '<file> (<path>)' for the library $MARL_JAX_MALLOC
    names, 'glibc+tunables (<glibc.malloc settings>)', or 'glibc malloc'."""
    try:
        with open("/proc/self/maps") as f:
            mapped = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return "system malloc"
    preloaded = [os.path.realpath(p) for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    for path in [p for p in preloaded if p in mapped] + sorted(mapped):
        key = next((k for k in _KNOWN if k in os.path.basename(path)), None)
        if key:
            return f"{key} ({path})"
    named = os.path.realpath(os.environ.get(MALLOC_ENV, "auto"))
    if named in mapped:
        return f"{os.path.basename(named)} ({named})"
    tun = _malloc_tunables(os.environ)
    return f"glibc+tunables ({tun})" if tun else "glibc malloc"


def _glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _tuned_glibc(environ) -> Allocator:
    if _malloc_tunables(environ):  # the user's own malloc tunables win
        return Allocator("glibc+tunables")
    tunables = ":".join(t for t in (environ.get("GLIBC_TUNABLES", ""), GLIBC_TUNABLES) if t)
    return Allocator("glibc+tunables", None, (("GLIBC_TUNABLES", tunables),))


def _preload(name: str, lib: str, defaults: dict[str, str], environ) -> Allocator:
    env = [("LD_PRELOAD", ":".join(p for p in (lib, environ.get("LD_PRELOAD", "")) if p))]
    env += [(k, v) for k, v in defaults.items() if k not in environ]
    return Allocator(name, lib, tuple(env))


def choose_allocator(environ=None) -> Allocator:
    """The allocator use_fast_allocator restarts under, from $MARL_JAX_MALLOC and what is installed.

    $MARL_JAX_MALLOC: `auto` (default): tcmalloc when installed, else glibc with GLIBC_TUNABLES;
    `tcmalloc`, `glibc+tunables` (or `tuned`) or `mimalloc` (from the cmeel-mimalloc wheel, never picked
    by auto: more kernel time than glibc's in benchmarks/train_step.py, docs/performance.md): that one; `off`: glibc as it is (never restart); any other value: the path of a library to
    preload. Raises FileNotFoundError, naming the fix, when the named allocator is not installed.
    """
    environ = os.environ if environ is None else environ
    choice = environ.get(MALLOC_ENV, "auto").strip() or "auto"
    fix = f"Set {MALLOC_ENV}=auto (the fastest installed) or {MALLOC_ENV}=off (glibc as it is)."
    if choice == "off":
        return Allocator("glibc")
    if choice in ("glibc+tunables", "tuned"):
        return _tuned_glibc(environ)
    if choice in ("auto", "tcmalloc"):
        lib = find_tcmalloc()
        if lib:
            return _preload("tcmalloc", lib, _TCMALLOC_ENV, environ)
        if choice == "tcmalloc":
            raise FileNotFoundError(f"{MALLOC_ENV}=tcmalloc: tcmalloc is not installed (Debian/Ubuntu: "
                                    f"apt-get install libtcmalloc-minimal4). {fix}")
    if choice == "mimalloc":
        lib = find_mimalloc()
        if lib:
            return _preload("mimalloc", lib, _MIMALLOC_ENV, environ)
        raise FileNotFoundError(f"{MALLOC_ENV}=mimalloc: the cmeel-mimalloc wheel is not installed "
                                f"(pip install cmeel-mimalloc). {fix}")
    if choice == "auto":
        return _tuned_glibc(environ) if _glibc() else Allocator("glibc")
    if not os.path.isfile(choice):
        raise FileNotFoundError(f"{MALLOC_ENV}={choice}: no such library. {fix}")
    base = os.path.basename(choice)
    name = next((k for k in _KNOWN if k in base), base)
    defaults = {"tcmalloc": _TCMALLOC_ENV, "mimalloc": _MIMALLOC_ENV}.get(name, {})
    return _preload(name, choice, defaults, environ)


def _in_effect(want: Allocator, current: str, environ) -> bool:
    if want.library is None:
        return want.name == "glibc" or current.startswith("glibc+tunables")
    return os.path.realpath(want.library) in current or current.startswith(want.name + " ")


def use_fast_allocator() -> str:
    """Restart this process once under choose_allocator()'s allocator; return the allocator in use.

    Call first thing in a command-line entry point, before JAX is imported: LD_PRELOAD and
    GLIBC_TUNABLES only act at process start, so the process re-executes itself with the same command
    line (`sys.orig_argv`) and the variables of choose_allocator(). No restart when that allocator (or
    any preloaded tcmalloc, mimalloc or jemalloc) is already in use, after one restart (no loop), once
    JAX is imported (its runtime is up), or off Linux.
    """
    if not sys.platform.startswith("linux"):
        return loaded_allocator()
    want = choose_allocator()  # raises on a bad $MARL_JAX_MALLOC before anything else
    current = loaded_allocator()
    if _in_effect(want, current, os.environ) or not want.env:
        return current
    if current.split(" ")[0] in _KNOWN and os.environ.get(MALLOC_ENV, "auto") == "auto":
        return current  # the user preloaded an allocator of their own
    if os.environ.get(_REEXEC_ENV) or "jax" in sys.modules:
        return current
    env = dict(os.environ)
    env.update(want.env)
    env[_REEXEC_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    argv = list(getattr(sys, "orig_argv", [sys.executable] + sys.argv))
    os.execve(sys.executable, argv, env)
    return current  # not reached


use_tcmalloc = use_fast_allocator  # the name the benchmarks call
