"""Sampler throughput: marl_jax against Hugging Face `generate` on the same workload, same run.

    python benchmarks/sampler.py [--prompts=64 --max_new_tokens=128 --hf_batch=16 --threads=2]

Workload: chat prompts of simple arithmetic, greedy, SmolLM2-135M-Instruct (embedded) in float32.
HF runs batches of --hf_batch left-padded prompts; marl_jax runs all prompts as one bucketed batch
(the prefix all prompts share prefilled once, finished rows compacted away). marl_jax is timed after one warm-up call (compilation is reported separately).
Prints wall times, real (non-padding) tokens per second, the decode step's achieved FLOP/s next to
a jitted matmul peak measured here, and as its last line `speedup=<HF wall / marl_jax wall>`.

    python benchmarks/sampler.py --workload=longtail [--prompts=256 --max_new_tokens=1024 --max_batch=64]

A workload shaped like RL rollouts: --prompts random prompts of 8-48 tokens on a tiny random decoder
(2 layers, hidden 64, its LM head scaled so that greedy logits have no near-ties), each row stopped by a
length rule at a known length: 90% after 1-63 tokens (exponential, mean ~16), 10% at --max_new_tokens. The
sampler runs with continuous batching (--max_batch rows, refilled as rows finish); the previous
scheme (all rows in one batch, compacted as they finish) runs too for comparison, and so do the paged KV
cache and compaction on the coarse grid only (2 batch sizes per octave; by default a tail still decoding after
64 steps is fitted to 16 sizes per octave). The schedule's row-step ratio over 40 draws of the workload's
lengths is replayed on host (no model) for these and other compaction settings. Prints useful row-steps
(tokens decoded) over computed row-steps (batch rows x decode steps), peak KV-cache bytes next to what a
dense cache for every row would hold, and `speedup=` against HF generate (batches of --hf_batch, each row
stopped by the same rule, a batch running until its last row stops).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from common import matmul_peak


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--hf_batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip_hf", action="store_true", help="only time marl_jax")
    p.add_argument("--no_compaction", action="store_true")
    p.add_argument("--workload", default="chat", choices=("chat", "longtail"))
    p.add_argument("--max_batch", type=int, default=64, help="longtail: rows decoding at once")
    p.add_argument("--paged", action="store_true", help="chat: marl_jax with the paged KV cache")
    p.add_argument("--kv_block", type=int, default=16, help="paged KV block size (slots)")
    p.add_argument("--kv_budget_fraction", type=float, default=0.25,
                   help="longtail: also run with a KV budget of this fraction of the dense cache (0: skip)")
    return p.parse_args(argv)


def arithmetic_prompts(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    ops = ["+", "-", "*"]
    out = []
    for _ in range(n):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice(ops)
        out.append(f"What is {a} {op} {b}? Give the answer.")
    return out


def longtail_workload(seed: int, n: int, T: int, vocab: int):
    """n prompts of 8-48 random tokens and each row's stop length: 10% at T, the rest 1-63 (exponential)."""
    import numpy as np

    rng = np.random.RandomState(seed)
    prompts = [rng.randint(3, vocab, rng.randint(8, 49)).tolist() for _ in range(n)]
    long = rng.rand(n) < 0.1
    return prompts, np.where(long, T, np.minimum(63, 1 + rng.exponential(16, n).astype(int))).astype(int)


