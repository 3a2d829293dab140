"""Sampler throughput: marl_jax against Hugging Face `generate` on the same workload, same run.

    python benchmarks/sampler.py [--prompts=64 --max_new_tokens=128 --hf_batch=16 --threads=2]

Workload: chat prompts of simple arithmetic, greedy, SmolLM2-135M-Instruct (embedded) in float32.
HF runs batches of --hf_batch left-padded prompts; marl_jax runs all prompts as one bucketed batch
(the prefix all prompts share prefilled once, finished rows compacted away). marl_jax is timed after one warm-up call (compilation is reported separately).
Prints wall times, real (non-padding) tokens per second, the decode step's achieved FLOP/s next to
a jitted matmul peak measured here, and as its last line `speedup=<HF wall / marl_jax wall>`.
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


def main(argv=None):
    args = parse_args(argv)
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
    sampler = Sampler(m.cfg, pad_id=tok.pad_id, compaction=not args.no_compaction)
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
    if not args.no_compaction:
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
    sys.exit(main())
