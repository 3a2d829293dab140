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


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_update_item_matmul_flops_on_cpu(mode):
    """XLA:CPU's matmul FLOPs of an update item (dense attention, nothing recomputed), trip-weighted over the layer
    scan (marl_jax.hlo_bytes), equal plan_aot.useful_update_flops exactly once dense attention's extra work is
    added: it scores every key, not the causal (T + 1) / 2 (3 x the attention at T keys for (T + 1) / 2)."""
    cfg = dataclasses.replace(CFG, attention="dense")
    rows, T, W = 2, 128, 32
    a = A.analyse(A.update_item(cfg, rows=rows, T=T, W=W, mesh=_cpu_mesh(), mode=mode, rank=16, remat="none",
                                dtype=f32, param_dtype=f32))
    u = A.useful_update_flops(cfg, rows=rows, T=T, W=W, mode=mode, rank=16)
    no_attn = A.useful_update_flops(cfg, rows=rows, T=T, W=W, mode=mode, rank=16, attention=False)["useful"]
    assert a["unknown_loops"] == 0 and a["kernels"] == 0
    assert a["matmul_flops"] == pytest.approx(no_attn + 3 * u["attention"] * 2 * T / (T + 1), rel=1e-9)
    assert u["useful"] == pytest.approx(3 * u["forward"] if mode == "full" else
                                        2 * (u["linear"] + u["head"]) + 3 * (u["lora"] + u["attention"]))
    # XLA's cost analysis counts the layer scans' bodies once (1 of 3 layers; its elementwise FLOPs besides).
    assert a["flops"] < 0.5 * a["matmul_flops"]