def longtail(args):
    import jax
    import numpy as np
    import torch
    import transformers

    from marl_jax.generate.sampler import Sampler, SamplingParams
    from marl_jax.models import hf
    from marl_jax.models.tiny import tiny_model

    m = tiny_model()
    params = jax.device_put({**m.params, "embed": m.params["embed"] * 8.0})
    n, T = args.prompts, args.max_new_tokens
    prompts, limits = longtail_workload(0, n, T, m.cfg.vocab_size)
    long = limits == T
    print(f"workload longtail: {n} prompts (8-48 tokens), stop lengths {int(long.sum())} at {T}, the rest 1-63 "
          f"(median {int(np.median(limits[~long]))}); {limits.sum()} tokens; greedy, tiny random qwen3 "
          f"(2 layers, hidden 64), float32, {args.threads} threads")
    sp = SamplingParams(max_new_tokens=T, temperature=0.0)
    key = jax.random.PRNGKey(0)
    res = {}
    for name, kw in (("continuous", dict(max_batch=args.max_batch, min_batch=1)),
                     ("continuous, paged KV", dict(max_batch=args.max_batch, min_batch=1, paged=True,
                                                   kv_block=args.kv_block)),
                     ("continuous, coarse compaction grid only", dict(max_batch=args.max_batch, min_batch=1,
                                                                      compaction_buckets=2)),
                     ("one batch + compaction (previous)", dict(continuous=False, max_batch=max(n, 1)))):
        s = Sampler(m.cfg, pad_id=0, prefix_cache_tokens=0, **kw)
        t = time.perf_counter()
        s.generate(params, prompts, key, sp, max_new_tokens=limits)
        warm = time.perf_counter() - t
        t = time.perf_counter()
        out = s.generate(params, prompts, key, sp, max_new_tokens=limits)
        wall = time.perf_counter() - t
        st = s.stats
        c = m.cfg
        dense = 2 * c.num_layers * n * c.num_kv_heads * c.head_dim * (
            max(map(len, prompts)) + T) * np.dtype(np.float32).itemsize
        res[name] = (out, wall)
        print(f"marl_jax {name}: wall {wall:.2f}s (first call incl. compile {warm:.1f}s); decode {st['decode_s']:.2f}s, "
              f"{st['decode_steps']} steps, {st['refills']} refills, {st['compactions']} compactions "
              f"({st['fine_compactions']} onto the fine grid); "
              f"useful/computed row-steps {st['useful_row_steps']}/{st['row_steps']} = "
              f"{st['useful_row_steps'] / st['row_steps']:.3f}; peak KV {st['peak_kv_bytes'] / 2**20:.1f} MiB"
              + (f" allocated, {st['peak_kv_live_bytes'] / 2**20:.1f} MiB in blocks held by rows "
                 f"({st['pool_grows']} pool grows)" if "peak_kv_live_bytes" in st else "")
              + f" (a dense cache for all {n} rows: {dense / 2**20:.1f} MiB)")
        if name == "continuous":
            dense_kv = st["peak_kv_bytes"]
    a, b, c, d = (r[0] for r in res.values())
    print(f"identical completions with and without continuous batching: {bool((a.tokens == d.tokens).all())}; "
          f"paged and dense KV: {bool((a.tokens == b.tokens).all())}; "
          f"default and coarse compaction: {bool((a.tokens == c.tokens).all())}")
    if args.kv_budget_fraction > 0:  # the same rows in a fixed pool of a fraction of the dense cache: preemption
        budget = int(dense_kv * args.kv_budget_fraction)
        s = Sampler(m.cfg, pad_id=0, prefix_cache_tokens=0, max_batch=args.max_batch, min_batch=1,
                    kv_block=args.kv_block, kv_budget_bytes=budget)
        s.generate(params, prompts, key, sp, max_new_tokens=limits)
        t = time.perf_counter()
        out_b = s.generate(params, prompts, key, sp, max_new_tokens=limits)
        wall = time.perf_counter() - t
        st = s.stats
        print(f"marl_jax KV budget {budget / 2**20:.2f} MiB ({args.kv_budget_fraction:g} of the dense cache's "
              f"{dense_kv / 2**20:.2f} MiB): wall {wall:.2f}s, {st['preemptions']} preemptions, "
              f"{st['recomputed_tokens']} tokens recomputed, pool {st['peak_kv_bytes'] / 2**20:.2f} MiB, blocks held "
              f"at most {st['peak_kv_live_bytes'] / 2**20:.2f} MiB; identical completions: "
              f"{bool((out_b.tokens == a.tokens).all() and (out_b.lengths == a.lengths).all())}")
        print(f"budget_over_unbudgeted={wall / res['continuous, paged KV'][1]:.2f} (paged), "
              f"{wall / res['continuous'][1]:.2f} (dense)")
    out, jax_wall = res["continuous"]
    draws(args, m.cfg.vocab_size)
    if args.skip_hf:
        return

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        hf.save_hf_dir(d, m.cfg, jax.device_get(params))
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

    class StopAt(transformers.StoppingCriteria):  # each row stops at its own length
        def __init__(self, start, lens):
            self.start, self.lens = start, torch.tensor(lens)

        def __call__(self, input_ids, scores, **kw):
            return (input_ids.shape[1] - self.start) >= self.lens

    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    agree = 0
    t = time.perf_counter()
    for s0 in range(0, n, args.hf_batch):
        chunk, lens = prompts[s0:s0 + args.hf_batch], limits[s0:s0 + args.hf_batch]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (L - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=int(lens.max()), do_sample=False,
                                 pad_token_id=0, eos_token_id=None,
                                 stopping_criteria=transformers.StoppingCriteriaList([StopAt(L, lens)]))
        for j, g in enumerate(gen[:, L:].tolist()):
            agree += g[:lens[j]] == out.row(s0 + j)[0]
    hf_wall = time.perf_counter() - t
    print(f"hf generate (batch {args.hf_batch}): wall {hf_wall:.2f}s")
    print(f"identical completions: {agree}/{n}")
    print(f"speedup={hf_wall / jax_wall:.2f}")


