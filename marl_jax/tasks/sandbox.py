"""Run untrusted Python programs (model-generated code) without endangering the host.

Each program runs in a fresh Python interpreter (``python -I -S``: no parent environment, no
site hooks, no user site) started in its own session/process group, with resource limits
(CPU seconds, address space, processes, file size, open files, no core dumps), a wall-clock
timeout after which the whole process group is killed, a scrubbed environment, stdin fed
from a string and stdout/stderr captured up to a byte cap.

Isolation tiers, strongest available first (see :func:`isolation_level`):

* ``"namespaces"`` (running as root with util-linux ``unshare``): new network namespace (no
  interface is up, so every ``connect()`` fails), pid namespace (the program sees only its
  own processes and all of them die with it), IPC/UTS/mount namespaces in which every mount
  is remounted read-only and a small private tmpfs becomes the working directory, and the
  program runs under a throwaway unprivileged uid (one per concurrent run, so process limits
  and signals do not cross runs) with ``no_new_privs`` set.
* ``"uid"`` (root, namespaces unavailable, Python installed world-readable): the same
  unprivileged uid and limits; the working directory is a host temp folder.
* ``"rlimits"`` (anything else, e.g. an unprivileged CI user): resource limits, timeout and
  scrubbed environment only. A warning says so once.

A small supervisor (the ``_sv_*`` functions below, shipped to the child as source) sets up
the sandbox, forks the program, waits for it and reports its fate on a control pipe that the
program itself cannot reach. Programs may also write to fd 3 (``SandboxResult.channel``),
which test drivers use to report per-case results out of band of stdout.
"""
from __future__ import annotations

import dataclasses
import inspect
import marshal
import math
import os
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

STATUSES = ("ok", "timeout", "crash", "killed", "syntax_error", "wrong_answer")
ISOLATION_TIERS = ("namespaces", "uid", "rlimits")

