"""Prefill memory of long prompts: XLA's own memory analysis of the sampler's prefill program, chunked against
one pass, and the estimate `python -m marl_jax.generate` checks before it runs.

    python benchmarks/long_prefill.py [--lengths=8192,32768 --chunks=512,2048 --attention=dense --run]

Model: a tiny Qwen3 (2 layers, hidden 64, 4 heads of 16, 2 KV heads, vocabulary 320), one prompt, 16 new
tokens, float32. For each prompt length: temporaries and outputs (the decode state, its KV cache) of the
prefill program at each chunk size and in one pass (compiled only, never allocated), generate_bytes' estimate
of the same program (KV cache + transient), and the ratio of temporaries between consecutive lengths: about
the length ratio chunked (a chunk's scores are [1, heads, chunk, prompt]), its square in one pass. --run also
runs each chunked prefill once after compiling it and prints its time.
"""
from __future__ import annotations

import argparse
import dataclasses
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="8192,32768", help="prompt lengths (tokens), comma-separated")
    p.add_argument("--chunks", default="512,2048", help="prefill chunk sizes, comma-separated")
    p.add_argument("--attention", default="dense", help="ModelConfig.attention where the decoder has it")
    p.add_argument("--run", action="store_true", help="also run each chunked prefill once and time it")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.generate.prefill import generate_bytes
    from marl_jax.generate.sampler import Sampler, SamplingParams
    from marl_jax.models import decoder

    cfg = decoder.ModelConfig(family="qwen3", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                              max_position_embeddings=1 << 20)
    if "attention" in {f.name for f in dataclasses.fields(cfg)}:
        cfg = dataclasses.replace(cfg, attention=args.attention)
    Tn = 16
    sp = SamplingParams(max_new_tokens=Tn, temperature=0.0)
    lengths = [int(x) for x in args.lengths.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")] + [0]  # 0: one pass
    sd = jax.ShapeDtypeStruct
    params = decoder.init_params(cfg, jax.random.PRNGKey(0)) if args.run else \
        jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.PRNGKey(0)))
    MB = 1e6
    print(f"tiny qwen3 (2 layers, hidden 64), attention={getattr(cfg, 'attention', 'dense')}, one prompt, "
          f"{Tn} new tokens, float32")
    print(f"{'prompt':>7} {'chunk':>9} {'temp MB':>10} {'out MB':>8} {'estimate MB':>12} {'temp x':>7}"
          + ("  run s" if args.run else ""))
    prev: dict[int, float] = {}
    for S in lengths:
        for chunk in chunks:
            c = chunk or 1 << 40
            fn = Sampler(cfg, prefill_chunk=c, min_batch=1).programs.prefill(sp, S + Tn, Tn)
            shapes = (sd((1, S), jnp.int32), sd((1, S), bool))
            lowered = fn.lower(params, None, jnp.int32(0), sd((0,), jnp.int32), *shapes, sd((1,), jnp.int32),
                               sd((1,), jnp.int32), sd((1,), jnp.int32), sd((1,), jnp.int32), jax.random.PRNGKey(0),
                               None)
            compiled = lowered.compile()
            ma = compiled.memory_analysis()
            est = generate_bytes(cfg, [S], Tn, chunk=c, weight_bytes=0)
            temp = ma.temp_size_in_bytes
            growth = f"{temp / prev[chunk]:7.2f}" if chunk in prev else f"{'':>7}"
            prev[chunk] = temp
            line = (f"{S:>7} {chunk or 'one pass':>9} {temp / MB:>10.1f} {ma.output_size_in_bytes / MB:>8.1f} "
                    f"{(est['kv_cache'] + est['transient']) / MB:>12.1f} {growth}")
            if args.run and chunk:
                rng = np.random.RandomState(0)
                tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (1, S)), jnp.int32)
                t0 = time.perf_counter()
                state = compiled(params, None, jnp.int32(0), jnp.zeros((0,), jnp.int32), tokens,
                                 jnp.ones((1, S), bool), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                                 jnp.full(1, Tn, jnp.int32), jnp.zeros(1, jnp.int32), jax.random.PRNGKey(0), None)
                jax.block_until_ready(state.token)
                line += f"  {time.perf_counter() - t0:5.2f}"
            print(line, flush=True)
    print("temp x: temporaries over the previous prompt length's at the same chunk")


if __name__ == "__main__":
    main()