def draws(args, vocab: int, count: int = 40):
    """The schedule's row-step ratio over `count` draws of the long-tail workload (seeds 0.., 0 is the one timed
    above), replayed on host without a model."""
    import numpy as np

    from marl_jax.generate.scheduler import schedule_row_steps

    lims = []
    for seed in range(count):
        prompts, lim = longtail_workload(seed, args.prompts, args.max_new_tokens, vocab)
        lims.append(lim[np.argsort([-len(p) for p in prompts], kind="stable")])  # the sampler's order
    print(f"the schedule over {count} draws of the workload (host replay, draw 0 is the one above): useful/computed "
          "row-steps mean and worst; compactions a call (decode batch sizes to compile)")
    for label, po, patience in (("coarse grid only (compaction_buckets=2)", 2, 64),
                                ("default: fine grid of 16 after 64 steps", 16, 64),
                                ("fine grid of 16 after 16 steps", 16, 16),
                                ("fine grid of 8 after 1 step", 8, 1)):
        r = [schedule_row_steps(lim, args.max_batch, 1, 1, po, patience) for lim in lims]
        ratio = np.array([x["useful"] / x["row_steps"] for x in r])
        print(f"  {label}: {ratio.mean():.3f}, {ratio.min():.3f}; {np.mean([x['compactions'] for x in r]):.1f}")


