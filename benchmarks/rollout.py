"""Rollout throughput: episodes per second of each workflow, with the time split between parts.

    python benchmarks/rollout.py [--workflows=single_agent,eval_opt,voting,orch_workers]
                                 [--num_tasks=2 --group_size=4 --max_new_tokens=32 --policy=shared]
                                 [--prefix_cache=on|off|both --conversation=quoted|chat|both --headroom --draft=4]

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

--headroom prints, per workflow, two measured bounds on what a decode-step scheme could still save on the
timed rollout's own rows: prompt-lookup speculative decoding (draft the next --draft tokens by matching the
last 1-3 tokens earlier in the row's prompt and completion, verify them in one step; a sampled token is accepted
exactly when it equals the draft, so the rows' tokens per step are read off the rows) against the measured cost
of a (draft+1)-token decode step over a 1-token one, and running each episode's calls as soon as its previous
call finishes instead of stage by stage (decode steps on the longest episode's chain vs the sum of every
stage's longest row).
It also prints a floor under the timed rollout's sampler time for the same tokens: its prefilled tokens at
the measured rate of a large float32 matmul (2 FLOPs per layer weight per token; attention and the LM head left
out) plus its decode steps at the measured time of a step's weight matmuls alone (as many rows as a stage
decodes together, every layer's projections and the LM head, each weight its own array: no attention, no
cache, no copies). `floor_speedup<=` is the rollout's episodes/s at that floor over its measured episodes/s:
a sampler that computes the same tokens in float32 with these matmuls does not get past it.

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
    p.add_argument("--headroom", action="store_true",
                   help="print what speculative decoding from the prompt and per-episode scheduling could save")
    p.add_argument("--draft", type=int, default=4, help="--headroom: tokens drafted per step")
    args = p.parse_args(argv)
    args.workflows = [w.strip() for w in args.workflows.split(",") if w.strip()]
    bad = [w for w in args.workflows if w not in WORKFLOWS]
    if bad:
        p.error(f"unknown workflow(s) {bad}; choose from {list(WORKFLOWS)}")
    if args.draft < 1:
        p.error(f"--draft must be >= 1 (tokens drafted per step), got {args.draft}")
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
    if args.headroom:
        out["headroom"] = headroom(results[1].rows, rt, args.draft)
        out["headroom"].update(floor(rt, c, out["headroom"]["width"], out["total_s"]))
    out["episodes_per_s"] = n_ep / out["total_s"]
    out["tokens_per_s"] = tokens / max(out["sampler_s"], 1e-9)
    del rt, trainable, results
    gc.collect()
    return out


def lookup_draft(context: list, k: int, longest: int = 3) -> list:
    """The k tokens that followed the most recent earlier occurrence of the context's last n tokens
    (n = longest..1, the first n that occurs): prompt-lookup drafting."""
    for n in range(longest, 0, -1):
        if len(context) <= n:
            continue
        tail = context[-n:]
        for j in range(len(context) - n - 1, -1, -1):
            if context[j:j + n] == tail:
                return context[j + n:j + n + k]
    return []


def lookup_steps(prompt: list, completion: list, k: int) -> int:
    """Decode steps the completion takes when every step verifies a k-token lookup draft: each step emits
    the draft's tokens up to the first one the row did not sample, plus the row's own next token."""
    i = steps = 0
    while i < len(completion):
        d = lookup_draft(prompt + completion[:i], k)
        a = 0
        while a < len(d) and i + a < len(completion) and d[a] == completion[i + a]:
            a += 1
        i += a + 1
        steps += 1
    return steps


def step_cost(rt, rows: int, width: int, context: int, reps: int = 7) -> float:
    """Median seconds of one decode step of `rows` rows x `width` new tokens against `context` cached
    tokens (the cache donated, as in the sampler's loop)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.models import decoder

    cfg, params = rt.model.cfg, rt.base
    window = -(-(context + width) // 64) * 64
    cache = decoder.init_cache(cfg, rows, window)
    cache = cache._replace(valid=cache.valid.at[:, :context].set(True))
    fn = jax.jit(lambda p, c: decoder.forward_cached(
        p, cfg, jnp.ones((rows, width), jnp.int32), jnp.broadcast_to(context + jnp.arange(width), (rows, width)), c,
        jnp.full((rows,), context), jnp.ones((rows, width), bool), window=window), donate_argnums=(1,))
    out, cache = fn(params, cache)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out, cache = fn(params, cache)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def step_matrices(base) -> list:
    """The weight matrices one decode step multiplies by, in order: each layer's projections, then the LM
    head ([hidden, vocab]; the embedding's transpose when tied)."""
    layers = base["layers"]
    L = next(iter(layers.values())).shape[0]
    mats = [w[i] for i in range(L) for _, w in sorted(layers.items()) if w.ndim == 3]
    return mats + [base["embed"].T if base.get("lm_head") is None else base["lm_head"]]


def matmul_step(rt, rows: int, reps: int = 9) -> float:
    """Median seconds of one decode step's weight matmuls alone, `rows` rows: every layer's projections and
    the LM head, each weight a separate array (no slicing out of stacked layers), nothing else."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    mats = [jnp.array(m) for m in step_matrices(rt.base)]  # each its own buffer
    xs = {d: jax.device_put(np.random.RandomState(d).randn(rows, d).astype(np.float32)) for d in {m.shape[0] for m in mats}}
    fn = jax.jit(lambda xs, ms: [xs[m.shape[0]] @ m for m in ms])
    jax.block_until_ready(fn(xs, mats))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(xs, mats))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def floor_bound(layer_params: int, prefill_tokens: int, decode_steps: int, peak_flops: float, step_s: float,
                total_s: float) -> dict:
    """Seconds the same tokens need at least: prefill at 2 FLOPs per layer weight per token at peak_flops,
    each decode step at step_s; floor_speedup = total_s over their sum."""
    prefill, decode = 2 * layer_params * prefill_tokens / peak_flops, decode_steps * step_s
    return dict(prefill_floor_s=prefill, decode_floor_s=decode, floor_speedup=total_s / (prefill + decode))


def floor(rt, calls, width: int, total_s: float) -> dict:
    """floor_bound for the calls: the matmul peak measured here, each decode step at the cost of a
    `width`-row step's weight matmuls alone."""
    from common import matmul_peak  # benchmarks/ is on the path when this runs as a script

    layer_params = sum(m.size for m in step_matrices(rt.base)[:-1])
    steps = sum(x.get("decode_steps", 0) for x in calls)
    peak, one, step = matmul_peak(), matmul_step(rt, 1), matmul_step(rt, width)
    out = floor_bound(layer_params, sum(x.get("prefill_tokens", 0) for x in calls), steps, peak, step, total_s)
    return dict(out, peak_gflops=peak / 1e9, matmul_1_s=one, matmul_w_s=step, decode_steps=steps)


def headroom(rows, rt, k: int) -> dict:
    """Bounds on decode steps saved by prompt-lookup drafts and by per-episode scheduling (see --headroom)."""
    import collections

    tokens = sum(len(r.completion_tokens) for r in rows)
    steps = sum(lookup_steps(list(r.prompt_tokens), list(r.completion_tokens), k) for r in rows)
    stage_max, chain = collections.defaultdict(int), collections.defaultdict(lambda: collections.defaultdict(int))
    for r in rows:
        n = len(r.completion_tokens)
        stage_max[r.stage] = max(stage_max[r.stage], n)
        chain[r.episode_id][r.stage] = max(chain[r.episode_id][r.stage], n)
    staged, pipelined = sum(stage_max.values()), max(sum(c.values()) for c in chain.values())
    width = max(collections.Counter(r.stage for r in rows).values())  # rows decoded together in a stage
    context = int(sum(len(r.prompt_tokens) + len(r.completion_tokens) // 2 for r in rows) / max(len(rows), 1))
    one, verify = step_cost(rt, width, 1, context), step_cost(rt, width, k + 1, context)
    per_step = tokens / max(steps, 1)
    return dict(tokens_per_step=per_step, step_1_s=one, step_k_s=verify, k=k, width=width, context=context,
                lookup_speedup=per_step * one / verify, staged_steps=staged, pipelined_steps=pipelined,
                pipelined_speedup=staged / max(pipelined, 1))


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
    for r in rows:
        h = r.get("headroom")
        if h:
            print(f"{r['workflow']} headroom: prompt-lookup drafts of {h['k']}: {h['tokens_per_step']:.2f} tokens per "
                  f"step; a {h['k'] + 1}-token step of {h['width']} rows over ~{h['context']} cached tokens "
                  f"{1e3 * h['step_k_s']:.0f} ms vs {1e3 * h['step_1_s']:.0f} ms for 1 token: decode "
                  f"lookup_speedup<={h['lookup_speedup']:.2f}; decode steps stage by stage {h['staged_steps']}, "
                  f"each episode's calls back to back {h['pipelined_steps']}: pipelined_speedup<="
                  f"{h['pipelined_speedup']:.2f}")
            print(f"{r['workflow']} floor: {r['prefill_tokens_per_ep'] * r['episodes']:.0f} prefilled tokens at the "
                  f"matmul peak ({h['peak_gflops']:.0f} GFLOP/s) {h['prefill_floor_s']:.2f} s (measured "
                  f"{r['prefill_s']:.2f} s) + {h['decode_steps']} decode steps at the matmuls of a {h['width']}-row "
                  f"step alone ({1e3 * h['matmul_w_s']:.1f} ms; 1 row {1e3 * h['matmul_1_s']:.1f} ms) "
                  f"{h['decode_floor_s']:.2f} s (measured {r['decode_s']:.2f} s): episodes_per_s<="
                  f"{r['episodes'] / (h['prefill_floor_s'] + h['decode_floor_s']):.3f} "
                  f"floor_speedup<={h['floor_speedup']:.2f}")
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
    from marl_jax.jax_setup import use_fast_allocator

    use_fast_allocator()  # XLA temporaries without a page fault per 4 KiB (MARL_JAX_MALLOC=off: glibc)
    main()