# Throwaway uids for sandboxed programs: far above any real account; each parent process
# takes its own block so concurrent trainers/tests do not share process-count limits.
_UID_BASE = 2_000_000_000
_UID_BLOCK = 256
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): results would be untrustworthy."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits for one program run.

    timeout_s: wall-clock budget of the program; the whole process group is killed after
      timeout_s + startup_grace_s (interpreter start-up is not charged to the program).
    cpu_s: RLIMIT_CPU in seconds (default: ceil(timeout_s) + 1).
    memory_mb: RLIMIT_AS per process. max_processes: RLIMIT_NPROC (threads count too).
    file_size_mb: RLIMIT_FSIZE; disk_mb: size of the private tmpfs working directory.
    max_output_bytes / max_stderr_bytes / max_channel_bytes: capture caps; the rest is read
      and discarded, so a chatty program can neither hang nor exhaust memory.
    site_packages: make the parent's site-packages importable (numpy etc.; no .pth hooks).
    isolation: "auto" (strongest available) or one of ISOLATION_TIERS to force a tier.
    """

    timeout_s: float = 3.0
    cpu_s: float | None = None
    memory_mb: int = 1024
    max_processes: int = 8
    file_size_mb: int = 16
    disk_mb: int = 64
    max_open_files: int = 128
    max_output_bytes: int = 1 << 20
    max_stderr_bytes: int = 64 << 10
    max_channel_bytes: int = 16 << 20
    startup_grace_s: float = 1.0
    site_packages: bool = True
    isolation: str = "auto"

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_processes", "file_size_mb", "disk_mb",
                     "max_open_files", "max_output_bytes", "max_stderr_bytes",
                     "max_channel_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.cpu_s is not None and not self.cpu_s > 0:
            raise ValueError(f"SandboxConfig.cpu_s must be > 0 or None, got {self.cpu_s!r}")
        if self.startup_grace_s < 0:
            raise ValueError("SandboxConfig.startup_grace_s must be >= 0")
        if self.isolation not in ("auto",) + ISOLATION_TIERS:
            raise ValueError(f"SandboxConfig.isolation must be 'auto' or one of "
                             f"{ISOLATION_TIERS}, got {self.isolation!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What happened to one program.

    status: "ok" (exit 0), "timeout" (wall or CPU limit), "crash" (non-zero exit or fatal
      signal), "killed" (SIGKILL not sent by the timeout, e.g. the kernel OOM killer),
      "syntax_error" (did not compile); callers may set "wrong_answer".
    returncode: exit code, or -signal when a signal ended it, None when the timeout did.
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_time_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    channel: bytes = b""
    isolation: str = "rlimits"
    pgid: int = 0


@dataclasses.dataclass(frozen=True)
class Job:
    """One program for :func:`run_many`."""

    source: str
    stdin: str = ""
    config: SandboxConfig = SandboxConfig()


# --------------------------------------------------------------------------------------
# Supervisor: these functions are shipped as source to a fresh `python -I -S` interpreter
# and must only use builtin / lightweight modules imported inside them.
# --------------------------------------------------------------------------------------


def _sv_main(argv: list) -> None:
    """Entry point of the supervisor: set up, fork the program, report how it ended."""
    import fcntl
    import marshal
    import os

    def move(fd, cloexec):
        cmd = fcntl.F_DUPFD_CLOEXEC if cloexec else fcntl.F_DUPFD
        new = fcntl.fcntl(fd, cmd, 100)
        os.close(fd)
        return new

    ctl = move(int(argv[0]), True)
    data = move(int(argv[1]), False)
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    spec = marshal.loads(b"".join(chunks))
    try:
        if spec["tier"] == "namespaces":
            workdir = _sv_isolate_filesystem(spec)
        else:
            workdir = spec["workdir"]
        stdin_fd = _sv_stdin_fd(spec["stdin"], workdir)
        path = os.path.join(workdir, spec["filename"])
        with open(path, "w", encoding="utf-8") as f:
            f.write(spec["source"])
    except BaseException as exc:  # noqa: BLE001 - report any setup failure to the parent
        _sv_say(ctl, "setup_error", repr(exc))
        os._exit(121)
    pid = os.fork()
    if pid == 0:
        _sv_child(spec, workdir, path, stdin_fd, data, ctl)
    os.close(data)
    os.close(stdin_fd)
    _sv_arm_deadline(spec["deadline_s"], ctl)
    while True:
        try:
            done, status = os.waitpid(-1, 0)  # also reaps orphans when we are pid 1
        except ChildProcessError:
            _sv_say(ctl, "setup_error", "lost the program process")
            os._exit(121)
        if done == pid:
            break
    if os.WIFSIGNALED(status):
        _sv_say(ctl, "signal", str(os.WTERMSIG(status)))
    else:
        _sv_say(ctl, "exit", str(os.WEXITSTATUS(status)))
    os._exit(0)  # as pid 1 of a pid namespace this also kills every leftover process


def _sv_say(fd: int, kind: str, text: str = "") -> None:
    """One control record: a line `kind text`."""
    import os

    data = (kind + " " + text.replace("\n", " ") + "\n").encode("utf-8", "replace")
    while data:
        data = data[os.write(fd, data):]


def _sv_arm_deadline(seconds: float, ctl: int) -> None:
    """Backup wall clock: the sandbox dies on its own even if the parent has vanished."""
    import os
    import signal

    def expire(signum, frame):
        _sv_say(ctl, "deadline")
        try:
            os.killpg(0, signal.SIGKILL)
        finally:
            os._exit(0)

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _sv_stdin_fd(text: str, workdir: str) -> int:
    """A readable fd positioned at the start of the program's stdin (no pipe deadlocks)."""
    import fcntl
    import os

    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("stdin", 0)
    else:
        import tempfile

        fd = os.dup(tempfile.TemporaryFile(dir=workdir).fileno())
    data = text.encode("utf-8")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    new = fcntl.fcntl(fd, fcntl.F_DUPFD, 100)
    os.close(fd)
    return new


