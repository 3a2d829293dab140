"""Where the GRPO update's time goes on a short RL batch: useful FLOP/s under each knob, and the matmul floor.

    python benchmarks/update_anatomy.py                      # peers.py's short workload, synthetic tokens
    python benchmarks/update_anatomy.py --prompts=8 --episodes=8 --prompt_len=40 --completion_len=64

The batch is shaped like `benchmarks/peers.py --workload=short`: --prompts prompts of ~--prompt_len tokens,
each answered --episodes times with completions log-uniform from 2 to --completion_len tokens (most RL
completions stop early), on SmolLM2-135M (embedded) in float32, LoRA rank 8 on every linear layer, one slot.
marl_jax's update step (rl.update.make_train_step, what the trainer runs) is timed under the peers' settings
(remat=dots, micro-batch 8, packing over a shared 16-token prefix, token metrics on, diagnostics off) and
with one knob changed at a time; each variant compiles once, then --reps timed steps, median reported.

Useful FLOPs are benchmarks/train_step.py's rule (matmuls of real tokens with causal context, the LM head on
completion tokens only); executed FLOPs count what the step computes (every packed position, the head over
each unpacked row's scored window, a packed item's packed positions, the forward again under remat). The floor: the same executed matmuls at the
item's own shapes (M positions x the layer's widths, the head's rows x vocabulary), timed as plain jitted
matmuls, against the 2048^3 peak. Prints a table and `useful_of_peak=` for the peers' settings.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from common import matmul_peak, time_steps
from train_step import ROLE_NAMES, Row, start_lora, step_flops


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=40)
    p.add_argument("--completion_len", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="peers,metrics_off,remat_none,remat_full,mb16,mb32,mb64,budget1024,budget4096,no_packing",
                   help="comma-separated subset of the variants to time")
    return p.parse_args(argv)


VARIANTS = {  # name -> (what changes, UpdateConfig overrides)
    "peers": ("the peers' settings", {}),
    "metrics_off": ("token metrics off", dict(metrics=False)),
    "remat_none": ("remat=none", dict(remat="none")),
    "remat_full": ("remat=full", dict(remat="full")),
    "mb16": ("micro-batch 16", dict(micro_batch=16)),
    "mb32": ("micro-batch 32", dict(micro_batch=32)),
    "mb64": ("micro-batch 64 (one item)", dict(micro_batch=64)),
    "no_packing": ("no packing (token windows)", dict(packing=False, share_prefix=0)),
    "budget4096": ("items of <= 4096 positions (grpo.max_tokens_per_micro_batch)", dict(max_tokens_per_micro_batch=4096)),
    "budget1024": ("items of <= 1024 positions", dict(max_tokens_per_micro_batch=1024)),
}


def synth(args, vocab: int, special: set[int]) -> list[Row]:
    import numpy as np
    rng = np.random.RandomState(args.seed)
    ok = np.array([t for t in range(vocab) if t not in special])
    rows = []
    for _ in range(args.prompts):
        n = int(rng.randint(int(args.prompt_len * 0.8), int(args.prompt_len * 1.2) + 1))
        prompt = [int(t) for t in rng.choice(ok, n)]
        for _ in range(args.episodes):
            c = int(round(np.exp(rng.uniform(np.log(2), np.log(args.completion_len)))))
            comp = [int(t) for t in rng.choice(ok, c)]
            rows.append(Row(prompt, comp, [float(x) for x in rng.normal(-2.0, 0.5, c)], ROLE_NAMES[0]))
    return rows


def executed_flops(cfg, spec, plan, W: int, remat: str) -> tuple[float, list[tuple[int, int]]]:
    """FLOPs the step computes over its items (positions at their window, keys per query = the window) and
    the (positions, head rows) of each item."""
    from marl_jax.rl.layout import Packed

    total, shapes = 0.0, []
    for it in plan:
        rows = len(it.rows)
        pos = int(it.positions)
        t = int(it.shape.t)
        head = rows * min(W, t)
        if isinstance(it.shape, Packed):  # packed items score their completion tokens only (update.scored_positions)
            head = min(head, pos)
        f = step_flops(cfg, spec, pos, t, head)
        if remat != "none":  # the forward again (dots: all but the saved matmuls; counted whole, an upper bound)
            f += step_flops(cfg, spec, pos, t, 0) / 3 if remat == "full" else 0.0
        total += f
        shapes.append((pos, head))
    return total, shapes


def matmul_floor(cfg, spec, shapes, reps: int = 3) -> float:
    """Seconds the items' base and LoRA matmuls (forward + backward as step_flops counts them) take as plain
    jitted matmuls at their own sizes: what the matmul units allow for this work at this granularity."""
    import jax
    import jax.numpy as jnp
    d, f, q, kv, V = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim, cfg.vocab_size
    io = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    cache: dict = {}

    def timed(m, k, n, times):
        key = (m, k, n)
        if key not in cache:
            a = jnp.ones((m, k), jnp.float32)
            b = jnp.ones((k, n), jnp.float32)
            fn = jax.jit(lambda a, b: a @ b)
            fn(a, b).block_until_ready()
            t = time.perf_counter()
            for _ in range(reps):
                fn(a, b).block_until_ready()
            cache[key] = (time.perf_counter() - t) / reps
        return cache[key] * times

    s = 0.0
    for pos, head in shapes:
        for k, n in io:  # forward, and the activation gradient (frozen weights): 2 products per layer
            s += timed(pos, k, n, 2 * cfg.num_layers)
            s += timed(pos, k, spec.rank, 3 * cfg.num_layers) + timed(pos, spec.rank, n, 3 * cfg.num_layers)
        if head:
            s += timed(head, d, V, 2)
    return s


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.jax_setup import loaded_allocator
    from marl_jax.models.loading import load_model
    from marl_jax.policy.lora import PolicySpec
    from marl_jax.rl import optim
    from marl_jax.rl.batch import make_batch, make_groups
    from marl_jax.rl.layout import pack_batch, plan_items
    from marl_jax.rl.update import UpdateConfig, init_state, make_train_step

    t0 = time.perf_counter()
    m = load_model(args.model)
    cfg, tok = m.cfg, m.tokenizer
    base = jax.device_put(m.params)
    spec = PolicySpec(rank=args.rank, alpha=2.0 * args.rank, num_slots=1)
    trainable0 = start_lora(spec, cfg, base, args.seed)
    rows = synth(args, cfg.vocab_size, set(tok.eos_token_ids) | {tok.pad_id})
    advs = np.random.RandomState(args.seed + 3).uniform(-1.5, 1.5, len(rows)).astype(np.float32)
    role = ROLE_NAMES[0]
    groups = make_groups([role], {role: 0}, None)
    tx = optim.per_slot(optim.make_optimizer(lr=1e-5, grad_clip=1.0))
    tables = dict(num_groups=len(groups.names), group_slot=groups.slot, group_role=[0], num_roles=1, role_slot=[0])
    comp = sum(len(r.completion_tokens) for r in rows)
    total = sum(len(r.prompt_tokens) + len(r.completion_tokens) for r in rows)
    ctx = sum((len(r.prompt_tokens) + len(r.completion_tokens)) ** 2 / 2 for r in rows) / total
    useful = step_flops(cfg, spec, total, ctx, comp)
    peak = matmul_peak()
    print(f"workload: {len(rows)} rows ({args.prompts} prompts x {args.episodes}), {total} real tokens, {comp} "
          f"completion tokens (median completion {int(np.median([len(r.completion_tokens) for r in rows]))}); "
          f"{args.model} float32, LoRA r{spec.rank}; useful {useful / 1e9:.1f} GFLOP per step; allocator "
          f"{loaded_allocator()}; jitted f32 2048^3 matmul peak {peak / 1e9:.1f} GFLOP/s")

    peers = UpdateConfig(micro_batch=8, diagnostics=False, metrics=True, remat="dots", packing=True,
                         share_prefix=16, dtype=jnp.float32)
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown --variants {bad}; choose from {sorted(VARIANTS)}")
    results = []
    for i, name in enumerate(names):
        what, over = VARIANTS[name]
        ucfg = dataclasses.replace(peers, **over)
        batch = make_batch(rows, advs, role_to_slot={role: 0}, num_slots=1, groups=groups,
                           micro_batch=ucfg.micro_batch, pad_id=tok.pad_id, agg=ucfg.agg,
                           width=args.completion_len)
        W = batch.targets.shape[2]
        pb = (pack_batch(batch, ucfg.micro_batch, share_prefix=ucfg.share_prefix, grid=ucfg.length_grid)
              if ucfg.packing else batch)
        plan = plan_items(pb, micro_batch=ucfg.micro_batch, length_buckets=ucfg.length_buckets,
                          grid=ucfg.length_grid, packing=ucfg.packing, share_prefix=ucfg.share_prefix,
                          max_tokens=ucfg.max_tokens_per_micro_batch, by_group=False)
        exe, shapes = executed_flops(cfg, spec, plan, W, ucfg.remat)
        batch = jax.tree_util.tree_map(jnp.asarray, batch)
        step = make_train_step(cfg, spec, ucfg, tx, **tables)
        state = init_state(jax.tree_util.tree_map(jnp.array, trainable0), tx)
        state, first, _, times = time_steps(step, state, base, batch, args.reps)
        med = statistics.median(times)
        floor = matmul_floor(cfg, spec, shapes) if name == "peers" or name.startswith(("mb", "budget")) else None
        results.append((name, what, len(plan), sum(p for p, _ in shapes), exe, med, first, floor))
        print(f"[{i + 1}/{len(names)}] {name}: {med:.2f} s/step (first {first:.1f} s), "
              f"{len(plan)} items, elapsed {time.perf_counter() - t0:.0f} s", flush=True)

    print()
    print("| variant | items | positions | executed / useful FLOPs | s/step | useful GFLOP/s | % of peak | "
          "matmul floor s (same items) | step / floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, what, n, pos, exe, med, first, floor in results:
        fl = f"{floor:.2f}" if floor else "-"
        ratio = f"{med / floor:.2f}" if floor else "-"
        print(f"| {what} | {n} | {pos} | {exe / useful:.2f} | {med:.2f} | {useful / med / 1e9:.1f} | "
              f"{100 * useful / med / peak:.0f}% | {fl} | {ratio} |")
    base_row = next((r for r in results if r[0] == "peers"), results[0])
    print(f"useful_of_peak={useful / base_row[5] / peak:.3f}")
    print(f"whole run {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    from marl_jax.jax_setup import use_fast_allocator

    use_fast_allocator()
    sys.exit(main())
