"""Hostile programs stay contained; normal programs still work.

Every hostile test keeps its limits small (short timeouts, few processes) so it is safe on a
shared machine and in CI. Tests whose protection needs namespaces skip in weaker tiers.
"""
from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import pytest

from marl_jax.tasks import sandbox
from marl_jax.tasks.sandbox import Job, SandboxConfig, run_many, run_program

TIER = sandbox.isolation_level()
needs_namespaces = pytest.mark.skipif(TIER != "namespaces",
                                      reason=f"needs namespace isolation (have {TIER!r})")


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _assert_nothing_left(res: sandbox.SandboxResult) -> None:
    assert _group_gone(res.pgid), "process group of the sandbox still alive"
    assert sandbox.sandbox_processes() == []


def test_normal_program_reads_stdin_and_prints():
    src = "import sys\nnums = [int(x) for x in sys.stdin.read().split()]\nprint(sum(nums))\n"
    res = run_program(src, "1 2 3\n40\n")
    assert res.status == "ok" and res.returncode == 0
    assert res.stdout == "46\n" and res.stderr == ""
    assert res.isolation == TIER


def test_exit_codes_and_exceptions_like_the_interpreter():
    assert run_program("import sys; sys.exit(0)").status == "ok"
    res = run_program("exit(3)")  # site's exit() must exist even without site hooks
    assert (res.status, res.returncode) == ("crash", 3)
    res = run_program("raise KeyError('nope')")
    assert res.status == "crash" and res.returncode == 1 and "KeyError: 'nope'" in res.stderr


def test_syntax_error_is_reported_as_such():
    res = run_program("def f(:\n    pass\n")
    assert res.status == "syntax_error" and "SyntaxError" in res.stderr


def test_infinite_loop_times_out_and_the_group_is_killed():
    t0 = time.monotonic()
    res = run_program("while True:\n    pass\n", config=SandboxConfig(timeout_s=0.5))
    elapsed = time.monotonic() - t0
    assert res.status == "timeout" and res.returncode is None
    assert 0.5 <= res.wall_time_s and elapsed < 5.0
    _assert_nothing_left(res)


def test_sleeping_child_processes_die_with_the_program():
    # The program exits at once but leaves a sleeping child behind in its group.
    src = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nelse:\n    print('bye')\n"
    t0 = time.monotonic()
    res = run_program(src, config=SandboxConfig(timeout_s=5.0))
    assert res.status == "ok" and "bye" in res.stdout
    assert time.monotonic() - t0 < 4.0
    _assert_nothing_left(res)


@pytest.mark.skipif(TIER == "rlimits" and os.geteuid() == 0,
                    reason="RLIMIT_NPROC does not bind root: unsafe without a sandbox uid")
def test_fork_bomb_is_contained():
    src = ("import os\n"
           "while True:\n"
           "    try:\n"
           "        os.fork()\n"
           "    except OSError:\n"
           "        pass\n")
    res = run_program(src, config=SandboxConfig(timeout_s=1.0, max_processes=8))
    assert res.status in ("timeout", "crash", "killed")
    _assert_nothing_left(res)
    assert run_program("print('still fine')").stdout == "still fine\n"


def test_ten_gigabyte_allocation_fails_inside_the_sandbox():
    res = run_program("x = bytearray(10 * 1024 ** 3)\nprint('allocated')\n")
    assert res.status in ("crash", "killed")
    assert "allocated" not in res.stdout
    assert res.status == "killed" or "MemoryError" in res.stderr
    _assert_nothing_left(res)


@needs_namespaces
def test_writing_outside_the_work_folder_does_not_touch_the_host(tmp_path):
    targets = [tmp_path / "escaped.txt", f"/tmp/marl_sbx_escape_{uuid.uuid4().hex}",
               f"/dev/shm/marl_sbx_escape_{uuid.uuid4().hex}",
               f"/var/tmp/marl_sbx_escape_{uuid.uuid4().hex}"]
    src = ("import sys\n"
           f"for path in {[str(t) for t in targets]!r}:\n"
           "    try:\n"
           "        with open(path, 'w') as f:\n"
           "            f.write('pwned')\n"
           "        print('wrote', path)\n"
           "    except OSError as exc:\n"
           "        print('blocked', path, type(exc).__name__)\n"
           "open('inside.txt', 'w').write('fine')\n"
           "print(open('inside.txt').read())\n")
    try:
        res = run_program(src)
        assert res.status == "ok", res.stderr
        assert res.stdout.strip().endswith("fine")  # its own folder stays writable
        for target in targets:
            assert not os.path.exists(target), f"sandbox created {target} on the host"
    finally:
        for target in targets:
            if os.path.exists(target):
                os.remove(target)


