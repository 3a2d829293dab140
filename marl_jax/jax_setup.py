"""Process-wide JAX settings the command-line tools share (the platform rule runs on `import marl_jax`)."""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import sys


# ---- platforms: libtpu stays out of processes on machines without a TPU ----
# With libtpu installed (the `aot` extra) and JAX_PLATFORMS unset, JAX tries the TPU backend first in every
# process: libtpu prints its missing-TPU errors and holds /tmp/libtpu_lockfile for the process's life, so a
# second process that loads libtpu (a `plan --aot` beside a training run) fails with "ABORTED: Internal error
# when accessing libtpu multi-process lockfile". JAX has no switch to skip one platform, so where there is
# no TPU, `import marl_jax` names the platforms JAX would end up with anyway (keep_libtpu_out).
# What libtpu opens on a TPU VM (v4/v5p: /dev/accel*, v5e and later: /dev/vfio/<n>) and the variables
# TPU VM and GKE images set; jax itself reads the PCI ids (hardware_utils).
_TPU_DEVICE_GLOBS = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
_TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_TOPOLOGY", "JAX_FORCE_TPU_INIT")
_GOOGLE_PCI_VENDOR = "0x1ae0"  # also gVNIC: a TPU is one of the device ids jax's hardware_utils lists
_TPU_PCI_IDS = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")
# Variables through which the user (or a parent process) already chose the platforms.
_CHOSEN_ENV = ("JAX_PLATFORMS", "JAX_PLATFORM_NAME", "PJRT_NAMES_AND_LIBRARY_PATHS")


def tpu_present(environ=None) -> bool:
    """True on a machine that may hold a TPU: a TPU device node, a TPU on the PCI bus, or the TPU VM's
    variables set. Errs towards True: then JAX's own choice stands."""
    environ = os.environ if environ is None else environ
    if any(environ.get(k) for k in _TPU_ENV) or any(glob.glob(g) for g in _TPU_DEVICE_GLOBS):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor), "device")) as f:
                if f.read().strip() in _TPU_PCI_IDS:
                    return True
        except OSError:
            continue
    return False


def _jax_plugins() -> list[str]:
    """Names of the installed JAX PJRT plugins (e.g. 'xla_cuda12 jax_cuda12_plugin'), found as JAX finds
    them (entry points of group jax_plugins, modules of the jax_plugins namespace) without importing them."""
    import importlib.metadata
    import importlib.util
    import pkgutil

    names = [f"{e.name} {e.value}" for e in importlib.metadata.entry_points(group="jax_plugins")]
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        names += [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
    return names


def default_platforms(environ=None) -> str | None:
    """The JAX_PLATFORMS keep_libtpu_out sets: None (JAX's own choice) when the user chose (JAX_PLATFORMS,
    even empty, JAX_PLATFORM_NAME), a TPU may be present, libtpu is not installed, or a PJRT plugin other
    than CUDA's or ROCm's is; else 'cpu', after 'cuda' when its plugin is installed (JAX skips cuda where no
    NVIDIA device is visible, as it does unasked) and 'rocm' when its plugin and an AMD GPU are."""
    import importlib.util

    environ = os.environ if environ is None else environ
    if any(k in environ for k in _CHOSEN_ENV) or tpu_present(environ):
        return None
    if not environ.get("TPU_LIBRARY_PATH") and importlib.util.find_spec("libtpu") is None:
        return None  # JAX tries no TPU without libtpu: nothing to keep out
    platforms = []
    for plugin in _jax_plugins():
        if "cuda" in plugin:
            platforms.append("cuda")
        elif "rocm" in plugin:
            if os.path.exists("/dev/kfd"):
                platforms.append("rocm")
        else:
            return None  # a platform this cannot name: leave the choice to JAX
    return ",".join(dict.fromkeys(platforms + ["cpu"]))


def keep_libtpu_out() -> str | None:
    """Set JAX_PLATFORMS to default_platforms() (the process's environment, inherited by the processes it
    starts, and JAX's config when JAX is imported). Runs on `import marl_jax`; a no-op once JAX has made
    its backends. Returns the platforms set, or None."""
    platforms = default_platforms()
    if platforms is None:
        return None
    jax = sys.modules.get("jax")
    if jax is not None and hasattr(jax, "config"):
        try:
            from jax._src import xla_bridge

            if jax.config.jax_platforms is not None or xla_bridge.backends_are_initialized():
                return None  # set in code, or too late
        except (ImportError, AttributeError):
            return None
        jax.config.update("jax_platforms", platforms)
    os.environ["JAX_PLATFORMS"] = platforms
    return platforms


@contextlib.contextmanager
def compile_only_libtpu():
    """Around making libtpu's compile-only devices (plan_aot.tpu_topology) on a machine without a TPU: load
    libtpu without its multi-process lock file (it guards a TPU, and none is opened here, so a training run or
    another --aot may hold it) and without its lookups of the TPU VM's host layout (TPU_HOST_BOUNDS and
    TPU_WORKER_HOSTNAMES; the compiled programs are the same with and without them). libtpu reads them as it
    initializes; they are restored after, so processes started later do not inherit them. On a TPU VM the
    lock stays: that process may open the TPU too."""
    env = {} if tpu_present() else {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_HOST_BOUNDS": "1,1,1",
                                     "TPU_WORKER_HOSTNAMES": "localhost"}
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
# so does glibc itself once told never to mmap (mmap_max=0) and never to trim the heap, for what the main
# heap serves. Other threads' arenas are capped at 64 MiB, beyond which glibc maps chunks directly again, so
# one-device programs then run on the calling thread (inline_dispatch), whose allocations come from the main
# heap. (arena_max=1, serving every thread from the main heap, did the same at the cost of lock contention:
# 10-15% slower updates and 2.7 GB more resident in benchmarks/train_step.py, docs/performance.md.)
# The launcher restarts itself once under tcmalloc when installed, else under glibc with those tunables,
# which needs no library (use_fast_allocator).
MALLOC_ENV = "MARL_JAX_MALLOC"
_REEXEC_ENV = "_MARL_JAX_MALLOC_REEXEC"
_TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
_MIMALLOC = ("libmimalloc.so.3", "libmimalloc.so.2", "libmimalloc.so")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_KNOWN = ("tcmalloc", "mimalloc", "jemalloc")  # allocators loaded_allocator() names from /proc/self/maps
# glibc's own allocator without the per-call faults (see above); no extra library.
GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
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


def inline_dispatch(environ=None) -> bool:
    """Run one-device CPU programs on the calling thread (jax_cpu_enable_async_dispatch=False) when glibc
    never maps (glibc.malloc.mmap_max=0 in $GLIBC_TUNABLES): their temporaries then come from the main
    heap, which keeps its pages, rather than from a worker thread's arena, which maps them afresh at every
    call. Runs on `import marl_jax`, before JAX makes its backends (the flag is read then); a no-op after.
    Returns whether it set the flag."""
    environ = os.environ if environ is None else environ
    if "glibc.malloc.mmap_max=0" not in _malloc_tunables(environ).split(":"):
        return False
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True
