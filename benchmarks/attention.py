"""Attention implementations side by side: time of forward + backward, and XLA's memory for long rows.

    python benchmarks/attention.py                   # speed at 512..4096 tokens, memory at 8k and 32k
    python benchmarks/attention.py --lengths=1024,2048 --memory_lengths=8192,32768 --reps=3
    python benchmarks/attention.py --lengths= --tpu=v5e:2x4   # + XLA's TPU compile, no TPU needed (libtpu)
    python benchmarks/attention.py --lengths= --memory_lengths= --tpu=v5e:2x4 --decode   # paged decode, TPU

Speed: one layer's attention (SmolLM2-135M's heads: 9 query / 3 KV heads of 64) over one row, causal and
packed (rows of --segment tokens laid end to end), forward + backward of every implementation that runs
here, and `ratio=` dense seconds / blockwise seconds. Memory: XLA's memory analysis (compiled, not run)
of one update item (a tiny 2-layer Qwen3's loss and gradients over one row, chunked log-probs) at each
of --memory_lengths, per implementation, with the growth factor from the shortest length.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
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
    from marl_jax.plan_aot import tpu_topology
    from marl_jax.rl.loss import head_logprobs
    mesh = topologies.make_mesh(tpu_topology(topology), mesh_shape, ("data", "fsdp", "model"))
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


def tpu_decode_step(kernel: bool, topology: str = "v5e:2x4", rows: int = 64, pool_tokens: int = 32768,
                    window: int = 4096, block: int = 16, layers: int = 28, data: int = 1) -> dict:
    """XLA's per-device memory and cost of one decode step over a paged KV pool, compiled for a TPU slice
    without a TPU (needs libtpu): Qwen3-0.6B's widths (16 query / 8 KV heads of 128, `layers` layers) in
    bfloat16, `rows` rows reading a window of `window` slots each through their block tables, a pool of
    `pool_tokens` slots in all (blocks of `block`, split over the row shards). kernel: the Pallas paged-attention kernel
    (right-padded rows); else the gather path (each row's window of blocks gathered, then attended).
    data > 1: rows and the pool over that many chips of a (data, 1, 1) mesh, the kernel inside shard_map."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from marl_jax.plan_aot import tpu_topology
    devs = tpu_topology(topology).devices
    mesh = Mesh(np.asarray(devs[:data]).reshape(data, 1, 1), ("data", "fsdp", "model"))
    cfg = decoder.ModelConfig(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_layers=layers, num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True,
                              tie_word_embeddings=True, attention="splash" if kernel else "auto")
    bf = jnp.bfloat16
    rep = NamedSharding(mesh, P())
    rows_sh = NamedSharding(mesh, P("data"))
    params = jax.eval_shape(lambda: decoder.cast_params(decoder.init_params(cfg, jax.random.PRNGKey(0)), bf))
    params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), params)
    N = pool_tokens // data // block + 1  # per row shard, + its null block
    pool = jax.ShapeDtypeStruct((cfg.num_kv_heads, layers, data, N, block, cfg.head_dim), bf,
                                sharding=NamedSharding(mesh, P(None, None, "data")))
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rows_sh)
    M = window // block
    cache = decoder.PagedCache(pool, pool, sds((rows, M), jnp.int32), sds((data, N), jnp.int32), sds((data,), jnp.int32))

    def step(params, cache, tokens, positions, widx):
        return decoder.forward_cached(params, cfg, tokens, positions, cache, widx, jnp.ones((rows, 1), bool),
                                      dtype=bf, window=window, right_padded=kernel,
                                      mesh=mesh if data > 1 else None)

    c = jax.jit(step, donate_argnums=(1,)).lower(params, cache, sds((rows, 1), jnp.int32), sds((rows, 1), jnp.int32),
                                                 sds((rows,), jnp.int32)).compile()
    m, cost = c.memory_analysis(), c.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dict(temp=m.temp_size_in_bytes, args=m.argument_size_in_bytes, out=m.output_size_in_bytes,
                flops=cost.get("flops", 0.0), bytes=cost.get("bytes accessed", 0.0))