def main(argv=None):
    args = parse_args(argv)
    from marl_jax.jax_setup import loaded_allocator

    print(f"allocator: {loaded_allocator()}")
    if args.workload == "longtail":
        if "--prompts" not in " ".join(argv or sys.argv):
            args.prompts = 256
        if "--max_new_tokens" not in " ".join(argv or sys.argv):
            args.max_new_tokens = 1024
        return longtail(args)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.generate.sampler import Sampler, SamplingParams
    from marl_jax.models import hf
    from marl_jax.models.loading import load_model

    m = load_model(args.model)
    tok = m.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in arithmetic_prompts(args.prompts)]
    stops = tuple(tok.eos_token_ids)
    print(f"workload: {len(prompts)} chat prompts (mean {np.mean([len(p) for p in prompts]):.1f} tokens), "
          f"{args.max_new_tokens} max new tokens, greedy, {args.model} float32, {args.threads} threads")

    peak = matmul_peak()
    print(f"jitted f32 2048^2 matmul peak: {peak / 1e9:.1f} GFLOP/s")

    # ---- marl_jax ----
    params = jax.device_put(m.params)
    sampler = Sampler(m.cfg, pad_id=tok.pad_id, compaction=not args.no_compaction, paged=args.paged,
                      kv_block=args.kv_block)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, stop_ids=stops)
    t = time.perf_counter()
    sampler.generate(params, prompts, jax.random.PRNGKey(0), sp)
    warm = time.perf_counter() - t
    t = time.perf_counter()
    out = sampler.generate(params, prompts, jax.random.PRNGKey(0), sp)
    jax_wall = time.perf_counter() - t
    st = sampler.stats
    jax_tokens = int(out.lengths.sum())
    ctx = np.mean([len(p) for p in prompts]) + args.max_new_tokens / 2
    step_flops = st["row_steps"] * m.cfg.flops_per_token(int(ctx))
    print(f"marl_jax: wall {jax_wall:.2f}s (first call incl. compile {warm:.1f}s), {jax_tokens} real tokens, "
          f"{jax_tokens / jax_wall:.1f} tok/s; prefill {st['prefill_s']:.2f}s ({st['prefill_tokens']} of "
          f"{st['prompt_tokens']} prompt tokens computed, the rest a shared prefix), decode {st['decode_s']:.2f}s over "
          f"{st['decode_steps']} steps, {st['row_steps']} row-steps, {st['compactions']} compactions")
    print(f"marl_jax decode: {step_flops / st['decode_s'] / 1e9:.1f} GFLOP/s achieved "
          f"({100 * step_flops / st['decode_s'] / peak:.0f}% of matmul peak; counts every row-step, live or not)")
    if args.paged:
        print(f"marl_jax paged KV: pool {st['peak_kv_bytes'] / 2**20:.1f} MiB, blocks held by rows at most "
              f"{st['peak_kv_live_bytes'] / 2**20:.1f} MiB, {st['pool_grows']} pool grows")
        dense = Sampler(m.cfg, pad_id=tok.pad_id, compaction=not args.no_compaction)
        dense.generate(params, prompts, jax.random.PRNGKey(0), sp)
        t = time.perf_counter()
        out_d = dense.generate(params, prompts, jax.random.PRNGKey(0), sp)
        dense_wall = time.perf_counter() - t
        print(f"marl_jax dense KV: wall {dense_wall:.2f}s, decode {dense.stats['decode_s']:.2f}s, peak KV "
              f"{dense.stats['peak_kv_bytes'] / 2**20:.1f} MiB (identical output: "
              f"{bool((out_d.tokens == out.tokens).all())}); paged_over_dense={jax_wall / dense_wall:.2f}")
    if not args.no_compaction and not args.paged:
        # The same workload with finished rows kept in the batch to the end: what compaction saves.
        plain = Sampler(m.cfg, pad_id=tok.pad_id, compaction=False)
        plain.generate(params, prompts, jax.random.PRNGKey(0), sp)
        t = time.perf_counter()
        out2 = plain.generate(params, prompts, jax.random.PRNGKey(0), sp)
        plain_wall = time.perf_counter() - t
        same = bool((out2.tokens == out.tokens).all())
        print(f"marl_jax without compaction: wall {plain_wall:.2f}s, {plain.stats['row_steps']} row-steps "
              f"(identical output: {same}); compaction saves {plain_wall / jax_wall:.2f}x")
    if args.skip_hf:
        return

    # ---- Hugging Face generate on the same weights and token ids ----
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        hf.save_hf_dir(d, m.cfg, m.params)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():  # warm-up, as marl_jax gets one
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_id)
    hf_tokens = 0
    agree = 0
    t = time.perf_counter()
    for s in range(0, len(prompts), args.hf_batch):
        chunk = prompts[s:s + args.hf_batch]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[tok.pad_id] * (L - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 eos_token_id=list(stops), pad_token_id=tok.pad_id)[:, L:].tolist()
        for j, g in enumerate(gen):
            n = next((k + 1 for k, x in enumerate(g) if x in stops), len(g))
            hf_tokens += n
            agree += g[:n] == out.row(s + j)[0]
    hf_wall = time.perf_counter() - t
    print(f"hf generate (batch {args.hf_batch}): wall {hf_wall:.2f}s, {hf_tokens} real tokens, "
          f"{hf_tokens / hf_wall:.1f} tok/s")
    print(f"identical completions: {agree}/{len(prompts)}")
    print(f"speedup={hf_wall / jax_wall:.2f}")


if __name__ == "__main__":
    from marl_jax.jax_setup import use_fast_allocator

    use_fast_allocator()  # XLA temporaries without a page fault per 4 KiB (MARL_JAX_MALLOC=off: glibc)
    sys.exit(main())
