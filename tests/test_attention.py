"""marl_jax.models.attention: every implementation against dense attention (outputs and gradients), block
skipping on hand-worked layouts, the decoder under each implementation, and XLA's memory analysis of
attention whose memory grows with the tokens, not their square."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.models import attention as A
from marl_jax.models import decoder

TOL = 1e-5


def _qkv(seed, B, S, Hq, Hkv, hd, T=None, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    T = T or S
    return (jax.random.normal(ks[0], (B, S, Hq, hd), dtype), jax.random.normal(ks[1], (B, T, Hkv, hd), dtype),
            jax.random.normal(ks[2], (B, T, Hkv, hd), dtype))


def _layouts(B, S):
    """Causal rows with right and left padding, packed segments, and rows over a shared-prefix parent."""
    rng = np.random.RandomState(0)
    valid = np.ones((B, S), bool)
    valid[0, S - 5:] = False  # right padding
    valid[1, :3] = False  # left padding
    seg = np.zeros((B, S), np.int32)
    cuts = sorted(rng.choice(np.arange(2, S - 4), 3, replace=False))
    seg[0, :cuts[0]], seg[0, cuts[0]:cuts[1]], seg[0, cuts[1]:cuts[2]] = 1, 2, 3  # the rest: padding
    seg[1, :S - 2] = 1
    # shared prefix: segment 7 (a prompt) laid once, rows 1 and 2 extend it, row 3 stands alone
    sp = np.zeros((B, S), np.int32)
    par = np.zeros((B, S), np.int32)
    a, b, c = S // 4, S // 2, 3 * S // 4
    sp[:, :a], sp[:, a:b], sp[:, b:c], sp[:, c:S - 1] = 7, 1, 2, 3
    par[:, a:c] = 7
    return {"causal_right": A.causal(jnp.asarray(valid[:1].repeat(B, 0)), right_padded=True),
            "causal_padded": A.causal(jnp.asarray(valid)),
            "packed": A.packed(jnp.asarray(seg)),
            "shared_prefix": A.shared_prefix(jnp.asarray(sp), jnp.asarray(par))}


def _check(impl, q, k, v, layout, tol=TOL, **kw):
    """impl equals dense on every query that sees a key: outputs and d/dq, d/dk, d/dv of a random projection."""
    seen = layout.mask(k.shape[1]).any(-1)[..., None]  # queries with no key: unspecified output
    w = jax.random.normal(jax.random.PRNGKey(9), q.shape[:2] + (q.shape[2] * q.shape[3],)) * seen
    f = lambda name: lambda q, k, v: (A.attention(q, k, v, layout, name, **kw).astype(jnp.float32) * w).sum()
    ref = A.attention(q, k, v, layout, "dense")
    out = A.attention(q, k, v, layout, impl, **kw)
    assert bool(jnp.isfinite(out).all())
    np.testing.assert_allclose(np.asarray(out * seen, np.float32), np.asarray(ref * seen, np.float32), atol=tol, rtol=tol)
    g_ref = jax.grad(f("dense"), argnums=(0, 1, 2))(q, k, v)
    g = jax.grad(f(impl), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g, g_ref):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol,
                                   err_msg=f"d/d{name}")


@pytest.mark.parametrize("layout_name", ["causal_right", "causal_padded", "packed", "shared_prefix"])
@pytest.mark.parametrize("heads", [(4, 4), (16, 8)])  # MHA, and GQA (16 query / 8 KV heads)
def test_blockwise_equals_dense(layout_name, heads):
    B, S, hd = 2, 45, 8  # 45: not a multiple of the blocks
    q, k, v = _qkv(0, B, S, heads[0], heads[1], hd)
    _check("blockwise", q, k, v, _layouts(B, S)[layout_name], block_q=8, block_kv=16)


def test_blockwise_bfloat16_close_to_dense():
    B, S = 2, 40
    q, k, v = _qkv(1, B, S, 4, 2, 16, dtype=jnp.bfloat16)
    lay = _layouts(B, S)["packed"]
    out = A.attention(q, k, v, lay, "blockwise", block_q=16, block_kv=16)
    ref = A.attention(*(x.astype(jnp.float32) for x in (q, k, v)), lay, "dense")
    seen = lay.mask().any(-1)[..., None]
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray((out * seen).astype(jnp.float32)), np.asarray(ref * seen), atol=3e-2)


def test_blockwise_cached_chunk_equals_dense_over_the_cache_layout():
    """A chunk of queries at slots 20..31 of a cache of 64 slots (valid up to 32), read in the cache's layout."""
    B, S, T, Hq, Hkv, hd = 2, 12, 64, 4, 2, 8
    q, k, v = _qkv(2, B, S, Hq, Hkv, hd, T=T)
    valid = np.zeros((B, T), bool)
    valid[:, :32] = True
    valid[1, :4] = False  # a left-padded row
    slots = jnp.broadcast_to(20 + jnp.arange(S), (B, S))
    lay = A.cached(slots, jnp.asarray(valid))
    kc, vc = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # [B, H, hd, T], [B, H, T, hd]
    ref = A.attention(q, k, v, lay, "dense")
    np.testing.assert_allclose(A.attention(q, kc, vc, lay, "dense", kv_layout="cache"), ref, atol=TOL)
    np.testing.assert_allclose(A.attention(q, kc, vc, lay, "blockwise", kv_layout="cache", block_q=8, block_kv=16),
                               ref, atol=TOL)
    _check("blockwise", q, k, v, lay, block_q=8, block_kv=16)


