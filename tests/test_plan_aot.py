"""The planner against XLA compiling the run's own programs (marl_jax.plan_aot), compile only, never run:
one update item (rl.update's loss terms of one micro-batch and their VJP), one prefill chunk and one decode
step over a paged pool (decoder.forward_cached). On CPU always; for a TPU slice without a TPU when libtpu is
installed (`pip install -e ".[aot]"`), skipped otherwise. The planner's temporaries must be within 15% of
XLA's, at shapes other than those its coefficients were counted on."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from marl_jax import plan as P
from marl_jax import plan_aot as A
from marl_jax.models import decoder, sharding
from marl_jax.rl import memory as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = decoder.ModelConfig(family="qwen3", vocab_size=2048, hidden_size=192, intermediate_size=768, num_layers=3,
                          num_heads=6, num_kv_heads=2, head_dim=32, qk_norm=True, tie_word_embeddings=False)
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
f32 = jnp.float32


def _close(ours, xla, tol=0.15, what=""):
    assert abs(ours - xla) <= tol * xla, f"{what}: plan {ours / 1e6:.2f} MB vs XLA {xla / 1e6:.2f} MB ({ours / xla - 1:+.1%})"


def _cpu_mesh():
    return sharding.make_mesh(1, 1, devices=jax.devices()[:1])


@pytest.mark.parametrize("impl,rows,T,W,remat", [("blockwise", 1, 1536, 256, "full"), ("blockwise", 3, 768, 128, "dots"),
                                                 ("blockwise", 1, 1280, 128, "none"), ("dense", 2, 320, 64, "full")])
def test_update_item_on_cpu(impl, rows, T, W, remat):
    cfg = dataclasses.replace(CFG, attention=impl)
    a = A.analyse(A.update_item(cfg, rows=rows, T=T, W=W, mesh=_cpu_mesh(), rank=16, remat=remat, dtype=f32,
                                param_dtype=f32))
    ours = M.activation_bytes(cfg, rows=rows, T=T, W=W, remat=remat, e=4, rank=16, impl=impl)
    _close(ours, a["temporaries"], what=f"update item {impl} {remat}")


@pytest.mark.parametrize("rows,chunk,prompt", [(2, 384, 3072), (3, 256, 6144), (4, 192, 768)])
def test_prefill_chunk_on_cpu(rows, chunk, prompt):
    a = A.analyse(A.prefill_chunk(CFG, rows=rows, chunk=chunk, prompt=prompt, mesh=_cpu_mesh(), dtype=f32,
                                  param_dtype=f32))
    _close(P.prefill_chunk_bytes(CFG, rows, chunk, prompt, 4), a["temporaries"], what="prefill chunk")


@pytest.mark.parametrize("rows,blocks,window", [(48, 300, 768), (24, 400, 3072)])
def test_decode_step_on_cpu(rows, blocks, window):
    a = A.analyse(A.decode_step(CFG, rows=rows, blocks=blocks, block=16, window=window, mesh=_cpu_mesh(), dtype=f32,
                                param_dtype=f32))
    _close(P.decode_step_bytes(CFG, rows, window, 4), a["temporaries"], what="decode step")
    # The pool of the budget's blocks is the argument the plan counts as the KV cache.
    pool = 2 * CFG.num_layers * blocks * 16 * CFG.kv_dim * 4
    assert pool <= a["arguments"] <= pool * 1.15 + 16 * 2 ** 20


def test_without_libtpu_the_message_names_the_extra():
    if HAS_LIBTPU:
        pytest.skip("libtpu is installed here")
    with pytest.raises(ValueError, match=r'pip install -e "\.\[aot\]"'):
        A.tpu_devices("v5e", 4)
    out = subprocess.run([sys.executable, "-m", "marl_jax.plan", "--config=configs/voting.py:qwen3-1.7b,math",
                          "--chip=v5p-8", "--aot"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == ('marl_jax.plan: --aot compiles for a TPU slice with libtpu, which is '
                                                    'not installed: pip install -e ".[aot]"')


def test_gpu_is_refused_with_a_reason():
    from marl_jax.config import base_config
    with pytest.raises(ValueError, match="cannot be compiled for without"):
        A.aot(base_config("voting", ("generator", "aggregator")), "H100-80GB")


@pytest.mark.skipif(not HAS_LIBTPU, reason='libtpu is not installed (pip install -e ".[aot]"): no deviceless TPU compile')
def test_tpu_programs_against_the_plan():
    """v5e:2x2 (4 compile-only chips), rows over the data axis, bfloat16, splash attention in the update item.

    The planner's coefficients are counted on XLA:CPU; XLA:TPU fuses more (at these small widths it never
    materialises the decode step's gathered window), so on TPU the plan is an upper bound here, not a 15%
    estimate (docs/planner.md gives the ratios, and --aot at the real shapes, where they are close)."""
    devices = A.tpu_devices("v5e", 4)
    mesh = sharding.make_mesh(4, 1, devices=devices)
    m = P.Mesh(4)
    bf = jnp.bfloat16
    cfg = dataclasses.replace(CFG, num_heads=4, num_kv_heads=2, head_dim=128, hidden_size=512, intermediate_size=1024)
    rows, T, W = 8, 2048, 256
    got = {}
    for remat in ("none", "full"):
        a = A.analyse(A.update_item(dataclasses.replace(cfg, attention="splash"), rows=rows, T=T, W=W, mesh=mesh,
                                    rank=16, remat=remat, dtype=bf, param_dtype=bf))
        got[f"update {remat}"] = (M.activation_bytes(cfg, rows=rows // 4, T=T, W=W, remat=remat, e=2, rank=16,
                                                     impl="splash"), a["temporaries"])
    a = A.analyse(A.prefill_chunk(dataclasses.replace(cfg, attention="blockwise"), rows=8, chunk=512, prompt=4096,
                                  mesh=mesh, dtype=bf, param_dtype=bf))
    got["prefill"] = (P.prefill_chunk_bytes(cfg, 2, 512, 4096, 2, m), a["temporaries"])
    a = A.analyse(A.decode_step(cfg, rows=64, blocks=600, block=16, window=2048, mesh=mesh, dtype=bf, param_dtype=bf))
    got["decode"] = (P.decode_step_bytes(cfg, 16, 2048, 2, m), a["temporaries"])
    pool = 2 * cfg.num_layers * 600 * 16 * cfg.kv_dim * 2
    assert pool <= a["arguments"] <= pool * 1.15 + 16 * 2 ** 20  # the pool the plan counts as the KV cache
    for name, (ours, xla) in got.items():
        assert ours >= 0.85 * xla, f"{name}: plan {ours / 1e6:.1f} MB under XLA:TPU's {xla / 1e6:.1f} MB"
    # Keeping every layer's activations (remat none) is counted closely on TPU too.
    ours, xla = got["update none"]
    assert ours <= 1.5 * xla, f"update none: plan {ours / 1e6:.1f} MB vs XLA:TPU {xla / 1e6:.1f} MB"