def tpu_paged_op(path: str, topology: str = "v5e:2x4", rows: int = 64, pool_tokens: int = 32768,
                 window: int = 4096, block: int = 16, layers: int = 28) -> dict:
    """XLA's memory and cost of one layer's decode attention over a paged pool (Qwen3-0.6B heads, bfloat16),
    compiled for one chip of a TPU slice, by the pool's storage layout:
    "gather": the pool as PagedCache keeps it ([L, 1, N, blk, Hkv, hd]), rows' blocks gathered, dense attention;
    "kernel": the same pool, the Pallas kernel through paged_decode (the layer sliced out and viewed with
    heads in lanes: on TPU a copy of the layer's pool);
    "lanes": a pool stored [L, N, blk, Hkv * hd] (heads merged into the lane dimension), the kernel reading it
    in place (the view paged_decode makes is then free);
    "heads_first": a pool stored [Hkv, L * N, blk, hd], the kernel's own layout, one KV head per grid step."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from jax.sharding import SingleDeviceSharding
    from marl_jax.plan_aot import tpu_topology
    dev = tpu_topology(topology).devices[0]
    sh = SingleDeviceSharding(dev)
    Hq, Hkv, hd, bf = 16, 8, 128, jnp.bfloat16
    N, M = pool_tokens // block + 1, window // block
    sds = lambda shape, dt=bf: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    q, table, lengths, layer = sds((rows, 1, Hq, hd)), sds((rows, M), jnp.int32), sds((rows,), jnp.int32), sds((), jnp.int32)
    if path in ("gather", "kernel"):
        pool = sds((layers, 1, N, block, Hkv, hd))

        def f(q, k, v, table, lengths, layer):
            if path == "kernel":
                return A.paged_decode(q, k, v, layer, table, lengths)
            lay = A.cached(lengths[:, None] - 1, jnp.arange(window)[None] < lengths[:, None], True)
            return A.attention(q, decoder.paged_read(k, layer, table), decoder.paged_read(v, layer, table), lay, "dense")
    else:
        g = Hq // Hkv
        pool = sds((layers, N, block, Hkv * hd)) if path == "lanes" else sds((Hkv, layers * N, block, hd))

        def f(q, k, v, table, lengths, layer):
            pages = layer * N + table
            if path == "heads_first":
                out = paged_attention((q[:, 0] / math.sqrt(hd)).astype(bf), k, v, lengths, pages,
                                      pages_per_compute_block=8)
                return out.reshape(rows, 1, Hq * hd)
            own = (jnp.arange(Hq) // g)[:, None] == jnp.arange(Hkv)[None]
            qw = jnp.where(own[None, :, :, None], (q[:, 0] / math.sqrt(hd)).astype(bf)[:, :, None], 0)
            out = paged_attention(qw.reshape(rows, Hq, Hkv * hd), k.reshape(1, layers * N, block, Hkv * hd),
                                  v.reshape(1, layers * N, block, Hkv * hd), lengths, pages, pages_per_compute_block=8)
            return jnp.where(own[None, :, :, None], out.reshape(rows, Hq, Hkv, hd), 0).sum(2).reshape(rows, 1, Hq * hd)
    c = jax.jit(f).lower(q, pool, pool, table, lengths, layer).compile()
    m, cost = c.memory_analysis(), c.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dict(temp=m.temp_size_in_bytes, args=m.argument_size_in_bytes, flops=cost.get("flops", 0.0),
                bytes=cost.get("bytes accessed", 0.0))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--memory_lengths", default="8192,32768")
    ap.add_argument("--segment", type=int, default=256, help="tokens per packed row")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tpu", default="", help="also compile the update item for this TPU slice (e.g. v5e:2x4; "
                    "needs libtpu) with splash, blockwise and dense attention")
    ap.add_argument("--decode", action="store_true", help="with --tpu: compile a paged decode step (Qwen3-0.6B "
                    "widths, 64 rows, a 32k-token pool) with the Pallas paged-attention kernel and with the gather "
                    "path, on one chip and over 8, and one layer's decode attention by pool layout")
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
    if args.tpu and args.decode:
        gib = lambda b: f"{b / 2 ** 30:.4f}"
        for data in (1, 8):
            for kernel in (True, False):
                m = tpu_decode_step(kernel, args.tpu, data=data)
                print(f"tpu {args.tpu} decode_step path={'kernel' if kernel else 'gather'} chips={data} rows=64 "
                      f"pool_tokens=32768 window=4096 layers=28 temp_gib={gib(m['temp'])} args_gib={gib(m['args'])} "
                      f"out_gib={gib(m['out'])} gflops={m['flops'] / 1e9:.2f} accessed_gib={gib(m['bytes'])}", flush=True)
        for path in ("gather", "kernel", "lanes", "heads_first"):
            m = tpu_paged_op(path, args.tpu)
            print(f"tpu {args.tpu} decode_attention_one_layer pool={path} temp_gib={gib(m['temp'])} "
                  f"gflops={m['flops'] / 1e9:.3f} accessed_gib={gib(m['bytes'])}", flush=True)
    if args.tpu and lens:
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
