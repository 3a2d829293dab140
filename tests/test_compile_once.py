"""Compile once: after the first step a run compiles no XLA program, whatever lengths its completions take.

The trainer records the seconds XLA spends compiling in every step's record (`compile_s`, from jax's compile
events; marl_jax.train.compiles). The update's item shapes come from a set fixed by the config
(rl.layout.update_shapes at plan.update_lengths) and the sampler's from each stage's CallShape
(plan.call_shapes), both compiled before step 1 (train.warmup): a tiny random model whose completions stop
anywhere between 1 and 24 tokens, and whose aggregator's prompts grow with the voters' outputs, compiles
nothing after its first step. The scheduler's own loop, replayed over random lengths, meets no batch size or
compaction outside the warm-up's set.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from marl_jax.train.loop import Trainer
from marl_jax.train.metrics import read_metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_learning import digit_tasks, learning_config, tiny_tokenizer  # noqa: E402

STEPS = 6


def varied_config(prompt_dir):
    c = learning_config("isolated", prompt_dir)
    c.num_tasks = 3
    c.rollout.group_size = 4
    c.rollout.max_new_tokens.generator = 24
    c.rollout.max_new_tokens.aggregator = 24
    c.rollout.prompt_tokens = 16  # the tiny prompts' length: the sampler's prompt region and the update's rows
    c.task.update(size=60, val_size=4)
    c.grpo.update(micro_batch=8, diagnostics_every=2)  # both update programs (with and without diagnostics)
    c.train.update(steps=STEPS, val_every=100, ckpt_every=100, warmup=True)
    return c


@pytest.fixture(scope="module")
def varied_run(prompt_dir, tmp_path_factory):
    from marl_jax.models.tiny import tiny_model

    workdir = str(tmp_path_factory.mktemp("varied"))
    trainer = Trainer(varied_config(prompt_dir), workdir, model=tiny_model(tiny_tokenizer(), seed=3),
                      tasks=digit_tasks(64), progress=False)
    trainer.run()
    recs = [r for r in read_metrics(workdir) if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in recs)
    # The completions' lengths vary from step to step (else the tests show nothing)
    generated = [round(r["tokens_per_s"] * r["step_s"]) for r in recs]
    print("compile_s by step:", [round(r["compile_s"], 2) for r in recs], "update:",
          [round(r["update_compile_s"], 2) for r in recs], "warm-up:", recs[0].get("warmup_compile_s"),
          "tokens generated:", generated)
    assert len(set(generated)) > 1, f"every step generated the same number of tokens: {generated}"
    return recs


def test_the_update_compiles_only_in_the_warm_up(varied_run):
    recs = varied_run
    assert recs[0]["warmup_programs"] > 0 and recs[0]["warmup_compile_s"] > 0
    late = {r["step"]: (r["update_compile_s"], r["update_compile_programs"]) for r in recs
            if r["update_compile_programs"]}
    assert not late, f"update programs compiled after the warm-up (seconds, programs): {late}"


def test_steps_after_the_first_compile_nothing(varied_run):
    late = {r["step"]: (r["compile_s"], r["compile_programs"]) for r in varied_run[1:] if r["compile_programs"]}
    assert not late, f"steps after the first compiled (seconds, programs): {late}"


@pytest.mark.parametrize("per_octave", [2, 4, 16])
def test_every_compaction_a_call_runs_is_in_the_warm_up_set(per_octave):
    """The batch sizes and compactions the scheduler runs over many draws of long-tailed lengths (the
    sampler's own decision loop over simulated rows) stay inside what Sampler.warmup compiles."""
    from marl_jax.generate import buckets
    from marl_jax.generate.scheduler import Scheduler, SchedulerConfig, SimulatedRows

    class Recorded(SimulatedRows):
        def compact(self, idx, keep):
            moves.add((len(self.left), len(idx)))
            super().compact(idx, keep)

    rng = np.random.default_rng(0)
    for rows in (12, 24, 64, 200):
        config = SchedulerConfig(max_batch=256, min_batch=8, per_octave=per_octave, patience=8)
        B = config.first_batch(rows)
        sizes, allowed = set(buckets.compaction_sizes(B, 8, 1, per_octave)), set(buckets.compaction_moves(B, 8, 1, per_octave))
        for _ in range(30):
            moves = set()
            lengths = np.where(rng.random(rows) < 0.8, rng.integers(1, 40, rows), rng.integers(40, 300, rows))
            sched = Scheduler(config, [(0, 1)] * rows)
            sched.run(Recorded(lengths, B))
            assert sched.stats["compactions"] > 0
            assert sched.sizes <= sizes, (rows, sorted(sched.sizes - sizes))
            assert moves <= allowed, (rows, sorted(moves - allowed))


def test_the_sampler_on_a_mesh_compiles_only_in_the_warm_up():
    """On 8 fake CPU devices (data x fsdp x model 2x2x2, and 8 data shards), dense and paged: each warm-up
    program compiled for the shardings the one before it gives the state, calls with long-tailed completions
    and prefix-cache hits compile nothing after it, and give a one-device sampler's greedy tokens."""
    import json
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, os.path.join(repo, "tests", "sampler_warmup_mesh_driver.py")], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert report["devices"] == 8 and len(report["runs"]) == 4, report
    for name, r in report["runs"].items():
        assert r["warmup_programs"] > 0 and r["cached_tokens"] > 0, (name, r)
        assert r["same"], (name, r)
        assert r["compiled_after"] == [0, 0, 0], (name, r)
