"""Process-wide JAX settings the command-line tools share."""
from __future__ import annotations

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
# step (benchmarks/train_step.py), 3.3 s per thread right after a PyTorch step in the same process. tcmalloc keeps
# freed pages for reuse. TPU VM images preload it for the same reason.
MALLOC_ENV = "MARL_JAX_MALLOC"
_REEXEC_ENV = "_MARL_JAX_MALLOC_REEXEC"
_TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """Path of an installed tcmalloc (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`), or None."""
    for d in _LIB_DIRS:
        for name in _TCMALLOC:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return path
    return None


def loaded_allocator() -> str:
    """'tcmalloc (<path>)' when tcmalloc is mapped into this process, else 'glibc malloc'."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "tcmalloc" in line:
                    return f"tcmalloc ({line.split()[-1]})"
    except OSError:
        return "system malloc"
    return "glibc malloc"


def use_tcmalloc() -> str:
    """Restart this process once with tcmalloc preloaded, if installed; return the allocator in use.

    Call first thing in a command-line entry point, before JAX is imported: LD_PRELOAD only acts at
    process start, so the process re-executes itself with the same command line (`sys.orig_argv`).
    $MARL_JAX_MALLOC: `auto` (default: tcmalloc when installed), `off` (never re-execute), or the
    path of an allocator library to preload instead. Linux only; elsewhere a no-op.
    """
    choice = os.environ.get(MALLOC_ENV, "auto")
    current = loaded_allocator()
    if choice == "off" or current.startswith("tcmalloc") or not sys.platform.startswith("linux"):
        return current
    if os.environ.get(_REEXEC_ENV):  # already re-executed once and it did not load: do not loop
        return current
    lib = find_tcmalloc() if choice == "auto" else choice
    if lib is None:
        return current
    if not os.path.isfile(lib):
        raise FileNotFoundError(f"{MALLOC_ENV}={lib}: no such library. Set {MALLOC_ENV}=auto (tcmalloc if "
                                f"installed) or {MALLOC_ENV}=off (the system allocator).")
    if "jax" in sys.modules:  # too late to restart cleanly: JAX's runtime is already up
        return current
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    # gperftools returns freed pages to the kernel gradually (rate 1 by default), which faults some of the
    # temporaries in again; 0 keeps them, as intended here (an explicit setting wins).
    env.setdefault("TCMALLOC_RELEASE_RATE", "0")
    env[_REEXEC_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    argv = list(getattr(sys, "orig_argv", [sys.executable] + sys.argv))
    os.execve(sys.executable, argv, env)
    return current  # not reached
