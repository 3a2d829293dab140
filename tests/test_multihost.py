"""Multi-host training on CPU: two processes (jax.distributed, gloo collectives, 2 devices each) train
on one 4-device mesh and produce the metrics of a single process with 4 devices; only process 0 writes."""
import json
import math
import os
import socket
import subprocess
import sys

import pytest

from marl_jax.train.loop import TIMING_KEYS
from marl_jax.train.metrics import read_metrics

DRIVER = os.path.join(os.path.dirname(__file__), "multihost_driver.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(pid, nproc, port, workdir, prompt_dir, local):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen([sys.executable, DRIVER, str(pid), str(nproc), str(port), str(workdir), prompt_dir,
                             str(local)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _finish(p, timeout=900):  # a hang's limit: three processes share CI's two cores with another worker
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-3000:]
    return json.loads([l for l in out.splitlines() if l.startswith("{")][-1])


@pytest.mark.slow
def test_two_processes_train_like_one_process_on_the_same_mesh(tmp_path, prompt_dir):
    port = _free_port()
    shared = tmp_path / "multi"  # one workdir for both processes, as on a shared filesystem
    procs = [_launch(i, 2, port, shared, prompt_dir, 2) for i in range(2)]
    single = _launch(0, 1, 0, tmp_path / "single", prompt_dir, 4)
    infos = [_finish(p) for p in procs]
    assert [(i["process"], i["devices"], i["local_devices"]) for i in infos] == [(0, 4, 2), (1, 4, 2)]
    assert _finish(single)["devices"] == 4

    multi, ref = read_metrics(shared), read_metrics(tmp_path / "single")
    assert [r["step"] for r in multi] == [r["step"] for r in ref] == [0, 1, 2, 2]  # written once, not twice
    for a, b in zip(multi, ref):
        assert set(a) == set(b)
        for k, v in a.items():
            if k in TIMING_KEYS or not isinstance(v, float):
                assert k in TIMING_KEYS or v == b[k], k
                continue
            assert math.isclose(v, b[k], rel_tol=1e-5, abs_tol=1e-6), (k, v, b[k])
    assert any(k.startswith("grad/") and a[k] > 0 for a in multi for k in a)  # the update really ran
    # Compile once on several processes too: the warm-up (update and sampler, one program at a time on each
    # process) compiles what the steps run, so no step compiles (nor loads from the cache): only the first
    # validation, before step 1, runs programs of its own.
    for recs in (multi, ref):
        assert recs[1]["warmup_programs"] > 0
        late = {(r["step"], k): r[k] for r in recs[1:] for k in r
                if k.split("/")[-1] in ("compile_programs", "compile_cache_hits") and r[k]}
        assert not late, f"compiled after the warm-up: {late}"
