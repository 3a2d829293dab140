"""HBM bytes per decode step of the sampler's real decode program, compiled for one TPU v5p chip without a TPU.

    python benchmarks/decode_bytes.py                      # Qwen3-0.6B / 1.7B, batch 64 / 256, 768 / 5632 tokens
    python benchmarks/decode_bytes.py --small --paths=paged  # tiny shapes, seconds (CI)
    python benchmarks/decode_bytes.py --verbose --out=decode_bytes.jsonl

What is compiled: the sampler's own decode program (marl_jax.generate.programs.Programs._decode_fn: a jitted
`lax.while_loop` over decode steps, a layer scan inside each), lowered from abstract arguments (bfloat16
weights, compute and KV; sampling at temperature 0.7, top_p 0.95) and compiled by XLA:TPU for one chip of a
v5p:2x2x1 topology (libtpu's compile-only devices: `pip install -e ".[aot]"`). Every path the sampler takes on
TPU: "paged" (a KV budget's paged pool, sized to hold every row's blocks at full context + the null block;
decode attention through jax's Pallas paged-attention kernel, as model.attention=auto picks on TPU) and
"dense" (the default dense cache). The step measured has every row at the full context, so the attention
window is the whole context.

Bytes per step (marl_jax.hlo_bytes over the optimized HLO): one iteration of the decode while loop's body +
condition, the layer scan weighted by its trip count (num_layers), HBM only (XLA:TPU keeps some buffers in
VMEM: their prefetches count, their reads from VMEM do not). The paged-attention kernel's custom call is
handed a layer's whole KV pool but reads each row's live pages only: it counts q, the live pages of K and V at
full context (batch x context x kv_heads x head_dim per layer, each) and its outputs, not the pool.

Minimum per step: every weight once (the tied embedding once: it is also the LM head) + the live KV read
once (batch x context x 2 x layers x kv_heads x head_dim x 2 bytes) + the new KV written (batch x the same
per-token bytes) + the logits (batch x vocab x 4 bytes, written once). ratio = bytes_per_step / minimum.
Prints one line per (model, batch, context, path) with XLA's temporaries (memory_analysis), the step's pure
data movement (copies=: copies, transposes, slices, prefetches) and the bytes the program moves outside the
loop (outside_loop=: once per call, e.g. the cache copied into and out of the loop's layout), the top 5
instructions by bytes under --verbose, then `worst_ratio=<x>` over every line that compiled (a configuration
whose buffers exceed the chip's HBM fails to compile and prints error= instead).

At --small shapes XLA:TPU keeps some weights in VMEM across steps (their HBM reads then happen once per call,
outside the loop), so the small ratio is no estimate of the real one; it checks the pipeline.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from marl_jax import hlo_bytes  # noqa: E402
from marl_jax.models import decoder  # noqa: E402
from marl_jax.models.decoder import ModelConfig  # noqa: E402

MODELS = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B")
BATCHES = (64, 256)
CONTEXTS = ((256, 512), (512, 5120))  # (prompt, new): 768 and 5632 tokens (5120: the paper's completion limit)
PATHS = ("paged", "dense")
# --small: Qwen3-0.6B's widths with 2 layers and a 32k vocabulary: compiles in seconds on a CPU host, and its
# weights (127 MB) and KV (17 MB) are too big for XLA:TPU to keep in on-chip memory across steps, so the ratio
# means what it means at real shapes (a 2048-token vocabulary and 256-wide layers fit VMEM: HBM bytes then fall
# below the "minimum", which reads the weights every step).
SMALL = ModelConfig(family="qwen3", vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_layers=2,
                    num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=True)
SMALL_BATCHES, SMALL_CONTEXTS = (16,), ((256, 256),)
KV_BLOCK = 16
GB = 1e9


def decode_program(cfg: ModelConfig, batch: int, prompt: int, new: int, path: str, device, *,
                   block: int = KV_BLOCK, hbm: float = 0.0):
    """(jitted decode fn, abstract args, meta) of the sampler's decode loop on `device`, each row at the context
    measured. The ONE place that knows the sampler's internals (Sampler.programs.decode_loop, the pool's and
    the cache's shapes, the attention switch): adapt it here when the sampler's API changes.

    The sampler's shapes: prompt and new-token buckets P and Tn (buckets.length_bucket), the dense cache and the
    block tables P + Tn slots wide. "paged": the pool of a KV budget that holds every row at full context, or,
    when that exceeds what the chip holds beside the weights (`hbm` bytes, 80% of it for the pool), the largest
    budget it holds; each row then holds an equal share of it (meta["live_context"]).
    meta["pool_elements"]: elements of the whole K (or V) pool, as the kernel is handed it (None: dense)."""
    from marl_jax.generate import buckets
    from marl_jax.generate.sampler import Sampler
    from marl_jax.generate.types import DecodeState, SamplingParams

    bf = jnp.bfloat16
    context = prompt + new
    P, Tn = buckets.length_bucket(prompt), buckets.length_bucket(new)
    sp = SamplingParams(max_new_tokens=new, temperature=0.7, top_p=0.95, stop_ids=(cfg.vocab_size - 1,))
    params = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.PRNGKey(0), bf))
    weights = sum(int(np.prod(x.shape)) * 2 for x in jax.tree_util.tree_leaves(params))
    meta = {"params": params, "live_context": context}
    z = lambda: jnp.zeros(batch, jnp.int32)
    if path == "paged":
        # On TPU model.attention=auto takes the paged-attention kernel; the compiling host's backend is CPU,
        # where "splash" selects the same kernel (marl_jax.models.attention.choose(..., pool=True)).
        cfg = dataclasses.replace(cfg, attention="splash")
        s = Sampler(cfg, dtype=bf, max_batch=batch, paged=True, kv_block=block, kv_dtype=bf)
        T = buckets.blocks_for(P + Tn, block) * block
        full = buckets.full_pool_blocks(batch, P, Tn, block)
        per_block = s.block_bytes()
        want = 1 + batch * buckets.blocks_for(context, block)  # every row at full context
        fits = int((0.8 * hbm - weights) // per_block) if hbm else want
        N = max(2, min(want, fits, full))
        meta["live_context"] = min(context, (N - 1) // batch * block)
        state = jax.eval_shape(lambda: DecodeState(
            decoder.init_paged(cfg, N, block, batch, T, 1, bf), z(), z(), z(), jnp.zeros(batch, bool),
            jnp.zeros((batch, Tn), jnp.int32), jnp.zeros((batch, Tn), jnp.float32), z(), z()))
        k = state.cache.k
        meta.update(pool_elements=int(np.prod(k.shape)), cache="paged", pool_shape=tuple(k.shape))
        window = T if s.kernel_decode() else buckets.blocks_for(P + Tn, block) * block
    elif path == "dense":
        s = Sampler(cfg, dtype=bf, max_batch=batch, paged=False, kv_dtype=bf)
        # What prefill hands the decode loop: a dense cache of P + Tn slots; at the end of the completions the
        # window is all of it.
        state = jax.eval_shape(lambda: DecodeState(
            decoder.init_cache(cfg, batch, P + Tn, bf), z(), z(), z(), jnp.zeros(batch, bool),
            jnp.zeros((batch, Tn), jnp.int32), jnp.zeros((batch, Tn), jnp.float32), z(), z()))
        meta.update(pool_elements=None, cache="dense", cache_shape=tuple(state.cache.k.shape))
        window = P + Tn
    else:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    fn = jax.jit(s.programs.decode_loop(sp, P, window), donate_argnums=(3,))
    sh = jax.sharding.SingleDeviceSharding(device)
    put = lambda t: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), t)
    i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sh)
    # (params, trainable, slot, state, key, min_active, max_steps): no adapters (the frozen base samples).
    args = (put(params), None, i32, put(state), key, i32, i32)
    return fn, args, meta


def minimum_bytes(cfg: ModelConfig, params, batch: int, context: int) -> dict:
    """The least a decode step at full context must move (see the module docstring)."""
    weights = sum(int(np.prod(x.shape)) * 2 for x in jax.tree_util.tree_leaves(params))  # bfloat16, tied once
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, every layer, bfloat16
    parts = {"weights": weights, "kv_read": batch * context * per_token, "kv_write": batch * per_token,
             "logits": batch * cfg.vocab_size * 4}
    parts["total"] = sum(parts.values())
    return parts


def kernel_hook(cfg: ModelConfig, batch: int, context: int, pool_elements, block: int = KV_BLOCK):
    """custom_call hook for hlo_bytes.analyze: the paged-attention kernel (a tpu_custom_call) is handed the
    whole stacked pool as K and V pages (found by element count, in any view) but reads each row's live pages
    of one layer per call: batch x `context` slots (rounded up to blocks) of kv_heads x head_dim. Its other
    operands (q, lengths, page table) and outputs count as they are; HBM only (a pool operand XLA staged in
    VMEM was read from HBM by the prefetch, which counts on its own)."""
    if pool_elements is None:
        return None
    live = batch * (-(-context // block)) * block * cfg.num_kv_heads * cfg.head_dim
    sizes = (pool_elements, pool_elements // cfg.num_layers)  # the whole pool, or one layer's

    def hook(ins, operands):
        if ins.target != "tpu_custom_call":
            return None
        pools = [a for arrs in operands for a in arrs if int(np.prod(a.dims)) in sizes]
        if not pools:
            return None
        total = 0.0
        for arrs in operands:
            for a in arrs:
                if a.space != 0:
                    continue
                total += live * hlo_bytes.DTYPE_BYTES[a.dtype] if a in pools else a.nbytes
        return total + sum(a.nbytes for a in ins.shape if a.space == 0)
    return hook


def measure(name: str, cfg: ModelConfig, batch: int, prompt: int, new: int, path: str, device,
            verbose: bool = False, hbm: float = 0.0) -> dict:
    context = prompt + new
    rec = {"model": name, "batch": batch, "context": context, "prompt": prompt, "new": new, "path": path}
    t0 = time.perf_counter()
    fn, args, meta = decode_program(cfg, batch, prompt, new, path, device, hbm=hbm)
    live = meta["live_context"]
    rec["live_context"] = live
    try:
        compiled = fn.lower(*args).compile()
    except Exception as e:  # e.g. a pool larger than the chip's HBM: reported, not measured
        rec.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return rec
    rec["compile_s"] = time.perf_counter() - t0
    text = compiled.as_text()
    hook = kernel_hook(cfg, batch, live, meta["pool_elements"])
    r = hlo_bytes.analyze(text, custom_call=hook)
    if r.step is None:
        raise RuntimeError(f"{name} {path}: no loop of unknown trip count (the decode loop) in the compiled program")
    unknown = [lp.name for lp in r.loops if lp.trips is None and lp.name != r.step_loop]
    mn = minimum_bytes(cfg, meta["params"], batch, live)
    ma = compiled.memory_analysis()
    rec.update(bytes_per_step=r.step, minimum=mn["total"], ratio=r.step / mn["total"],
               outside_loop=r.total - r.step,  # per call of the program (entry / exit copies), not per step
               temporaries=float(ma.temp_size_in_bytes), arguments=float(ma.argument_size_in_bytes),
               copy_bytes=r.copy_bytes("step"), minimum_parts={k: v for k, v in mn.items() if k != "total"},
               by_opcode=dict(list(r.by_opcode("step").items())[:8]),
               loops=[(lp.name, lp.trips, lp.source) for lp in r.loops], other_unknown_loops=unknown,
               xla_bytes_accessed=hlo_bytes.cost_analysis_bytes(compiled),
               top=[{"name": x.name, "opcode": x.opcode, "shape": x.shape, "bytes": b, "weight": w, "op": x.op_name}
                    for x, b, w in r.top(5, "step")])
    if verbose:
        rec["report"] = r.format(5)
    return rec


def line(rec: dict) -> str:
    head = f"model={rec['model']} batch={rec['batch']} context={rec['context']} path={rec['path']}"
    if rec.get("live_context", rec["context"]) != rec["context"]:
        head += f" live_context={rec['live_context']}"
    if "error" in rec:
        return f"{head} error={rec['error']!r}"
    return (f"{head} bytes_per_step={rec['bytes_per_step'] / GB:.3f}GB minimum={rec['minimum'] / GB:.3f}GB "
            f"ratio={rec['ratio']:.2f} temporaries={rec['temporaries'] / GB:.3f}GB copies={rec['copy_bytes'] / GB:.3f}GB "
            f"outside_loop={rec['outside_loop'] / GB:.3f}GB compile_s={rec['compile_s']:.0f}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny model shapes: compiles in seconds (CI)")
    p.add_argument("--models", default=",".join(MODELS), help="marl_jax.plan presets (ignored with --small)")
    p.add_argument("--batches", default="", help="comma-separated (default 64,256; --small: 8)")
    p.add_argument("--contexts", default="", help="prompt+new pairs, e.g. 256+512,512+5120 (--small: 64+64)")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--tpu", default="v5p", help="TPU generation compiled for (one chip of a 4-chip slice)")
    p.add_argument("--verbose", action="store_true", help="the top 5 instructions by bytes per line")
    p.add_argument("--out", default="", help="also write one JSON line per measurement here")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    from marl_jax.plan_aot import tpu_devices
    device = tpu_devices(a.tpu, 4)[0]
    from marl_jax.plan import CHIPS
    hbm = 0.0 if a.small else CHIPS[a.tpu].hbm  # the pool: what the chip holds beside the weights
    if a.small:
        models = [("small", SMALL)]
        batches, contexts = SMALL_BATCHES, SMALL_CONTEXTS
    else:
        from marl_jax.plan import model_config
        models = [(m, model_config(m)) for m in a.models.split(",") if m]
        batches, contexts = BATCHES, CONTEXTS
    if a.batches:
        batches = tuple(int(b) for b in a.batches.split(","))
    if a.contexts:
        contexts = tuple(tuple(int(x) for x in c.split("+")) for c in a.contexts.split(","))
    paths = [p for p in a.paths.split(",") if p]
    recs = []
    out = open(a.out, "w") if a.out else None
    for name, cfg in models:
        for batch in batches:
            for prompt, new in contexts:
                for path in paths:
                    rec = measure(name, cfg, batch, prompt, new, path, device, a.verbose, hbm)
                    recs.append(rec)
                    print(line(rec), flush=True)
                    if a.verbose and "report" in rec:
                        print(rec["report"], flush=True)
                    if out:
                        out.write(json.dumps({k: v for k, v in rec.items() if k != "report"}) + "\n")
                        out.flush()
    # The paths the sampler takes on TPU (rollout.paged_kv=auto: marl_jax.generate.buckets.paged_by_default); the
    # others are printed for comparison.
    from marl_jax.generate.buckets import paged_by_default
    taken = "paged" if paged_by_default("tpu") else "dense"
    ratios = [r["ratio"] for r in recs if "ratio" in r and r["path"] == taken]
    if any(r["path"] != taken for r in recs):
        print(f"(worst_ratio over the {taken} path, which rollout.paged_kv=auto takes on TPU)", flush=True)
    print(f"worst_ratio={max(ratios) if ratios else math.nan:.2f}", flush=True)
    if out:
        out.close()
    return recs


if __name__ == "__main__":
    main()
