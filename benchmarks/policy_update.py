"""Isolated- vs Shared-Policy update cost on the same rows, same run.

    python benchmarks/policy_update.py [--rows=4,12,4 --micro_batch=4 --prompt_len=40 --completion_len=32]

Workload: three roles (orchestrator, worker, synthesizer) with --rows rows each (a workflow whose
middle role runs several copies has more rows there), random tokens, random nonzero advantages, on
SmolLM2-135M-Instruct (embedded) in float32 with LoRA rank 8 on every linear layer, per-role gradient
diagnostics on (as in training). The same rows are updated under Shared-Policy (one slot) and
Isolated-Policy (one slot per role). The update's work is the rows' forward and backward passes, so
the two should cost about the same: Isolated-Policy runs one item per (slot, micro-batch) and skips
items of padding only (a slot with fewer rows than the largest).

Each step is timed after a warm-up call (compilation excluded); the best of --reps is reported.
Prints both step times, the micro-batches each computed, and as its last line
`ip_over_sp=<Isolated step time / Shared step time>`.
"""
from __future__ import annotations

import argparse
import sys

from common import time_steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", default="4,12,4", help="rows of the orchestrator, worker and synthesizer roles")
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=40)
    p.add_argument("--completion_len", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    try:
        args.rows = [int(x) for x in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows takes three comma-separated integers, got {args.rows!r}")
    if len(args.rows) != 3 or min(args.rows) < 1:
        p.error("--rows takes three integers >= 1 (orchestrator, worker, synthesizer)")
    return args


def main(argv=None):
    args = parse_args(argv)
    from marl_jax.jax_setup import loaded_allocator

    print(f"allocator: {loaded_allocator()}")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.models.loading import load_model
    from marl_jax.policy.lora import PolicySpec, init_trainable
    from marl_jax.rl import optim
    from marl_jax.rl.batch import make_batch, make_groups
    from marl_jax.rl.update import UpdateConfig, init_state, make_train_step
    from train_step import Row

    m = load_model(args.model)
    cfg, base = m.cfg, jax.device_put(m.params)
    roles = ["orchestrator", "worker", "synthesizer"]
    rng = np.random.RandomState(0)
    rows = [Row(rng.randint(3, 1000, args.prompt_len).tolist(), rng.randint(3, 1000, args.completion_len).tolist(),
                list(-rng.rand(args.completion_len)), role)
            for role, n in zip(roles, args.rows) for _ in range(n)]
    advs = (rng.choice([-1.0, 1.0], len(rows)) * rng.uniform(0.2, 1.5, len(rows))).astype(np.float32)
    ucfg = UpdateConfig(micro_batch=args.micro_batch)
    tx = optim.per_slot(optim.make_optimizer(lr=1e-5, grad_clip=1.0))
    print(f"workload: rows {dict(zip(roles, args.rows))}, prompt {args.prompt_len} + completion "
          f"{args.completion_len} tokens, micro-batch {args.micro_batch}, LoRA rank 8, diagnostics on, {args.model}")

    result = {}
    for name, role_to_slot in (("shared", {r: 0 for r in roles}), ("isolated", {r: i for i, r in enumerate(roles)})):
        slots = len(set(role_to_slot.values()))
        spec = PolicySpec(rank=8, alpha=16, num_slots=slots)
        groups = make_groups(roles, role_to_slot, None)
        batch = make_batch(rows, advs, role_to_slot=role_to_slot, num_slots=slots, groups=groups,
                           micro_batch=args.micro_batch, pad_id=0, agg=ucfg.agg)
        busy = int(np.sum(batch.row_weight.reshape(slots, -1, args.micro_batch).max(-1) > 0))
        batch = jax.tree_util.tree_map(jnp.asarray, batch)
        step = make_train_step(cfg, spec, ucfg, tx, num_groups=len(groups.names), group_slot=groups.slot,
                               group_role=[roles.index(r) for r in groups.role], num_roles=len(roles),
                               role_slot=[role_to_slot[r] for r in roles])
        state = init_state(init_trainable(spec, cfg, base, jax.random.PRNGKey(0)), tx)
        state, warm, first, times = time_steps(step, state, base, batch, args.reps)
        result[name] = min(times)
        S, R, T = batch.tokens.shape
        print(f"{name}: step {min(times):.2f}s (first call incl. compile {warm:.1f}s); arrays [S={S}, R={R}, T={T}]; "
              f"{busy} of {S * R // args.micro_batch} micro-batches hold rows")
    print(f"ip_over_sp={result['isolated'] / result['shared']:.2f}")


if __name__ == "__main__":
    from marl_jax.jax_setup import use_fast_allocator

    use_fast_allocator()  # XLA temporaries without a page fault per 4 KiB (MARL_JAX_MALLOC=off: glibc)
    sys.exit(main())