def test_blocks_skipped_by_causality_and_segments():
    """Hand-worked: 4 rows of 64 tokens packed into 256, blocks of 32: each row covers 2 query blocks and
    needs its own 3 (q, kv) block pairs of the causal triangle: 12 of the 64 pairs; one causal row: 36."""
    seg = jnp.asarray(np.repeat(np.arange(1, 5), 64)[None])
    needed = A._needed(A.packed(seg), 32, 32, 8, 8)
    assert int(needed.sum()) == 12
    assert not bool(needed[2, 0]) and bool(needed[3, 2]) and bool(needed[3, 3]) and not bool(needed[3, 4])
    assert int(A._needed(A.causal(jnp.ones((1, 256), bool)), 32, 32, 8, 8).sum()) == 36
    # a cache chunk at slots 64..95 over 256 cache slots: only KV blocks 0..2 hold visible keys
    lay = A.cached(jnp.arange(64, 96)[None], jnp.ones((1, 256), bool))
    assert np.flatnonzero(np.asarray(A._needed(lay, 32, 32, 1, 8)[0])).tolist() == [0, 1, 2]
    # the pairs a benchmark counts: every pair for dense, the visited blocks' pairs for blockwise
    assert A.scored_pairs(A.packed(seg), "blockwise", block_q=32, block_kv=32) == 12 * 32 * 32
    assert A.scored_pairs(A.packed(seg), "dense") == 256 * 256


@pytest.mark.parametrize("layout_name", ["causal_padded", "packed"])
def test_splash_interpret_equals_dense(layout_name):
    """jax's Pallas splash kernel, run by the Pallas interpreter on CPU, with GQA and segment ids."""
    B, S = 2, 256
    q, k, v = _qkv(3, B, S, 4, 2, 64)
    _check("splash", q, k, v, _layouts(B, S)[layout_name], tol=2e-5, interpret=True)


def test_unexpressible_layouts_fall_back_and_say_so(caplog):
    """splash has no parent segments and cuDNN no float32: both fall back to blockwise, logged once."""
    B, S = 2, 40
    q, k, v = _qkv(4, B, S, 4, 2, 8)
    lays = _layouts(B, S)
    with caplog.at_level(logging.WARNING, logger="marl_jax.models.attention"):
        A._said.clear()
        for _ in range(2):
            _check("splash", q, k, v, lays["shared_prefix"], interpret=True)
            _check("cudnn", q, k, v, lays["causal_right"])
    said = [r.getMessage() for r in caplog.records]
    assert sum("splash attention cannot express" in m for m in said) == 1
    assert sum("cuDNN attention needs" in m for m in said) == 1


def test_auto_choice_and_bad_name():
    assert A.choose("auto", 1, 100_000, "cpu") == "dense"  # single-token decode
    assert A.choose("auto", 512, 512, "cpu") == "dense"  # short rows
    assert A.choose("auto", 1024, 1024, "cpu") == "blockwise"
    assert A.choose("auto", 4096, 4096, "tpu") == "splash"
    assert A.choose("auto", 4096, 4096, "gpu") == "cudnn"
    assert A.choose("blockwise", 1, 8) == "blockwise"
    assert A.choose("splash", 1, 4096, "tpu") == A.choose("cudnn", 1, 4096, "gpu") == "dense"  # decode
    # auto takes a kernel only where it expresses the layout (no fallback warnings from auto)
    lays = _layouts(2, 1024)
    assert A.choose("auto", 1024, 1024, "tpu", lays["shared_prefix"]) == "blockwise"
    assert A.choose("auto", 1024, 1024, "tpu", lays["packed"]) == "splash"
    assert A.choose("auto", 1024, 1024, "gpu", lays["causal_right"], jnp.float32) == "dense"
    assert A.choose("auto", 1024, 1024, "gpu", lays["causal_right"], jnp.bfloat16) == "cudnn"
    # on GPU, what cuDNN cannot express is dense while its scores stay small (blockwise is slow there)
    assert A.choose("auto", 1024, 1024, "gpu", lays["packed"], jnp.bfloat16) == "dense"
    big = _layouts(2, 8192)
    assert A.choose("auto", 8192, 8192, "gpu", big["packed"], jnp.bfloat16) == "blockwise"
    assert A.choose("auto", 8192, 8192, "gpu", big["causal_right"], jnp.bfloat16) == "cudnn"
    with pytest.raises(ValueError, match="model.attention must be one of"):
        A.choose("flash", 8, 8)