def _sv_isolate_filesystem(spec: dict) -> str:
    """Inside a fresh mount namespace, build a new root that holds only what a Python
    program needs, all read-only: the system directories (/usr, /etc, /lib*, /bin, /sbin),
    the Python installation, the namespace's own /proc, a minimal /dev and a private
    size-limited tmpfs at /tmp (the working directory). Then chroot into it. Host data
    (/work, /home, /root, /tmp, ...) is simply absent, so it can be neither read nor written;
    the unprivileged program cannot leave the chroot."""
    import ctypes
    import os
    import sys

    rdonly, nosuid, nodev, remount, bind = 1, 2, 4, 32, 4096
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.c_ulong, ctypes.c_char_p)

    def mount(source, target, fstype, flags, data=None):
        enc = (lambda s: None if s is None else s.encode())
        if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {target}: {os.strerror(err)}")

    system = ["/usr", "/etc", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin"]
    python = [sys.base_prefix, sys.prefix, sys.exec_prefix] + list(spec["site_packages"])
    python = sorted({os.path.realpath(p) for p in python if os.path.isdir(p)})
    covered = lambda p, roots: any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)
    python = [p for p in python if not covered(p, [q for q in python if q != p])]
    python = [p for p in python if not covered(p, system)]
    links = {d: os.readlink(d) for d in system if os.path.islink(d)}
    dirs = [d for d in system if d not in links and os.path.isdir(d)] + python + ["/proc"]
    devices = [d for d in ("null", "zero", "full", "random", "urandom")
               if os.path.exists("/dev/" + d)]
    # Open every source before anything is mounted over it.
    sources = {d: os.open(d, os.O_PATH) for d in dirs}
    sources.update({"/dev/" + d: os.open("/dev/" + d, os.O_PATH) for d in devices})

    root = "/tmp"  # any existing directory works as the mount point in our own namespace
    mount("tmpfs", root, "tmpfs", nosuid | nodev, "mode=0755,size=1m")
    for link, target in links.items():
        os.symlink(target, root + link)
    # The private /tmp first: a Python installed under /tmp (a CI virtualenv) is then bound inside it.
    uid = spec["uid"]
    os.makedirs(root + "/tmp", 0o755)
    mount("tmpfs", root + "/tmp", "tmpfs", nosuid | nodev,
          f"size={spec['disk_mb']}m,nr_inodes=4096,mode=0700,uid={uid},gid={uid}")
    for d in dirs:
        os.makedirs(root + d, 0o755, exist_ok=True)
        mount(f"/proc/self/fd/{sources[d]}", root + d, None, bind)
        mount(None, root + d, None, remount | bind | rdonly | nosuid | nodev)
    os.makedirs(root + "/dev", 0o755)
    mount("tmpfs", root + "/dev", "tmpfs", nosuid, "mode=0755,size=64k")
    for d in devices:
        open(root + "/dev/" + d, "w").close()
        mount(f"/proc/self/fd/{sources['/dev/' + d]}", root + "/dev/" + d, None, bind)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + name)
    os.mkdir(root + "/dev/shm")
    mount(None, root + "/dev", None, remount | rdonly | nosuid)
    mount("tmpfs", root + "/dev/shm", "tmpfs", nosuid | nodev, "mode=1777,size=16m")
    for fd in sources.values():
        os.close(fd)
    mount(None, root, None, remount | rdonly | nosuid | nodev)
    os.chroot(root)
    os.chdir("/")
    return "/tmp"


