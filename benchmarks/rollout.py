"""Rollout throughput: episodes per second of each workflow, with the time split between parts.

    python benchmarks/rollout.py [--workflows=single_agent,eval_opt,voting,orch_workers]
                                 [--num_tasks=2 --group_size=4 --max_new_tokens=32 --policy=shared]

Workload: the embedded default config of each workflow (configs/<workflow>.py with no argument:
SmolLM2-135M-Instruct in float32, one-digit sums, temperature 0.7), the first --num_tasks train tasks,
--group_size episodes each. --max_new_tokens (default: the config's) caps every role's completions.

Each workflow first runs one warm-up rollout on the same tasks with the same PRNG key, so the timed
rollout replays the same shapes and compiles nothing; compile time is reported as warm-up wall minus
timed wall. The timed rollout's wall time is split into sampler (inside the jitted sampler calls;
prefill and decode shown separately), glue (prompt rendering, tokenising, parsing, credit, grouping)
and reward (grading). The persistent XLA cache is not enabled here, so compile time is a cold compile.
The last lines are a compact table and the absolute numbers, one line per
workflow: `<workflow> episodes_per_s=... total_s=... sampler_s=... glue_s=... reward_s=... compile_s=...`,
with `prefill_tokens_per_ep` (prompt tokens computed per episode) and `cached_tokens_per_ep` (prompt tokens
loaded from the sampler's prefix cache instead).

--conversation=chat lays eval_opt's calls out as one multi-turn chat per role (workflow_options.conversation),
so that each call's prompt extends the role's previous prompt + completion; --conversation=both runs eval_opt
both ways and prints `speedup=` of episodes/s of chat over quoted (the config's default).

--prefix_cache=both runs every workflow twice, without the sampler's prefix cache (every prompt prefilled,
as before it existed) and with it, and prints `speedup=` of episodes/s between the two.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import time

WORKFLOWS = ("single_agent", "eval_opt", "voting", "orch_workers")
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workflows", default=",".join(WORKFLOWS), help="comma-separated subset of " + ",".join(WORKFLOWS))
    p.add_argument("--num_tasks", type=int, default=2)
    p.add_argument("--group_size", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=0, help="every role's cap (0: the config's)")
    p.add_argument("--policy", default="shared", choices=("shared", "isolated"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix_cache", default="on", choices=("on", "off", "both"),
                   help="the sampler's prefix cache across calls; both: each workflow without, then with it")
    p.add_argument("--conversation", default="quoted", choices=("quoted", "chat", "both"),
                   help="eval_opt's prompt layout (workflow_options.conversation); both: quoted, then chat")
    args = p.parse_args(argv)
    args.workflows = [w.strip() for w in args.workflows.split(",") if w.strip()]
    bad = [w for w in args.workflows if w not in WORKFLOWS]
    if bad:
        p.error(f"unknown workflow(s) {bad}; choose from {list(WORKFLOWS)}")
    if args.num_tasks < 1 or args.group_size < 2:
        p.error("need --num_tasks >= 1 and --group_size >= 2")
    return args


def load_config(workflow: str):
    """configs/<workflow>.py's embedded default (the file is loaded by path, as config_flags does)."""
    spec = importlib.util.spec_from_file_location(f"_config_{workflow}", os.path.join(CONFIG_DIR, f"{workflow}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("")


def bench_one(workflow: str, args, model, tasks, prefix_cache: bool = True, conversation: str = "") -> dict:
    """Warm-up then timed rollout of one workflow; returns the numbers of the timed one."""
    import jax

    from marl_jax.rollout import make_policy_sampler, rollout
    from marl_jax.train.build import build

    cfg = load_config(workflow)
    cfg.num_tasks = args.num_tasks
    cfg.rollout.group_size = args.group_size
    cfg.policy = args.policy
    if conversation:
        cfg.workflow_options.conversation = conversation
    if args.max_new_tokens:
        for r in cfg.rollout.max_new_tokens:
            cfg.rollout.max_new_tokens[r] = args.max_new_tokens
    rt = build(cfg, model=model, tasks=tasks)
    if not prefix_cache:
        rt.sampler.prefix_cache = None
    batch = rt.train_tasks[: args.num_tasks]
    key_init, key_sample = jax.random.split(jax.random.key(args.seed))
    trainable = rt.init_trainable(key_init)

    walls, results, calls = [], [], []
    for _ in range(2):  # warm-up (compiles), then the timed replay
        # A training step starts with an empty prefix cache (new parameters empty it): so does each replay,
        # or the timed one would find the warm-up's rows cached, take other shapes and compile.
        if rt.sampler.prefix_cache is not None:
            rt.sampler.prefix_cache.clear()
        sample = make_policy_sampler(rt, trainable, key_sample)
        t0 = time.perf_counter()
        res = rollout(rt, batch, sample)
        walls.append(time.perf_counter() - t0)
        results.append(res)
        calls.append(sample.calls)
    res, c = results[1], calls[1]
    t = res.timing
    n_ep = len(res.episodes)
    tokens = sum(x["tokens"] for x in c)
    out = dict(
        workflow=workflow + ("" if prefix_cache else "(no cache)") + (f"({conversation})" if conversation else ""), episodes=n_ep, rows=len(res.rows), calls=len(c), tokens=tokens,
        total_s=t["total_s"], sampler_s=t.get("sampler_s", 0.0), glue_s=t.get("glue_s", 0.0),
        reward_s=t.get("reward_s", 0.0), prefill_s=sum(x.get("prefill_s", 0.0) for x in c),
        decode_s=sum(x.get("decode_s", 0.0) for x in c),
        prefill_tokens_per_ep=sum(x.get("prefill_tokens", 0) for x in c) / n_ep,
        cached_tokens_per_ep=sum(x.get("cached_tokens", 0) for x in c) / n_ep, warmup_s=walls[0], compile_s=max(walls[0] - walls[1], 0.0),
        success=res.metrics.get("success", float("nan")),
        stages={x["stage"]: (x["rows"], x.get("prefill_rows", x["rows"]), x["tokens"], x["seconds"]) for x in c},
        same_rows=[r.completion_tokens for r in results[0].rows] == [r.completion_tokens for r in res.rows],
    )
    out["episodes_per_s"] = n_ep / out["total_s"]
    out["tokens_per_s"] = tokens / max(out["sampler_s"], 1e-9)
    del rt, trainable, results
    gc.collect()
    return out


def main(argv=None):
    args = parse_args(argv)
    from marl_jax.jax_setup import loaded_allocator

    print(f"allocator: {loaded_allocator()}")
    import jax

    from marl_jax.models.loading import load_model
    from marl_jax.train.build import load_tasks

    t0 = time.perf_counter()
    model = load_model("smollm2-135m-instruct")
    tasks = load_tasks(load_config(args.workflows[0]).task)  # every embedded config reads the same tasks
    print(f"setup {time.perf_counter() - t0:.1f}s: smollm2-135m-instruct float32, {len(tasks)} tasks; "
          f"{args.num_tasks} tasks x {args.group_size} episodes per workflow, {args.policy} policy, "
          f"max_new_tokens {args.max_new_tokens or 'config'}; jax {jax.__version__} on {jax.devices()[0].platform} "
          f"({os.cpu_count()} CPUs)", flush=True)

    rows = []
    modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.prefix_cache]
    conversations = {"quoted": ("",), "chat": ("chat",), "both": ("quoted", "chat")}[args.conversation]
    runs = [(w, m, c) for w in args.workflows for m in modes for c in (conversations if w == "eval_opt" else ("",))]
    for wf, pc, conv in runs:
        r = bench_one(wf, args, model, tasks, prefix_cache=pc, conversation=conv)
        rows.append(r)
        stages = ", ".join(f"{k}: {n} rows ({u} prefilled) {tok} tok {s:.1f}s"
                           for k, (n, u, tok, s) in r["stages"].items())
        print(f"{r['workflow']}: warm-up {r['warmup_s']:.1f}s, timed {r['total_s']:.1f}s, success {r['success']:.2f}, "
              f"replay identical: {r['same_rows']}; {stages}", flush=True)

    head = (f"{'workflow':<14}{'ep':>4}{'calls':>6}{'tokens':>7}{'ep/s':>7}{'total s':>9}{'sampler':>14}"
            f"{'(prefill/decode)':>18}{'glue':>12}{'reward':>12}{'tok/s':>7}{'compile s':>10}")
    print()
    print(head)
    print("-" * len(head))
    for r in rows:
        pct = lambda k: f"{r[k]:.2f} {100 * r[k] / r['total_s']:3.0f}%"
        print(f"{r['workflow']:<14}{r['episodes']:>4}{r['calls']:>6}{r['tokens']:>7}{r['episodes_per_s']:>7.2f}"
              f"{r['total_s']:>9.2f}{pct('sampler_s'):>14}{r['prefill_s']:>9.1f}/{r['decode_s']:<8.1f}"
              f"{pct('glue_s'):>12}{pct('reward_s'):>12}{r['tokens_per_s']:>7.0f}{r['compile_s']:>10.1f}")
    for r in rows:
        print(f"{r['workflow']} episodes_per_s={r['episodes_per_s']:.4f} total_s={r['total_s']:.3f} "
              f"sampler_s={r['sampler_s']:.3f} prefill_s={r['prefill_s']:.3f} decode_s={r['decode_s']:.3f} "
              f"glue_s={r['glue_s']:.4f} reward_s={r['reward_s']:.4f} compile_s={r['compile_s']:.1f} "
              f"tokens={r['tokens']} prefill_tokens_per_ep={r['prefill_tokens_per_ep']:.1f} "
              f"cached_tokens_per_ep={r['cached_tokens_per_ep']:.1f}")
    if args.conversation == "both":
        by = {(w, m, c): r for (w, m, c), r in zip(runs, rows)}
        for m in modes:
            q, c = by.get(("eval_opt", m, "quoted")), by.get(("eval_opt", m, "chat"))
            if q and c:
                print(f"eval_opt quoted -> chat{'' if m else ' (no cache)'}: episodes_per_s {q['episodes_per_s']:.3f} -> "
                      f"{c['episodes_per_s']:.3f} speedup={c['episodes_per_s'] / q['episodes_per_s']:.2f}, prefill tokens "
                      f"per episode {q['prefill_tokens_per_ep']:.0f} -> {c['prefill_tokens_per_ep']:.0f} (cached "
                      f"{q['cached_tokens_per_ep']:.0f} -> {c['cached_tokens_per_ep']:.0f}), success {q['success']:.2f} / "
                      f"{c['success']:.2f}")
    if args.prefix_cache == "both":
        pairs = {}
        for (w, m, c), r in zip(runs, rows):
            pairs.setdefault((w, c), {})[m] = r
        for (w, c), d in pairs.items():
            off, on = d[False], d[True]
            print(f"{on['workflow']} prefix cache: episodes_per_s {off['episodes_per_s']:.3f} -> {on['episodes_per_s']:.3f} "
                  f"speedup={on['episodes_per_s'] / off['episodes_per_s']:.2f}, prefill tokens per episode "
                  f"{off['prefill_tokens_per_ep']:.0f} -> {on['prefill_tokens_per_ep']:.0f}, same rows: "
                  f"{off['same_rows'] and on['same_rows']}")


if __name__ == "__main__":
    from marl_jax.jax_setup import use_tcmalloc

    use_tcmalloc()  # XLA temporaries without a page fault per 4 KiB (MARL_JAX_MALLOC=off: glibc)
    main()
