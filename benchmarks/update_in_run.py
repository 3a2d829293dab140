"""The update inside a training run against the same update alone, on the same rows.

    python benchmarks/update_in_run.py --config=configs/orch_workers.py            # the default run, 3 steps
    python benchmarks/update_in_run.py --config=configs/single_agent.py --config.num_tasks=8 --steps=4
    python benchmarks/update_in_run.py --config=configs/orch_workers.py --small    # 2 tasks x 2 episodes

The run is launch/run.py's: the preset with its defaults (and any --config.x=y), the trainer's warm-up before
step 1, then --steps training steps through Trainer.train_step (validation, checkpoints and plots off: they are
not the update). Each step's `update_s` is what metrics.jsonl logs: from the finished batch to the new state
on the host (layout of the items, their forward/backward, the optimizer, the metrics read back). Then, on each
step's own rows (the TrainBatch the run built), the update alone, timed as benchmarks/train_step.py times it
(one untimed call, then --reps timed calls on the same batch, median):
  - `alone`: the run's own update program (Trainer.step_fn, the same compiled item programs);
  - `bench`: train_step.py's headline update (make_train_step with the run's UpdateConfig, diagnostics and
    token metrics off).
Prints a line per step and `in_run_over_bench=<median in-run update_s / median bench>` (goal <= 1.5), with
`in_run_over_alone=`: what the run adds to its own update program (host work between items, memory), apart
from what diagnostics and metrics cost.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # marl_jax from a checkout

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

config_flags.DEFINE_config_file("config", None, "configs/<workflow>.py[:<model>,<task>]", lock_config=True)
flags.DEFINE_integer("steps", 3, "training steps (each one's rows are then updated alone)")
flags.DEFINE_integer("reps", 3, "timed calls of each update alone, per step")
flags.DEFINE_bool("small", False, "2 tasks x 2 episodes, 2 steps, 1 rep (the test)")
FLAGS = flags.FLAGS


def timed(step, state, base, batch, reps: int) -> tuple[float, float]:
    """(first call s, median of `reps` later calls) of step on a copy of state (donated by the step)."""
    import jax
    import jax.numpy as jnp

    from common import time_steps

    state = jax.tree_util.tree_map(jnp.copy, state)
    _, first, _, times = time_steps(step, state, base, batch, reps)
    return first, statistics.median(times)


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments {argv[1:]}")
    import jax

    from marl_jax.config import validate
    from marl_jax.rl.update import make_train_step
    from marl_jax.train import loop
    from marl_jax.train.loop import Trainer, to_device

    c = FLAGS.config.unlock()
    steps, reps = FLAGS.steps, FLAGS.reps
    if FLAGS.small:
        c.num_tasks, c.rollout.group_size, steps, reps = 2, 2, 2, 1
    c.train.update(steps=steps, val_every=10 ** 6, ckpt_every=10 ** 6, tensorboard=False, plots=False)
    validate(c)
    print(f"config: {c.workflow} / {c.policy}, {c.model.name} ({c.model.dtype}), {c.num_tasks} tasks x "
          f"{c.rollout.group_size} episodes, {steps} steps; update: micro_batch {c.grpo.micro_batch}, token budget "
          f"{c.grpo.max_tokens_per_micro_batch}, remat {c.grpo.remat}, packing {c.grpo.packing}, diagnostics "
          f"{c.grpo.diagnostics}, metrics {c.grpo.metrics}", flush=True)
    batches = []
    make_batch = loop.make_batch

    def recording(*a, **kw):  # the batch each step's update gets
        batches.append(make_batch(*a, **kw))
        return batches[-1]

    with tempfile.TemporaryDirectory() as work:
        t = Trainer(c, work, progress=False)
        w = t.warmup() if c.train.warmup else {}
        print(f"warm-up: {w.get('warmup_s', 0.0):.1f} s, {w.get('warmup_programs', 0)} programs", flush=True)
        rt = t.rt
        bench = make_train_step(rt.model.cfg, rt.spec, dataclasses.replace(t.ucfg, diagnostics=False, metrics=False),
                                t.tx, **t.tables)
        loop.make_batch = recording
        try:
            recs = []
            for s in range(steps):
                st = time.perf_counter()
                recs.append(t.train_step(s))
                r = recs[-1]
                print(f"step {s + 1}/{steps}: {time.perf_counter() - st:.1f} s, update_s {r['update_s']:.2f} "
                      f"(compiling {r.get('update_compile_s', 0.0):.2f} s), {len(batches[-1].den)} slot(s)",
                      flush=True)
        finally:
            loop.make_batch = make_batch
        rows = []
        for s, (r, b) in enumerate(zip(recs, batches)):
            dev = to_device(b)
            fn = t.step_fn if s % max(c.grpo.diagnostics_every, 1) == 0 else t.plain_step_fn
            _, alone = timed(fn, t.state, rt.base, dev, reps)
            first, ben = timed(bench, t.state, rt.base, dev, reps)
            rows.append((r["update_s"], alone, ben))
            print(f"step {s + 1} rows: in run {r['update_s']:.2f} s | alone (the run's program) {alone:.2f} s | "
                  f"bench (diagnostics, metrics off) {ben:.2f} s (its first call {first:.1f} s)", flush=True)
    in_run = statistics.median(x for x, _, _ in rows)
    alone = statistics.median(y for _, y, _ in rows)
    ben = statistics.median(z for _, _, z in rows)
    print(f"medians over {len(rows)} steps: in run {in_run:.2f} s, alone {alone:.2f} s, bench {ben:.2f} s "
          f"(backend {jax.default_backend()}, {jax.device_count()} device(s))")
    print(f"in_run_over_alone={in_run / alone:.2f}")
    print(f"in_run_over_bench={in_run / ben:.2f}")


if __name__ == "__main__":
    from marl_jax import cli

    flags.mark_flag_as_required("config")
    cli.run(main, "update_in_run.py")
