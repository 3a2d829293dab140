"""Decode over a paged KV pool with jax's Pallas paged-attention kernel (marl_jax.models.attention.paged_decode,
run by the Pallas TPU interpreter on CPU) and with the fused XLA path (paged_fused, GPU's), against the gather
path (the rows' blocks gathered, then dense attention): the attention alone (float32, bfloat16, GQA, rows of
different lengths, null blocks, row shards, under a mesh), a decode step through the decoder and the sampler;
and which path `choose` takes where."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from marl_jax.models import attention as A
from marl_jax.models import decoder

BLK, HQ, HKV, HD = 16, 4, 2, 128


def _pool(seed, L, D, N, dtype=jnp.float32):
    """Random keys and values whose values are bfloat16 numbers (the kernel loads pages as bfloat16)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    shape = (HKV, L, D, N, BLK, HD)  # the pool's layout: KV heads first
    return (jax.random.normal(k1, shape).astype(jnp.bfloat16).astype(dtype),
            jax.random.normal(k2, shape).astype(jnp.bfloat16).astype(dtype))


def _rows(D):
    """Block tables and lengths: 3 rows (4 with 2 shards) of different lengths, unallocated entries on the
    null block, a row ending mid-block and one filling its window."""
    if D == 1:
        table = np.array([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]], np.int32)
        lengths = np.array([40, 17, 64], np.int32)
    else:  # rows 0-1 in shard 0, rows 2-3 in shard 1 (block numbers are per shard)
        table = np.array([[1, 2, 3, 0], [4, 0, 0, 0], [1, 2, 3, 4], [5, 6, 0, 0]], np.int32)
        lengths = np.array([33, 5, 64, 20], np.int32)
    return jnp.asarray(table), jnp.asarray(lengths)


def _gather(q, k, v, layer, table, lengths):
    W = table.shape[1] * BLK
    lay = A.cached(lengths[:, None] - 1, jnp.arange(W)[None] < lengths[:, None], right_padded=True)
    read = lambda pool: decoder.paged_read(pool, layer, table).astype(q.dtype)
    return A.attention(q, read(k), read(v), lay, "dense")


@pytest.mark.parametrize("shards", [1, 2])
def test_kernel_equals_gather_float32(shards):
    """GQA (4 query / 2 KV heads of 128), pages of 16, every layer of the pool, rows of different lengths."""
    k, v = _pool(0, 2, shards, 10)
    table, lengths = _rows(shards)
    q = jax.random.normal(jax.random.PRNGKey(1), (table.shape[0], 1, HQ, HD))
    run = jax.jit(lambda q, k, v, layer: A.paged_decode(q, k, v, layer, table, lengths, interpret=True))
    for layer in range(2):  # one program, the layer traced
        out = run(q, k, v, layer)
        ref = _gather(q, k, v, layer, table, lengths)
        assert out.shape == ref.shape == (table.shape[0], 1, HQ * HD)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shards", [1, 2])
def test_fused_equals_gather_float32(shards):
    """The GPU path (scores and output as reductions over the pages indexed in place) is the gather path's
    attention, layer by layer, over rows of different lengths and row shards."""
    k, v = _pool(0, 2, shards, 10)
    table, lengths = _rows(shards)
    q = jax.random.normal(jax.random.PRNGKey(1), (table.shape[0], 1, HQ, HD))
    run = jax.jit(lambda q, k, v, layer: A.paged_fused(q, k, v, layer, table, lengths))
    for layer in range(2):
        np.testing.assert_allclose(np.asarray(run(q, k, v, layer)), np.asarray(_gather(q, k, v, layer, table, lengths)),
                                   atol=1e-5, rtol=1e-5)


def test_kernel_bfloat16_close_to_float32():
    """bfloat16 queries and pool: the kernel and the gather path both within bfloat16 error of float32."""
    k, v = _pool(2, 1, 1, 10, jnp.bfloat16)
    table, lengths = _rows(1)
    q = jax.random.normal(jax.random.PRNGKey(3), (3, 1, HQ, HD)).astype(jnp.bfloat16)
    exact = _gather(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), 0, table, lengths)
    out = A.paged_decode(q, k, v, 0, table, lengths, interpret=True)
    fused = A.paged_fused(q, k, v, 0, table, lengths)
    gathered = _gather(q, k, v, 0, table, lengths)
    assert out.dtype == fused.dtype == jnp.bfloat16
    err = lambda x: float(jnp.abs(x.astype(jnp.float32) - exact).max())
    assert err(out) < 2e-2 and err(fused) < 2e-2 and err(gathered) < 2e-2, (err(out), err(fused), err(gathered))