def test_parent_environment_is_invisible(monkeypatch):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("MARL_SANDBOX_TEST_SECRET", secret)
    src = ("import os\n"
           "print(dict(os.environ))\n"
           "for path in ['/proc/self/environ', '/proc/1/environ', f'/proc/{os.getppid()}/environ']:\n"
           "    try:\n"
           "        print(open(path, 'rb').read())\n"
           "    except OSError as exc:\n"
           "        print(path, type(exc).__name__)\n")
    res = run_program(src)
    assert res.status == "ok", res.stderr
    assert "MARL_SANDBOX_TEST_SECRET" not in res.stdout and secret not in res.stdout
    assert "'PATH'" in res.stdout  # a minimal environment is still there


@needs_namespaces
def test_network_is_blocked():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    src = ("import socket\n"
           "s = socket.socket()\n"
           "s.settimeout(2)\n"
           "try:\n"
           f"    s.connect(('127.0.0.1', {port}))\n"
           "    print('connected')\n"
           "except OSError as exc:\n"
           "    print('failed', type(exc).__name__)\n")
    try:
        res = run_program(src)
        assert res.status == "ok", res.stderr
        assert res.stdout.startswith("failed")
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever reached the host's listener
    finally:
        listener.close()


def test_signalling_the_parent_does_not_reach_the_test_process():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    me = os.getpid()
    attempts = ["os.kill(os.getppid(), signal.SIGTERM)",
                "os.killpg(os.getpgid(os.getppid()), signal.SIGTERM)"]
    if TIER == "namespaces":  # in weaker tiers the same uid really could signal us
        attempts += [f"os.kill({me}, signal.SIGTERM)", f"os.killpg({os.getpgid(me)}, signal.SIGTERM)",
                     "os.kill(-1, signal.SIGKILL)"]
    # The program ignores SIGTERM itself so that signalling its own group cannot end it early.
    src = "import os, signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + "".join(
        f"try:\n    {a}\n    print('sent')\nexcept OSError as exc:\n    print(type(exc).__name__)\n"
        for a in attempts)
    try:
        res = run_program(src)
        time.sleep(0.2)
        assert received == []
        if TIER == "namespaces":  # the test process is not even addressable from inside
            assert res.status == "ok", res.stderr
            outcomes = res.stdout.split()
            assert len(outcomes) == len(attempts), res.stdout
            # outcomes[1] signals the program's own group (pgid 0 from inside): harmless.
            assert outcomes[0] != "sent" and "sent" not in outcomes[2:], res.stdout
        else:  # same uid: the program may kill its own supervisor, nothing beyond it
            assert res.status in ("ok", "crash", "killed")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert run_program("print(1)").stdout == "1\n"


def test_megabytes_of_output_are_truncated_without_hanging():
    cap = 100_000
    t0 = time.monotonic()
    res = run_program("import sys\nfor _ in range(50):\n    sys.stdout.write('x' * 1_000_000)\n"
                      "sys.stderr.write('e' * 5_000_000)\n",
                      config=SandboxConfig(timeout_s=10.0, max_output_bytes=cap,
                                           max_stderr_bytes=1000))
    assert res.status == "ok"
    assert len(res.stdout) == cap and res.stdout_truncated and set(res.stdout) == {"x"}
    assert len(res.stderr) == 1000 and res.stderr_truncated
    assert time.monotonic() - t0 < 10.0


def test_endless_output_is_stopped_by_the_timeout():
    res = run_program("while True:\n    print('spam' * 1000)\n",
                      config=SandboxConfig(timeout_s=0.5, max_output_bytes=4096))
    assert res.status == "timeout" and len(res.stdout) == 4096 and res.stdout_truncated
    _assert_nothing_left(res)


def test_run_many_is_parallel_bounded_and_ordered():
    jobs = [Job(f"import time\ntime.sleep(0.6)\nprint({i} * {i})\n") for i in range(6)]
    t0 = time.monotonic()
    results = run_many(jobs, max_workers=3)
    elapsed = time.monotonic() - t0
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)]
    assert all(r.status == "ok" for r in results)
    assert elapsed < 6 * 0.6  # ran concurrently, not one after another
    assert run_many([]) == []


def test_rlimits_tier_runs_benign_programs():
    res = run_program("print(input().upper())", "abc\n", SandboxConfig(isolation="rlimits"))
    assert (res.status, res.stdout, res.isolation) == ("ok", "ABC\n", "rlimits")


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="docker")
    with pytest.raises(TypeError, match="source"):
        run_program(b"print(1)")  # type: ignore[arg-type]