def _tiny(attention="auto", layers=2, heads=(4, 2)):
    cfg = decoder.ModelConfig(family="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=layers,
                              num_heads=heads[0], num_kv_heads=heads[1], head_dim=8, qk_norm=True,
                              max_position_embeddings=1 << 16, attention=attention)
    return cfg, decoder.init_params(cfg, jax.random.PRNGKey(0))


def test_decoder_blockwise_equals_dense_packed_and_shared_prefix_with_gradients():
    import dataclasses
    cfg, params = _tiny("dense")
    bcfg = dataclasses.replace(cfg, attention="blockwise")
    rng = np.random.RandomState(1)
    tokens = jnp.asarray(rng.randint(1, 97, (2, 40)))
    lays = _layouts(2, 40)
    seg = lays["packed"].kv_seg
    sp, par = lays["shared_prefix"].kv_seg, lays["shared_prefix"].q_parent
    pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
    for segments in (seg, (sp, par, pos)):
        real = ((segments[0] if isinstance(segments, tuple) else segments) > 0)[..., None]  # padding: unspecified

        def loss(p, c):
            return ((decoder.forward(p, c, tokens, segments=segments) * real) ** 2).mean()
        np.testing.assert_allclose(decoder.forward(params, bcfg, tokens, segments=segments) * real,
                                   decoder.forward(params, cfg, tokens, segments=segments) * real, atol=2e-5)
        ga, gb = jax.grad(loss)(params, cfg), jax.grad(loss)(params, bcfg)
        for a, b in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb)):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def _update_item_temp(cfg, T, impl):
    """XLA's temporaries of one update item: loss and gradients of a [1, T] row (chunked log-probs)."""
    import dataclasses
    from marl_jax.rl.loss import head_logprobs
    cfg = dataclasses.replace(cfg, attention=impl)
    params = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.PRNGKey(0)))

    def loss(p, tokens):
        h = decoder.forward(p, cfg, tokens, return_hidden=True, remat="full")
        lp, _ = head_logprobs(lambda x: decoder.unembed(p, cfg, x), h[:, :-1], tokens[:, 1:], chunk=256)
        return lp.mean()

    c = jax.jit(jax.grad(loss)).lower(params, jax.ShapeDtypeStruct((1, T), jnp.int32)).compile()
    return c.memory_analysis().temp_size_in_bytes


def test_update_item_memory_grows_linearly_with_blockwise_quadratically_with_dense():
    """XLA's own memory analysis (compiled, not run): 4x the tokens costs blockwise <= 4.5x the
    temporaries; dense grows ~16x (its [heads, T, T] scores)."""
    cfg, _ = _tiny(layers=2, heads=(4, 2))
    small, large = 1024, 4096
    blk = _update_item_temp(cfg, large, "blockwise") / _update_item_temp(cfg, small, "blockwise")
    dense = _update_item_temp(cfg, large, "dense") / _update_item_temp(cfg, small, "dense")
    assert blk <= 4.5, blk
    assert dense >= 10, dense


_MESH_SCRIPT = r'''
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from marl_jax.models import attention as A, sharding
mesh = sharding.make_mesh(data=2, model=2)
ks = jax.random.split(jax.random.PRNGKey(0), 3)
q = jax.random.normal(ks[0], (2, 256, 4, 64))
k, v = (jax.random.normal(x, (2, 256, 2, 64)) for x in ks[1:])
seg = np.zeros((2, 256), np.int32); seg[0, :100] = 1; seg[0, 100:200] = 2; seg[1, :250] = 1
lay = A.packed(jnp.asarray(seg)); seen = lay.mask().any(-1)[..., None]
loss = lambda impl, m: lambda q, k, v: (A.attention(q, k, v, lay, impl, interpret=True, mesh=m) * seen).sum()
out = jax.jit(lambda q, k, v: A.attention(q, k, v, lay, "splash", interpret=True, mesh=mesh))(q, k, v)
diff = [float(jnp.abs((out - A.attention(q, k, v, lay, "dense")) * seen).max())]
g = jax.jit(jax.grad(loss("splash", mesh), argnums=(0, 1, 2)))(q, k, v)
diff += [float(jnp.abs(a - b).max()) for a, b in zip(g, jax.grad(loss("dense", None), argnums=(0, 1, 2))(q, k, v))]
print("DIFF", max(diff))
'''


def test_splash_under_a_mesh_equals_dense():
    """Rows over "data", KV heads over "model": splash inside shard_map on 4 CPU devices (interpreted)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    diff = float(run.stdout.split("DIFF")[-1])
    assert diff < 2e-5, diff