def _tiny(attention):
    return decoder.ModelConfig(family="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                               num_heads=HQ, num_kv_heads=HKV, head_dim=HD, qk_norm=True, attention=attention)


@pytest.mark.parametrize("attention", ["splash", "cudnn"])
def test_decode_step_through_the_decoder(attention):
    """One decode step of forward_cached over a bfloat16 PagedCache: the kernel (model.attention=splash,
    interpreted) and the fused path (cudnn: the GPU paths) give the gather path's logits and the same pool."""
    cfg = _tiny(attention)
    params = decoder.init_params(cfg, jax.random.PRNGKey(0))
    B, M, N = 3, 4, 10
    cache = decoder.init_paged(cfg, N, BLK, B, M * BLK, 1, jnp.bfloat16)
    k, v = _pool(4, cfg.num_layers, 1, N, jnp.bfloat16)
    table, lengths = _rows(1)
    lengths = lengths - 1  # slots held before this step; the step writes at slot `lengths`
    cache = cache._replace(k=k, v=v, table=table)
    tokens = jnp.asarray([[5], [17], [42]], jnp.int32)
    step = lambda cfg: decoder.forward_cached(params, cfg, tokens, lengths[:, None], cache, lengths,
                                              jnp.ones((B, 1), bool), window=M * BLK)
    with pltpu.force_tpu_interpret_mode():
        logits, new = step(cfg)
    ref, new_ref = step(_tiny("dense"))  # dense: the gather path on any backend
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=1e-5, rtol=1e-5)
    for a, b in zip(new[2:], new_ref[2:]):  # table, free list
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(new[:2], new_ref[:2]):  # the written keys and values: equal up to bfloat16 rounding
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-2, rtol=1e-2)
    at = (np.asarray(table)[np.arange(B), np.asarray(lengths) // BLK], np.asarray(lengths) % BLK)
    written = np.asarray(new.k[:, 0, 0], np.float32)[:, at[0], at[1]]
    assert np.abs(written - np.asarray(k[:, 0, 0], np.float32)[:, at[0], at[1]]).max() > 0  # the step's slot written


def test_choice_of_the_decode_path(caplog):
    """auto takes the kernel on TPU only; explicit splash anywhere; only for single-token decode of
    right-padded rows over a bfloat16 pool, otherwise the gather path (an explicit splash says so once)."""
    valid = jnp.ones((2, 64), bool)
    rp = A.cached(jnp.zeros((2, 1), jnp.int32), valid, right_padded=True)
    holes = A.cached(jnp.zeros((2, 1), jnp.int32), valid)
    bf, f32 = jnp.bfloat16, jnp.float32
    assert A.choose("auto", 1, 64, "tpu", rp, bf, pool=True) == "paged"
    assert A.choose("splash", 1, 64, "cpu", rp, bf, pool=True) == "paged"
    assert A.choose("auto", 1, 64, "cpu", rp, bf, pool=True) == "dense"
    assert A.choose("auto", 1, 64, "gpu", rp, bf, pool=True) == "paged_fused"
    assert A.choose("cudnn", 1, 64, "cpu", rp, f32, pool=True) == "paged_fused"
    assert A.choose("auto", 1, 64, "gpu", holes, bf, pool=True) == "dense"
    assert A.choose("dense", 1, 64, "tpu", rp, bf, pool=True) == "dense"
    assert A.choose("auto", 1, 64, "tpu", rp, bf) == "dense"  # not a pool: the dense cache's decode
    assert A.choose("auto", 1, 64, "tpu", holes, bf, pool=True) == "dense"
    assert A.choose("auto", 1, 64, "tpu", rp, f32, pool=True) == "dense"
    assert A.choose("auto", 512, 1024, "tpu", rp, bf, pool=True) != "paged"  # several queries per row
    A._said.clear()
    with caplog.at_level(logging.WARNING, logger="marl_jax.models.attention"):
        for _ in range(2):
            assert A.choose("splash", 1, 64, "tpu", holes, bf, pool=True) == "dense"
    assert sum("paged-attention kernel needs" in r.getMessage() for r in caplog.records) == 1


_MESH_SCRIPT = r'''
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import sys
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
from marl_jax.models import attention as A, sharding
import tests.test_paged_attention as T
mesh = sharding.make_mesh(data=2, model=2)
k, v = T._pool(5, 2, 2, 10)
table, lengths = T._rows(2)
q = jax.random.normal(jax.random.PRNGKey(6), (4, 1, T.HQ, T.HD))
out = jax.jit(lambda q, k, v: A.paged_decode(q, k, v, 1, table, lengths, interpret=True, mesh=mesh))(q, k, v)
ref = T._gather(q, k, v, 1, table, lengths)
print("DIFF", float(jnp.abs(out - ref).max()))
# The fused path (plain XLA) over the pool placed as the sampler places it: KV heads over "model", row shards
# over "data".
from jax.sharding import NamedSharding, PartitionSpec as P
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("model", None, "data")))
fused = jax.jit(lambda q, k, v: A.paged_fused(q, k, v, 1, table, lengths))(q, put(k), put(v))
print("FUSED", float(jnp.abs(fused - ref).max()))
'''


def test_kernel_under_a_mesh():
    """Row shards over "data" (a pool part per shard), KV heads over "model": the kernel inside shard_map on
    4 CPU devices (interpreted), and the fused path over the pool so placed, equal the gather path."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                         cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    diff = float(run.stdout.split("DIFF")[-1].split()[0])
    fused = float(run.stdout.split("FUSED")[-1])
    assert diff < 1e-5 and fused < 1e-5, (diff, fused)


def _count_kernel_calls(monkeypatch):
    """Counts the decode programs traced through the kernel (paged_decode is called at trace time)."""
    calls = []
    real = A.paged_decode

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(A, "paged_decode", spy)
    return calls


def test_sampler_decodes_through_the_kernel_under_preemption(monkeypatch):
    """The sampler's paged decode over a bfloat16 pool (float32 compute, kv_dtype=bfloat16) with
    model.attention=splash (the TPU choice, here interpreted): rows hold their tokens compacted (token p in
    slot p), so every decode step goes through the kernel. 10 prompts in groups (shared prompt blocks), a KV
    budget that preempts rows several times: the greedy tokens equal those of the gather path (the same pool,
    budget and prefill, decode gathering the rows' blocks) and of an unbudgeted kernel run, log-probs to 1e-4,
    and the pool's bookkeeping holds at every host step."""
    from marl_jax.generate.sampler import Sampler, SamplingParams
    cfg = _tiny("splash")
    params = decoder.init_params(cfg, jax.random.PRNGKey(7))
    rng = np.random.default_rng(5)
    base = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (3, 9, 17, 30, 33)]
    prompts = [p for p in base for _ in range(2)]
    sp = SamplingParams(20, temperature=0.0)  # an interpreted decode step takes ~1 s
    block = 2 * cfg.num_layers * BLK * HKV * HD * 2  # one bfloat16 block, keys and values, every layer

    def run(budget_blocks):
        s = Sampler(cfg, kv_dtype=jnp.bfloat16, max_batch=8, kv_block=BLK, paged=True, prefix_cache_tokens=0,
                    kv_budget_bytes=budget_blocks * block, check_blocks=True)
        with pltpu.force_tpu_interpret_mode():
            out = s.generate(params, prompts, jax.random.PRNGKey(0), sp)
        return out, s.stats

    calls = _count_kernel_calls(monkeypatch)
    kernel, st = run(9)
    assert calls, "the decode steps did not go through the paged-attention kernel"
    assert st["preemptions"] >= 3 and st["resumed_rows"] > 0, st
    free, st_f = run(0)
    assert st_f["preemptions"] == 0
    traced = len(calls)
    monkeypatch.setattr(A, "_paged_can", lambda *a, **k: False)  # the same run, decode gathering blocks
    gather, st_g = run(9)
    assert len(calls) == traced and st_g["preemptions"] == st["preemptions"]
    for other in (gather, free):
        np.testing.assert_array_equal(kernel.tokens, other.tokens)
        np.testing.assert_array_equal(kernel.lengths, other.lengths)
        np.testing.assert_allclose(kernel.logprobs, other.logprobs, atol=1e-4)

