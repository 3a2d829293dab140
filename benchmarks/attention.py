"""Attention implementations side by side: time of forward + backward, and XLA's memory for long rows.

    python benchmarks/attention.py                   # speed at 512..4096 tokens, memory at 8k and 32k
    python benchmarks/attention.py --lengths=1024,2048 --memory_lengths=8192,32768 --reps=3
    python benchmarks/attention.py --lengths= --tpu=v5e:2x4   # + XLA's TPU compile, no TPU needed (libtpu)

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


def tpu_update_item(T: int, impl: str, topology: str = "v5e:2x4", mesh_shape=(4, 1, 2), rows: int = 4,
                    segment: int = 8192) -> dict:
    """XLA's per-device memory of one update item compiled for a TPU slice without a TPU (needs libtpu:
    `pip install "jax[tpu]"`): 2 layers of Qwen3-0.6B's widths in bfloat16, `rows` rows of T tokens packed
    with `segment`-token rows, over a (data, fsdp, model) mesh of the slice's chips."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P
    from marl_jax.rl.loss import head_logprobs
    mesh = topologies.make_mesh(topologies.get_topology_desc(topology_name=topology, platform="tpu"), mesh_shape,
                                ("data", "fsdp", "model"))
    cfg = decoder.ModelConfig(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_layers=2, num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True,
                              max_position_embeddings=1 << 17, attention=impl)
    rep = NamedSharding(mesh, P())
    params = jax.eval_shape(lambda: decoder.cast_params(decoder.init_params(cfg, jax.random.PRNGKey(0)), jnp.bfloat16))
    params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), params)
    tokens = jax.ShapeDtypeStruct((rows, T), jnp.int32, sharding=NamedSharding(mesh, P("data", None)))

    def loss(p, tokens):
        seg = jnp.broadcast_to((jnp.arange(T) // segment + 1)[None], tokens.shape)
        h = decoder.forward(p, cfg, tokens, return_hidden=True, remat="full", mesh=mesh, segments=seg,
                            dtype=jnp.bfloat16)
        lp, _ = head_logprobs(lambda x: decoder.unembed(p, cfg, x, mesh=mesh), h[:, :-1], tokens[:, 1:], chunk=1024)
        return lp.mean()

    m = jax.jit(jax.grad(loss)).lower(params, tokens).compile().memory_analysis()
    return dict(temp=m.temp_size_in_bytes, args=m.argument_size_in_bytes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--memory_lengths", default="8192,32768")
    ap.add_argument("--segment", type=int, default=256, help="tokens per packed row")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tpu", default="", help="also compile the update item for this TPU slice (e.g. v5e:2x4; "
                    "needs libtpu) with splash, blockwise and dense attention")
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
    if args.tpu:
        T = max(lens)
        for impl in ("splash", "blockwise", "dense"):
            try:
                m = tpu_update_item(T, impl, args.tpu)
                print(f"tpu {args.tpu} update_item impl={impl} rows=4 T={T} temp_gib={m['temp'] / 2 ** 30:.3f} "
                      f"args_gib={m['args'] / 2 ** 30:.3f}", flush=True)
            except Exception as e:  # dense does not fit a 16 GiB chip: XLA says so
                print(f"tpu {args.tpu} update_item impl={impl} rows=4 T={T} error={str(e).splitlines()[0][:160]}")


if __name__ == "__main__":
    main()