def test_format_aot_prints_flops_by_remat():
    """The --aot table without compiling: matmul FLOPs per program (">=" where a loop's trip count is data) and the
    update item by remat, a mode XLA:TPU refused marked, with the rows it was compiled at."""
    prog = lambda **kw: dict(xla_arguments=2 ** 30, xla_temporaries=2 ** 30, plan_temporaries=2 ** 30, xla_outputs=0,
                             xla_matmul_flops=2e12, plan_flops=3e12, xla_compile_s=5, **kw)
    mode = lambda rows, fits, fl: dict(rows=rows, fits=fits, xla_matmul_flops=fl, useful_flops=1e12 * rows / 8,
                                       ratio=fl / (1e12 * rows / 8), kernels=3, xla_temporaries=2 ** 31,
                                       plan_temporaries=2 ** 31, attention_in_kernel=True, unknown_loops=0, compile_s=9)
    r = {"chip": "v5p-8", "devices": 4, "mesh": "4x1x1", "layers": 2, "knobs": "",
         "programs": {"update item": prog(rows=8, T=64, W=16),
                      "prefill chunk": prog(rows=4, chunk=16, prompt=32, xla_unknown_loops=2.0),
                      "decode step": prog(rows=8, blocks=4, block=16, window=32)},
         "update_by_remat": {"none": mode(4, False, 0.5e12), "full": mode(8, True, 1.4e12)}}
    out = A.format_aot(r)
    assert "| update item | 8 x 64 tokens, 16 scored | 1.00 | 1.00 | 1.00 | 0.00 | 2.00 | 3.00 | 5 |" in out
    assert "| prefill chunk | 4 x 16 against 32 | 1.00 | 1.00 | 1.00 | 0.00 | >= 2.00 |" in out
    assert "| none | 4 | 0.50 | 0.50 | 1.000 | 3 | 2.00 (does not fit) | 2.00 | 9 |" in out
    assert "| full | 8 | 1.40 | 1.00 | 1.400 | 3 | 2.00 | 2.00 | 9 |" in out
    assert "compiled at one row per row shard" in out
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (140.88G) "
           "exceeds available HBM (95.74G).")
    assert A._out_of_memory(RuntimeError(msg)) == pytest.approx(140.88 * 2 ** 30)
    assert A._out_of_memory(RuntimeError("INVALID_ARGUMENT: something else")) is None


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
    """v5p:2x2x1 (4 compile-only chips), rows over the data axis, bfloat16: the plan's terms for TPU within 15%
    of XLA:TPU's temporaries (v5e and v6e keep up to ~100 MiB of a small program's temporaries in VMEM, out
    of XLA's HBM count: docs/planner.md).

    The prefill chunk's and decode step's TPU terms (backend="tpu") were read from the buffers live at XLA:TPU's
    peak (buffer assignment and live ranges, XLA_FLAGS=--xla_dump_to) at other shapes than these: prefill 1 row
    x 2048 tokens against 8192 and 16384 slots (hidden 512 and 2048, 8 KV heads), and Qwen3-1.7B's real shapes
    (docs/planner.md); decode 16 and 64 rows per device over 600-4000 blocks (2 and 8 KV heads), 128 rows over
    3000 blocks with 1, 2 and 4 KV heads.
    The update item's terms are XLA:CPU's (the same on TPU), looked at on TPU at 2 rows x 2048 tokens (3, 8 and
    16 layers), 4 x 1024 (4 layers) and 3 x 1536 (8 heads). Checked here: the update item at 2 rows x 3072
    tokens per device (W 256, 3 layers, splash attention), remat none and full, and its matmul FLOPs over the
    useful ones at remat none, dots and full; a prefill chunk of 2 rows x 1024
    tokens against 16384 slots (blockwise, 8 KV heads as Qwen3); a decode step of 128 rows per device over 3000
    blocks (8 KV heads) through the Pallas paged-attention kernel, as the sampler runs it (right_padded)."""
    devices = A.tpu_devices("v5p", 4)
    mesh = sharding.make_mesh(4, 1, devices=devices)
    m = P.Mesh(4)
    bf = jnp.bfloat16
    cfg = dataclasses.replace(CFG, num_heads=4, num_kv_heads=2, head_dim=128, hidden_size=512, intermediate_size=1024)
    kv8 = dataclasses.replace(cfg, num_heads=16, num_kv_heads=8)  # Qwen3's 8 KV heads
    got, ratio = {}, {}
    ucfg = dataclasses.replace(cfg, attention="splash")
    useful = A.useful_update_flops(ucfg, rows=8, T=3072, W=256, rank=16, attention=False)["useful"] / 4
    for remat in ("none", "dots", "full"):
        a = A.analyse(A.update_item(ucfg, rows=8, T=3072, W=256, mesh=mesh, rank=16, remat=remat, dtype=bf,
                                    param_dtype=bf))
        assert a["kernels"] > 0 and a["unknown_loops"] == 0  # splash: the attention core is a Pallas kernel
        ratio[remat] = a["matmul_flops"] / useful
        if remat != "dots":  # its temporaries are under-counted on XLA:TPU (docs/planner.md)
            got[f"update {remat}"] = (M.activation_bytes(ucfg, rows=2, T=3072, W=256, remat=remat, e=2, rank=16,
                                                         impl="splash"), a["temporaries"])
    # XLA:TPU's matmul FLOPs (trip-weighted) over the useful ones (attention core left out: in the kernel): remat
    # none recomputes nothing (the LM head is not chunked at this vocabulary), dots keeps every matmul's output,
    # full recomputes each layer's forward but its MLP's down projection, whose output the backward pass
    # does not use.
    print("matmul FLOPs / useful by remat: " + ", ".join(f"{k} {v:.3f}" for k, v in ratio.items()))
    assert 1.0 <= ratio["none"] <= 1.02 and ratio["none"] <= ratio["dots"] <= ratio["none"] + 0.02
    assert 1.3 <= ratio["full"] <= 1.45
    a = A.analyse(A.prefill_chunk(dataclasses.replace(kv8, attention="blockwise"), rows=8, chunk=1024, prompt=16384,
                                  mesh=mesh, dtype=bf, param_dtype=bf))
    got["prefill"] = (P.prefill_chunk_bytes(kv8, 2, 1024, 16384, 2, m, "tpu"), a["temporaries"])
    prog = A.decode_step(dataclasses.replace(kv8, attention="splash"), rows=512, blocks=3000, block=16, window=1024,
                         mesh=mesh, dtype=bf, param_dtype=bf)
    assert "paged_attention" in prog.fn.lower(*prog.args).as_text()  # the kernel, not a gathered window
    a = A.analyse(prog)
    got["decode"] = (P.decode_step_bytes(kv8, 128, 1024, 2, m, "tpu", 3000 * 16), a["temporaries"])
    pool = 2 * kv8.num_layers * 3000 * 16 * kv8.kv_dim * 2  # per device: 3000 blocks of its row shard
    assert pool <= a["arguments"] <= pool * 1.15 + 16 * 2 ** 20  # the pool the plan counts as the KV cache
    for name, (ours, xla) in got.items():
        print(f"{name}: plan {ours / 1e6:.1f} MB, XLA:TPU {xla / 1e6:.1f} MB ({ours / xla - 1:+.1%})")
    for name, (ours, xla) in got.items():
        _close(ours, xla, what=f"{name} (XLA:TPU)")
