"""A run killed with SIGKILL part-way and restarted on the same workdir reproduces the uninterrupted run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from marl_jax.train.checkpoint import Checkpointer
from marl_jax.train.loop import TIMING_KEYS
from marl_jax.train.metrics import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 6


def _cmd(workdir, prompt_dir, policy):
    return [sys.executable, os.path.join(HERE, "resume_driver.py"), str(workdir), prompt_dir, policy, str(STEPS)]


def _comparable(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def _final_state(workdir):
    with Checkpointer(str(workdir), read_only=True) as ck:
        state, meta = ck.restore(STEPS)
    return state, meta


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["isolated"])
def test_killed_run_resumes_to_the_same_metrics_and_parameters(policy, prompt_dir, tmp_path):
    ref, cut = tmp_path / "uninterrupted", tmp_path / "killed"
    subprocess.run(_cmd(ref, prompt_dir, policy), check=True, capture_output=True, timeout=600)

    proc = subprocess.Popen(_cmd(cut, prompt_dir, policy), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    # Kill once a mid-run checkpoint is committed and a later step has started writing metrics.
    while time.time() < deadline:
        steps = Checkpointer(str(cut), read_only=True).all_steps() if (cut / "checkpoints").exists() else []
        later = [r["step"] for r in read_metrics(str(cut))] if (cut / "metrics.jsonl").exists() else []
        if steps and 2 <= max(steps) < STEPS and max(later, default=0) > max(steps):
            break
        if proc.poll() is not None:
            pytest.fail("the run finished before it could be killed; lengthen it")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(r["step"] for r in read_metrics(str(cut)))
    assert killed_at < STEPS
    subprocess.run(_cmd(cut, prompt_dir, policy), check=True, capture_output=True, timeout=600)

    a, b = _comparable(read_metrics(str(ref))), _comparable(read_metrics(str(cut)))
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert a == b
    sa, _ = _final_state(ref)
    sb, _ = _final_state(cut)
    import jax

    for x, y in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restart_without_a_checkpoint_drops_the_dead_attempts_records(prompt_dir, tmp_path):
    """A run killed before its first checkpoint leaves metrics but nothing to restore: the next start runs
    from step 0 and must not keep the old records (each step once, and the end-of-run summary is written)."""
    import json

    from marl_jax.models.tiny import tiny_model
    from marl_jax.train.loop import Trainer
    from test_learning import digit_tasks, learning_config, tiny_tokenizer

    workdir = tmp_path / "run"
    workdir.mkdir()
    stale = [{"step": s, "val/success": 0.5, "stale": 1.0} for s in range(4)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stale))
    c = learning_config("shared", prompt_dir)
    c.num_tasks, c.rollout.group_size = 2, 2
    c.task.update(size=20, val_size=2)
    c.train.update(steps=2, val_every=10, ckpt_every=10, tensorboard=False, warmup=False)
    out = Trainer(c, str(workdir), model=tiny_model(tiny_tokenizer(), seed=1), tasks=digit_tasks(22),
                  progress=False).run()  # the end-of-run cliff check refused repeated steps before
    recs = read_metrics(workdir)
    assert not any("stale" in r for r in recs)
    for key in ("loss", "val/success"):
        steps = [r["step"] for r in recs if key in r]
        assert steps and steps == sorted(set(steps)), (key, steps)
    assert out["table"]