def _sv_child(spec: dict, workdir: str, path: str, stdin_fd: int, data: int, ctl: int) -> None:
    """The forked program process: limits, privilege drop, then run the source as __main__."""
    import os
    import sys

    try:
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        os.dup2(data, 3)
        os.close(data)
        _sv_limit(spec["limits"])
        uid = spec["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        _sv_no_new_privs()
        os.chdir(workdir)
        os.environ.clear()
        os.environ.update({"PATH": spec["path_env"], "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                           "HOME": workdir, "TMPDIR": workdir, "OMP_NUM_THREADS": "1",
                           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        sys.path.extend(spec["site_packages"])
        import site

        site.setquit()  # exit()/quit() builtins, which -S leaves out
    except BaseException as exc:  # noqa: BLE001
        try:
            _sv_say(ctl, "setup_error", "child: " + repr(exc))
        finally:
            os._exit(122)
    try:
        code = compile(spec["source"], path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
        import traceback

        _sv_say(ctl, "syntax_error", repr(exc))
        traceback.print_exception(type(exc), exc, None)
        sys.stderr.flush()
        os._exit(1)
    os.close(ctl)
    del spec
    _sv_exec_main(code, path)


def _sv_limit(limits: dict) -> None:
    import resource

    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _sv_no_new_privs() -> None:
    """PR_SET_NO_NEW_PRIVS: setuid binaries cannot hand root back to the program."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


def _sv_exec_main(code, path: str) -> None:
    """Run compiled code as __main__ with interpreter-like exit semantics, then exit."""
    import builtins
    import os
    import sys
    import types

    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [path]
    rc = 0
    try:
        exec(code, main.__dict__)
    except SystemExit as exc:
        rc = _sv_exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - an uncaught exception, like the interpreter
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        rc = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()  # wait for non-daemon threads, as at exit
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as exc:
        rc = _sv_exit_code(exc)
    except BaseException:  # noqa: BLE001
        rc = rc or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            rc = rc or 120
    os._exit(rc)


def _sv_exit_code(exc: SystemExit) -> int:
    import sys

    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except BaseException:  # noqa: BLE001
        pass
    return 1


_SUPERVISOR_FUNCS = (_sv_main, _sv_say, _sv_arm_deadline, _sv_stdin_fd, _sv_isolate_filesystem,
                     _sv_child, _sv_limit, _sv_no_new_privs, _sv_exec_main, _sv_exit_code)
_supervisor_source: str | None = None


def _supervisor_code() -> str:
    global _supervisor_source
    if _supervisor_source is None:
        body = "\n\n".join(inspect.getsource(f) for f in _SUPERVISOR_FUNCS)
        _supervisor_source = "import sys\n\n" + body + "\n\n_sv_main(sys.argv[1:])\n"
    return _supervisor_source


# --------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------


class _UidPool:
    """Hands out throwaway uids, one per concurrently running program."""

    def __init__(self, size: int = _UID_BLOCK) -> None:
        self.base = _UID_BASE + (os.getpid() % 4096) * _UID_BLOCK
        self.size = size
        self._free = list(range(self.base + size - 1, self.base - 1, -1))
        self._cond = threading.Condition()

    def acquire(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def release(self, uid: int) -> None:
        with self._cond:
            self._free.append(uid)
            self._cond.notify()


_uids: _UidPool | None = None
_tier: str | None = None
_tier_lock = threading.Lock()
_warned: set = set()


def _uid_pool() -> _UidPool:
    global _uids
    with _tier_lock:
        if _uids is None:
            _uids = _UidPool()
        return _uids


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _site_dirs() -> list:
    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def _python_world_readable() -> bool:
    """Can an unrelated uid run this interpreter and import its stdlib/site-packages?"""
    for path in [sys.base_prefix, sys.prefix] + _site_dirs():
        parts = os.path.realpath(path).strip("/").split("/")
        for i in range(1, len(parts) + 1):
            if os.stat("/" + "/".join(parts[:i])).st_mode & 0o005 != 0o005:
                return False
    return True


def isolation_level() -> str:
    """The strongest tier available here (probed once, with a warning when degraded)."""
    global _tier
    with _tier_lock:
        if _tier is not None:
            return _tier
    tier, reason = "rlimits", ""
    if os.geteuid() != 0:
        reason = "not running as root"
    elif shutil.which("unshare") is None:
        reason = "util-linux `unshare` not found"
    else:
        try:
            probe = _run("print(6 * 7)", "", SandboxConfig(timeout_s=10.0), "namespaces")
            if probe.status == "ok" and probe.stdout.strip() == "42":
                tier = "namespaces"
            else:
                reason = f"namespace probe failed ({probe.status}: {probe.stderr.strip()[-300:]})"
        except Exception as exc:  # noqa: BLE001 - any failure means: use a weaker tier
            reason = f"namespace probe failed ({exc!r})"
    if tier != "namespaces" and os.geteuid() == 0 and _python_world_readable():
        tier = "uid"
    if tier != "namespaces":
        what = ("programs run as an unprivileged uid with resource limits, but without "
                "network or filesystem isolation" if tier == "uid" else
                "programs run with resource limits only: no network, filesystem or "
                "process isolation from this user"
                + (" (and, as root, no process-count limit)" if os.geteuid() == 0 else ""))
        _warn_once("tier", f"marl_jax sandbox: namespaces unavailable ({reason}); {what}.")
    with _tier_lock:
        _tier = tier
    return tier


def _resolve_tier(config: SandboxConfig) -> str:
    best = isolation_level()
    if config.isolation == "auto":
        return best
    if ISOLATION_TIERS.index(config.isolation) < ISOLATION_TIERS.index(best):
        raise SandboxError(f"isolation={config.isolation!r} requested but only {best!r} is "
                           f"available here (run as root with util-linux unshare)")
    return config.isolation


class _Capped:
    """Keeps the first `cap` bytes of a stream, counts (and drops) the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        if len(chunk) > room:
            self.truncated = True


def _limits(config: SandboxConfig) -> dict:
    cpu = config.cpu_s if config.cpu_s is not None else math.ceil(config.timeout_s) + 1
    cpu = max(1, math.ceil(cpu))
    mem = config.memory_mb << 20
    fsize = config.file_size_mb << 20
    return {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (mem, mem),
            "RLIMIT_NPROC": (config.max_processes, config.max_processes),
            "RLIMIT_FSIZE": (fsize, fsize), "RLIMIT_CORE": (0, 0),
            "RLIMIT_NOFILE": (config.max_open_files, config.max_open_files)}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _terminate(proc: subprocess.Popen, tier: str) -> None:
    """Kill a run that is still going. In a pid namespace, kill its init (the supervisor)
    and let `unshare` reap it: `unshare` exits only once every process in the namespace
    is gone. Then kill the group (which also covers the weaker tiers)."""
    if tier == "namespaces" and proc.poll() is None:
        kids = _children(proc.pid)
        for kid in kids:
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if kids:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
    _kill_group(proc.pid)


def _await_group_gone(pgid: int, limit_s: float = 3.0) -> None:
    """SIGKILL the group until no member is left (dying processes linger briefly)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(0.005)


def _kill_uid(uid: int) -> None:
    """Kill every process of a sandbox uid (catches programs that left their group)."""
    subprocess.run([sys.executable, "-I", "-S", "-c",
                    "import os, signal\ntry: os.kill(-1, signal.SIGKILL)\nexcept OSError: pass"],
                   user=uid, group=uid, extra_groups=[], env={"PATH": _SAFE_PATH},
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=10, check=False)


def _run(source: str, stdin: str, config: SandboxConfig, tier: str) -> SandboxResult:
    """One sandboxed run in a given tier."""
    uid = _uid_pool().acquire() if tier in ("namespaces", "uid") else None
    workdir = None
    proc = None
    ctl_r = data_r = -1
    try:
        if tier != "namespaces":
            workdir = tempfile.mkdtemp(prefix="marl_sbx_")
            if uid is not None:
                os.chown(workdir, uid, uid)
        wall = config.timeout_s + config.startup_grace_s
        spec = {"tier": tier, "source": source, "stdin": stdin, "filename": "main.py",
                "workdir": workdir, "uid": uid, "disk_mb": config.disk_mb,
                "limits": _limits(config), "deadline_s": wall + 1.0, "path_env": _SAFE_PATH,
                "site_packages": _site_dirs() if config.site_packages else []}
        blob = memoryview(marshal.dumps(spec))
        ctl_r, ctl_w = os.pipe()
        data_r, data_w = os.pipe()
        argv = [sys.executable, "-I", "-S", "-B", "-c", _supervisor_code(), str(ctl_w),
                str(data_w)]
        if tier == "namespaces":
            argv = [shutil.which("unshare") or "unshare", "--net", "--mount", "--pid", "--ipc",
                    "--uts", "--fork", "--kill-child", "--mount-proc"] + argv
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(ctl_w, data_w),
                                    env={"PATH": _SAFE_PATH, "LANG": "C.UTF-8",
                                         "LC_ALL": "C.UTF-8"},
                                    cwd="/", start_new_session=True, close_fds=True)
        finally:
            os.close(ctl_w)
            os.close(data_w)
        outs = _pump(proc, blob, ctl_r, data_r, config, start + wall, tier)
        wall_time = outs["wall_time"] - start
        if tier == "namespaces" and not outs["timed_out"]:
            try:  # the supervisor has ended; unshare exits once the namespace is empty
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        _terminate(proc, tier)
        proc.wait()
        _await_group_gone(proc.pid)
        if uid is not None and tier == "uid":
            _kill_uid(uid)
        return _result(proc, outs, wall_time, tier)
    finally:
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
            proc.wait()
        for fd in (ctl_r, data_r):
            if fd >= 0:
                os.close(fd)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            _uid_pool().release(uid)


def _pump(proc: subprocess.Popen, blob: memoryview, ctl_r: int, data_r: int,
          config: SandboxConfig, deadline: float, tier: str) -> dict:
    """Feed the spec, collect outputs (capped) until the supervisor ends or time runs out."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    caps = {proc.stdout.fileno(): _Capped(config.max_output_bytes),
            proc.stderr.fileno(): _Capped(config.max_stderr_bytes),
            ctl_r: _Capped(1 << 16), data_r: _Capped(config.max_channel_bytes)}
    sel = selectors.DefaultSelector()
    for fd in caps:
        sel.register(fd, selectors.EVENT_READ)
    stdin_fd = proc.stdin.fileno()
    os.set_blocking(stdin_fd, False)
    sel.register(stdin_fd, selectors.EVENT_WRITE)
    timed_out = False
    supervisor_done = False
    ended = None
    try:
        while True:
            open_reads = [k.fd for k in sel.get_map().values() if k.fd != stdin_fd]
            if not open_reads:
                break
            now = time.monotonic()
            if now >= deadline:
                if supervisor_done or timed_out:
                    break  # something escaped and still holds a pipe: stop listening
                timed_out = True
                ended = now
                _terminate(proc, tier)
                deadline = time.monotonic() + 1.0
            for key, _ in sel.select(max(0.0, deadline - now)):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        blob = blob[os.write(fd, blob[:1 << 16]):]
                    except (BrokenPipeError, OSError):
                        blob = blob[:0]
                    if not blob:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    caps[fd].add(chunk)
                    continue
                sel.unregister(fd)
                if fd == ctl_r and not supervisor_done:
                    # Supervisor gone: in a pid namespace everything dies with it; in the
                    # weaker tiers kill leftovers that would hold the pipes. Drain briefly.
                    supervisor_done = True
                    ended = ended or time.monotonic()
                    if tier != "namespaces":
                        _kill_group(proc.pid)
                    if not timed_out:
                        deadline = min(deadline, time.monotonic() + 2.0)
    finally:
        sel.close()
        if not proc.stdin.closed:
            proc.stdin.close()
    return {"stdout": caps[proc.stdout.fileno()], "stderr": caps[proc.stderr.fileno()],
            "ctl": caps[ctl_r], "data": caps[data_r], "timed_out": timed_out,
            "wall_time": ended or time.monotonic()}


def _result(proc: subprocess.Popen, outs: dict, wall_time: float, tier: str) -> SandboxResult:
    records = {}
    for line in bytes(outs["ctl"].data).decode("utf-8", "replace").splitlines():
        kind, _, text = line.partition(" ")
        records.setdefault(kind, text)
    stdout, stderr = outs["stdout"], outs["stderr"]
    if "setup_error" in records:
        raise SandboxError(f"sandbox setup failed: {records['setup_error']}; stderr: "
                           f"{bytes(stderr.data).decode('utf-8', 'replace')[-500:]}")
    returncode: int | None
    if outs["timed_out"] or "deadline" in records:
        status, returncode = "timeout", None
    elif "syntax_error" in records:
        status, returncode = "syntax_error", 1
    elif "exit" in records:
        returncode = int(records["exit"])
        status = "ok" if returncode == 0 else "crash"
    elif "signal" in records:
        sig = int(records["signal"])
        returncode = -sig
        status = {signal.SIGXCPU: "timeout", signal.SIGKILL: "killed"}.get(sig, "crash")
    else:
        # The supervisor itself did not report (killed from inside in a weak tier).
        returncode = proc.returncode
        status = "killed" if returncode == -signal.SIGKILL else "crash"
    return SandboxResult(
        status=status, returncode=returncode,
        stdout=bytes(stdout.data).decode("utf-8", "replace"),
        stderr=bytes(stderr.data).decode("utf-8", "replace"),
        wall_time_s=wall_time, stdout_truncated=stdout.truncated,
        stderr_truncated=stderr.truncated, channel=bytes(outs["data"].data),
        isolation=tier, pgid=proc.pid)


def run_program(source: str, stdin: str = "", config: SandboxConfig | None = None) -> SandboxResult:
    """Run `source` as __main__ of a fresh sandboxed interpreter with `stdin` as its input."""
    if not isinstance(source, str):
        raise TypeError(f"source must be str, got {type(source).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be str, got {type(stdin).__name__}")
    config = config or SandboxConfig()
    return _run(source, stdin, config, _resolve_tier(config))


def run_many(jobs: Sequence[Job], max_workers: int | None = None) -> list[SandboxResult]:
    """Run jobs concurrently (at most `max_workers` at once, default: CPU count); results
    come back in job order."""
    jobs = list(jobs)
    if not jobs:
        return []
    workers = max_workers or os.cpu_count() or 1
    if workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    isolation_level()  # probe once, before the threads race for it
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        return list(pool.map(lambda j: run_program(j.source, j.stdin, j.config), jobs))


def sandbox_processes() -> list[int]:
    """Pids of live processes running under this process's sandbox uids (should be empty
    between runs; useful to check that nothing escaped)."""
    pool = _uid_pool()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        real = int(line.split()[1])
                        if pool.base <= real < pool.base + pool.size:
                            found.append(int(entry))
                        break
        except OSError:
            continue
    return found
