"""Attention implementations side by side: time of forward + backward, and XLA's memory for long rows.

    python benchmarks/attention.py                   # speed at 512..4096 tokens, memory at 8k and 32k
    python benchmarks/attention.py --lengths=1024,2048 --memory_lengths=8192,32768 --reps=3

Speed: one layer's attention (SmolLM2-135M's heads: 9 query / 3 KV heads of 64) over one row, causal and
packed (rows of --segment tokens laid end to end), forward + backward of every implementation that runs
here, and `ratio=` dense seconds / blockwise seconds. Memory: XLA's memory analysis (compiled, not run)
of one update item (a tiny 2-layer Qwen3's loss and gradients over one row, chunked log-probs) at each
of --memory_lengths, per implementation, with the growth factor from the shortest length.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from marl_jax.models import attention as A  # noqa: E402
from marl_jax.models import decoder  # noqa: E402


def _time(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t) / reps


def speed(T: int, layout: str, segment: int, reps: int, heads=(9, 3), hd: int = 64) -> dict:
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (1, T, heads[0], hd))
    k = jax.random.normal(ks[1], (1, T, heads[1], hd))
    v = jax.random.normal(ks[2], (1, T, heads[1], hd))
    if layout == "packed":
        lay = A.packed(jnp.asarray((np.arange(T) // segment + 1)[None], jnp.int32))
    else:
        lay = A.causal(jnp.ones((1, T), bool))
    out = {}
    for impl in ("dense", "blockwise"):
        f = jax.jit(jax.grad(lambda q, k, v: A.attention(q, k, v, lay, impl).sum(), argnums=(0, 1, 2)))
        out[impl] = _time(f, q, k, v, reps=reps)
    return out


def update_item_temp(T: int, impl: str) -> int:
    from marl_jax.rl.loss import head_logprobs
    cfg = decoder.ModelConfig(family="qwen3", vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                              max_position_embeddings=1 << 17, attention=impl)
    params = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.PRNGKey(0)))

    def loss(p, tokens):
        h = decoder.forward(p, cfg, tokens, return_hidden=True, remat="full")
        lp, _ = head_logprobs(lambda x: decoder.unembed(p, cfg, x), h[:, :-1], tokens[:, 1:], chunk=1024)
        return lp.mean()

    c = jax.jit(jax.grad(loss)).lower(params, jax.ShapeDtypeStruct((1, T), jnp.int32)).compile()
    return int(c.memory_analysis().temp_size_in_bytes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--memory_lengths", default="8192,32768")
    ap.add_argument("--segment", type=int, default=256, help="tokens per packed row")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"backend={jax.default_backend()} jax={jax.__version__}")
    for T in [int(x) for x in args.lengths.split(",") if x]:
        for layout in ("causal", "packed"):
            t = speed(T, layout, args.segment, args.reps)
            print(f"speed T={T} layout={layout} dense_s={t['dense']:.4f} blockwise_s={t['blockwise']:.4f} "
                  f"ratio={t['dense'] / t['blockwise']:.2f}", flush=True)
    lens = [int(x) for x in args.memory_lengths.split(",") if x]
    for impl in ("blockwise", "dense"):
        first = None
        for T in lens:
            try:
                b = update_item_temp(T, impl)
            except Exception as e:  # dense at 32k may not even compile on a small host
                print(f"memory impl={impl} T={T} error={type(e).__name__}")
                continue
            first = first or (T, b)
            print(f"memory update_item impl={impl} T={T} temp_gib={b / 2 ** 30:.3f} "
                  f"growth={b / first[1]:.2f} for {T / first[0]:.0f}x tokens", flush=True)


if __name__ == "__main__":
    main()
