"""XLA's own numbers for a run's programs, compiled from abstract arrays: `python -m marl_jax.plan --aot`.

Three programs of a training step, built from the project's own functions (nothing is run, no array is
allocated): one update item at the token budget (rl.update's per-row loss terms of one slot's micro-batch and
their VJP: the gradient of that slot's adapters or weights), one prefill chunk (decoder.forward_cached over
`rollout.prefill_chunk` tokens against a cache of the prompt's slots) and one decode step at
`rollout.max_batch` rows over the paged pool of the KV budget's blocks (decoder.forward_cached with a
decoder.init_paged PagedCache). Each is lowered with the run's mesh and shardings and compiled for

  - the local devices (CPU here: what the tests check the planner against at small shapes), or
  - a TPU slice without a TPU: libtpu's compile-only devices from
    jax.experimental.topologies.get_topology_desc (install with `pip install -e ".[aot]"`).

GPUs cannot be compiled for without one: jax's CUDA plugin needs a visible device to create its client.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models import decoder, sharding
from marl_jax.models.decoder import ModelConfig

AOT_INSTALL = 'pip install -e ".[aot]"'
# TPU slice name -> libtpu topology (chips): v4 / v5p names count TensorCores (2 per chip).
TOPOLOGIES = {"v4": ("v4", 3), "v5p": ("v5p", 3), "v5e": ("v5e", 2), "v6e": ("v6e", 2)}


def topology_name(kind: str, chips: int) -> str:
    """'v5p', 4 -> 'v5p:2x2x1'; 'v5e', 8 -> 'v5e:2x4'; 'v6e', 4 -> 'v6e:2x2'."""
    name, dims = TOPOLOGIES[kind]
    if dims == 3:
        shapes = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}
    else:
        shapes = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
    if chips not in shapes:
        raise ValueError(f"no {kind} topology of {chips} chips here; use one of {sorted(shapes)} chips")
    return f"{name}:{shapes[chips]}"


def tpu_topology(name: str):
    """libtpu's compile-only description of a TPU slice ('v5p:2x2x1'; its .devices), or a ValueError saying
    how to install libtpu. Every compile-only TPU device here comes through this (benchmarks too)."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ValueError(f"--aot compiles for a TPU slice with libtpu, which is not installed: {AOT_INSTALL}")
    from jax.experimental import topologies

    from marl_jax.jax_setup import compile_only_libtpu

    with compile_only_libtpu():  # no lock file: runs beside a training run or another --aot
        return topologies.get_topology_desc(topology_name=name, platform="tpu")


def tpu_devices(kind: str, chips: int):
    """Compile-only devices of a TPU slice (libtpu), or a ValueError saying how to install it."""
    return tpu_topology(topology_name(kind, chips)).devices


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fn: Any  # a jitted function
    args: tuple  # abstract arguments (ShapeDtypeStruct with shardings)


def _abstract(tree, shardings):
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _base(cfg, dtype, mesh, rules):
    params = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.PRNGKey(0), dtype))
    return _abstract(params, sharding.tree_shardings(params, mesh, rules))


def _rows(tree, mesh, rules):
    return _abstract(tree, jax.tree_util.tree_map(lambda x: sharding.batch_sharding(x, mesh, 0, rules), tree))


def update_item(cfg: ModelConfig, *, rows: int, T: int, W: int, mesh, rules=None, mode: str = "lora", rank: int = 64,
                remat: str = "full", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, metrics: bool = True) -> Program:
    """One update work item: rows x T tokens of one slot, W scored positions; its loss terms and gradient."""
    from marl_jax.policy.lora import PolicySpec, init_trainable
    from marl_jax.rl.update import UpdateConfig, row_terms

    spec = PolicySpec(mode=mode, rank=rank, alpha=32.0, num_slots=1)
    ucfg = UpdateConfig(micro_batch=rows, remat=remat, dtype=dtype, metrics=metrics)
    base = _base(cfg, param_dtype, mesh, rules)
    one = jax.eval_shape(lambda b: jax.tree_util.tree_map(lambda x: x[0], init_trainable(
        spec, cfg, b, jax.random.PRNGKey(1))), jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                                      base))
    one = _abstract(one, sharding.tree_shardings(one, mesh, rules))
    sd = jax.ShapeDtypeStruct
    r = {"tokens": sd((rows, T), jnp.int32), "valid": sd((rows, T), bool), "win_start": sd((rows,), jnp.int32),
         "targets": sd((rows, W), jnp.int32), "loss_mask": sd((rows, W), jnp.float32),
         "old_logp": sd((rows, W), jnp.float32), "advantages": sd((rows,), jnp.float32),
         "kl_coef": sd((rows,), jnp.float32)}
    r = _rows(r, mesh, rules)
    cot = _rows(sd((rows,), jnp.float32), mesh, rules)

    def item(mine, base, r, cot):
        terms = lambda tr: row_terms(cfg, spec, ucfg, base, tr, r, mesh, rules, norm_len=W, remat=remat)
        nums, vjp, aux = jax.vjp(terms, mine, has_aux=True)
        (g,) = vjp(cot.astype(nums.dtype))
        return jnp.sum(nums), g

    return Program("update item", jax.jit(item), (one, base, r, cot))


def _cache_shardings(cache, mesh, rules):
    axes = type(cache).AXES
    return type(cache)(*(jax.sharding.NamedSharding(mesh, sharding.spec_for(n, x.shape, mesh, rules))
                         for x, n in zip(cache, axes)))


def prefill_chunk(cfg: ModelConfig, *, rows: int, chunk: int, prompt: int, mesh, rules=None, dtype=jnp.bfloat16,
                  param_dtype=jnp.bfloat16) -> Program:
    """One prefill chunk: `rows` distinct prompts' `chunk` tokens written into a cache of `prompt` slots, attending
    to every slot before them (the last chunk of a long prompt: the widest window)."""
    params = _base(cfg, param_dtype, mesh, rules)
    cache = jax.eval_shape(lambda: decoder.init_cache(cfg, rows, prompt, dtype))
    cache = _abstract(cache, _cache_shardings(cache, mesh, rules))
    sd = jax.ShapeDtypeStruct
    toks = _rows({"tokens": sd((rows, chunk), jnp.int32), "positions": sd((rows, chunk), jnp.int32),
                  "valid": sd((rows, chunk), bool)}, mesh, rules)
    start = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh))

    def run(params, cache, t, start):
        return decoder.forward_cached(params, cfg, t["tokens"], t["positions"], cache, start, t["valid"],
                                      dtype=dtype, last_only=True, window=prompt, mesh=mesh, rules=rules)

    return Program("prefill chunk", jax.jit(run, donate_argnums=(1,)), (params, cache, toks, start))


def decode_step(cfg: ModelConfig, *, rows: int, blocks: int, block: int, window: int, mesh, rules=None,
                dtype=jnp.bfloat16, param_dtype=jnp.bfloat16) -> Program:
    """One decode step: `rows` rows, one token each, over a paged pool of `blocks` blocks of `block` slots per
    row shard, attending over `window` slots through their block tables. As the sampler runs it: each row's
    valid slots are a prefix (right_padded=True), so with cfg.attention "splash" (what "auto" resolves to on
    TPU; the compiling host's backend is not the target's) and a bfloat16 pool, attention is jax's Pallas
    paged-attention kernel reading the pool's pages in place (marl_jax.models.attention.paged_decode);
    otherwise the rows' blocks are gathered and attended densely."""
    params = _base(cfg, param_dtype, mesh, rules)
    shards = sharding.row_count(mesh)
    cache = jax.eval_shape(lambda: decoder.init_paged(cfg, blocks, block, rows, window, shards, dtype))
    cache = _abstract(cache, _cache_shardings(cache, mesh, rules))
    sd = jax.ShapeDtypeStruct
    t = _rows({"tokens": sd((rows, 1), jnp.int32), "positions": sd((rows, 1), jnp.int32),
               "write": sd((rows,), jnp.int32), "valid": sd((rows, 1), bool)}, mesh, rules)

    def run(params, cache, t):
        return decoder.forward_cached(params, cfg, t["tokens"], t["positions"], cache, t["write"], t["valid"],
                                      dtype=dtype, window=window, mesh=mesh, rules=rules, right_padded=True)

    return Program("decode step", jax.jit(run, donate_argnums=(1,)), (params, cache, t))


def analyse(program: Program) -> dict[str, float]:
    """Compile (never run) and read XLA's per-device bytes, its cost analysis, and the matmul FLOPs of the
    optimized HLO weighted by loop trip counts (marl_jax.hlo_bytes: `flops` below is cost_analysis's, which
    counts each loop body once). kernels: Pallas kernel executions (tpu_custom_call), whose FLOPs neither sees;
    unknown_loops: loops whose trip count is data (blockwise attention's block-skipping fori_loop), counted once
    in matmul_flops, which is then a lower bound."""
    import time

    from marl_jax import hlo_bytes
    t0 = time.perf_counter()
    compiled = program.fn.lower(*program.args).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
    hlo = hlo_bytes.analyze(compiled.as_text())
    return {"arguments": float(ma.argument_size_in_bytes), "temporaries": float(ma.temp_size_in_bytes),
            "outputs": float(ma.output_size_in_bytes), "aliased": float(getattr(ma, "alias_size_in_bytes", 0)),
            "flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
            "matmul_flops": hlo.flops, "kernels": hlo.custom_calls().get("tpu_custom_call", 0.0),
            "unknown_loops": float(sum(lp.trips is None for lp in hlo.loops)),
            "compile_s": compile_s}


REMATS = ("none", "dots", "full")  # the update's remat modes (rl.update.REMAT_MODES less "auto", which picks one)


def useful_update_flops(cfg: ModelConfig, *, rows: int, T: int, W: int, mode: str = "lora", rank: int = 64,
                        targets=None, attention: bool = True) -> dict[str, float]:
    """Matmul FLOPs one update item needs, nothing recomputed (all devices together): rows x T tokens through
    the layers, the LM head over rows x W scored positions. Per part (forward):

        linear    = 2 rows T L (D (q + 2 kv) + q D + 3 D F)      = rows T (cfg.flops_per_token(0) - 2 D V)
        lora      = 2 rows T L r sum(in + out) over the adapted matrices (mode "lora")
        attention = 2 rows T L 2 q (T + 1) / 2                   (q.k and p.v, causal: query t sees t + 1 keys)
        head      = 2 rows W D V

    and useful = forward + backward: under LoRA the frozen matmuls' input gradients (1x: linear, head), both
    operands of q.k and p.v (2x: attention) and the adapters' input and weight gradients (2x: lora), so
    useful = 2 (linear + head) + 3 (lora + attention); full training adds the weight gradients:
    useful = 3 forward. attention=False leaves the attention core out (a Pallas kernel's FLOPs are not in
    the HLO count it is compared with). Elementwise work (norms, rope, softmax, the loss) is not counted."""
    from marl_jax.models.decoder import LINEAR_NAMES
    from marl_jax.policy.lora import _io
    D, L, V = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    tokens = rows * T
    linear = tokens * (cfg.flops_per_token(0) - 2.0 * D * V)
    lora = 0.0
    if mode == "lora":
        lora = 2.0 * tokens * L * rank * sum(sum(_io(cfg, n)) for n in (targets or LINEAR_NAMES))
    attn = 2.0 * tokens * L * 2 * cfg.q_dim * (T + 1) / 2 if attention else 0.0
    head = 2.0 * rows * W * D * V
    forward = linear + lora + attn + head
    useful = 3 * forward if mode == "full" else 2 * (linear + head) + 3 * (lora + attn)
    return {"linear": linear, "lora": lora, "attention": attn, "head": head, "forward": forward, "useful": useful}


# ---- the plan's programs at a run's shapes, beside the plan's own numbers ----

def run_shapes(cfg: ModelConfig, config, w, knobs) -> dict[str, dict]:
    """Shapes of the three programs for a run (global rows) and the plan's per-device numbers for them."""
    from marl_jax import plan as P
    from marl_jax.generate.buckets import length_bucket
    m = knobs.mesh
    e = P._bytes(config.model.dtype)
    T, W = w.seq_len, w.window
    rows = P.item_rows(knobs, T)
    rows = -(-rows // m.rows) * m.rows
    st = max(w.stages, key=lambda s: s.prompt)
    Pl, Tn = length_bucket(st.prompt), length_bucket(st.new)
    mbt = knobs.max_batched_tokens
    chunk = min(int(config.rollout.get("prefill_chunk", 2048)), mbt or Pl, Pl)
    from marl_jax.config import paged_kv
    paged = paged_kv(config, knobs.backend) or knobs.kv_budget_gb > 0
    bu = P.prefill_rows(cfg, config, st, m, knobs.max_batch, knobs.kv_budget_gb, mbt, paged)[0] * m.rows
    blk = int(config.rollout.get("kv_block", 16))
    window = -(-(Pl + Tn) // blk) * blk
    B = -(-min(max(s.rows for s in w.stages), knobs.max_batch) // m.rows) * m.rows
    if knobs.kv_budget_gb:
        blocks = int(knobs.kv_budget_gb * P.GiB // (blk * P.slot_bytes(cfg, config, m)))
    else:
        blocks = 1 + (B // m.rows) * (window // blk)
    pr = cfg.num_params()
    return {
        "update item": dict(rows=rows, T=T, W=W, plan_temporaries=P.activation_bytes(cfg, config, w, knobs),
                            plan_flops=rows * T * cfg.flops_per_token(T // 2) * (4 if knobs.remat == "full" else 3) / m.size),
        "prefill chunk": dict(rows=bu, chunk=chunk, prompt=Pl,
                              plan_temporaries=P.prefill_chunk_bytes(cfg, bu / m.rows, chunk, Pl, e, m, knobs.backend),
                              plan_cache=bu / m.rows * Pl * P.slot_bytes(cfg, config, m),
                              plan_flops=bu * chunk * cfg.flops_per_token(Pl) / m.size),
        "decode step": dict(rows=B, blocks=blocks, block=blk, window=window,
                            plan_temporaries=P.decode_step_bytes(cfg, B / m.rows, window, e, m, knobs.backend,
                                                                 blocks * blk),
                            plan_flops=B * cfg.flops_per_token(window) / m.size),
        "_": dict(params=pr),
    }


def _dtypes(config):
    from marl_jax import plan as P
    dt = jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32
    return dt, jnp.bfloat16 if P.param_dtype(config) == "bfloat16" else jnp.float32


def update_program(cfg: ModelConfig, config, shapes: dict, mesh, rules=None, backend: str = "tpu") -> Program:
    """The update item at `shapes` (run_shapes, with "remat"; default full), attention resolved on `backend`."""
    import dataclasses as dc
    from marl_jax.rl.memory import attention_impl
    dt, pdt = _dtypes(config)
    u = shapes["update item"]
    ucfg = dc.replace(cfg, attention=attention_impl(cfg, u["T"], u["T"], backend))
    return update_item(ucfg, rows=u["rows"], T=u["T"], W=u["W"], mesh=mesh, rules=rules, mode=config.trainable.mode,
                       rank=int(config.trainable.rank), remat=shapes.get("remat", "full"), dtype=dt, param_dtype=pdt)


def programs_for(cfg: ModelConfig, config, shapes: dict, mesh, rules=None, backend: str = "tpu") -> list[Program]:
    """The three programs at `shapes` (run_shapes) on `mesh`. model.attention=auto resolves as on `backend`
    (the compiling host's jax.default_backend() is not the target's)."""
    import dataclasses as dc
    from marl_jax.rl.memory import attention_impl
    dt, pdt = _dtypes(config)
    pf, d = shapes["prefill chunk"], shapes["decode step"]
    pcfg = dc.replace(cfg, attention=attention_impl(cfg, pf["chunk"], pf["prompt"], "cpu"))
    # Decode over the paged pool: on TPU the paged-attention kernel ("splash" selects it on any compiling host),
    # elsewhere the gathered blocks attended densely.
    dcfg = dc.replace(cfg, attention="splash" if backend == "tpu" else "dense")
    return [update_program(cfg, config, shapes, mesh, rules, backend),
            prefill_chunk(pcfg, rows=pf["rows"], chunk=pf["chunk"], prompt=pf["prompt"], mesh=mesh, rules=rules,
                          dtype=dt, param_dtype=pdt),
            decode_step(dcfg, rows=d["rows"], blocks=d["blocks"], block=d["block"],
                        window=d["window"], mesh=mesh, rules=rules, dtype=dt, param_dtype=pdt)]


def aot(config, chip_spec: str, knobs=None, prompt_tokens: int | None = None, layers: int = 0,
        remats: tuple = REMATS) -> dict[str, Any]:
    """Compile the run's three programs for a TPU slice (libtpu, no TPU needed) with the plan's knobs (the
    configured ones, or those it prints when they do not fit), and return XLA's numbers beside the plan's.
    layers > 0 compiles a model of that many layers (and plans the same model), to save compile time.
    remats: the update item is compiled again at each of these remat modes (the knobs' own is reused) for its
    matmul FLOPs against the useful ones and its temporaries (out["update_by_remat"]); () compiles it once."""
    import dataclasses as dc
    from marl_jax import plan as P
    chip, n = P.parse_chip(chip_spec)
    if chip.kind != "tpu":
        raise ValueError(f"--aot compiles for TPU slices only: a GPU ({chip_spec}) cannot be compiled for without "
                         "one (jax's CUDA plugin needs a visible device)")
    kind = next(k for k, c in P.CHIPS.items() if c is chip)
    devices = tpu_devices(kind, n)
    cfg = P.model_config(config.model.name)
    if layers:
        cfg = dc.replace(cfg, num_layers=layers)
    prompt_tokens = prompt_tokens or int(config.rollout.get("prompt_tokens", 512))  # as P.plan reads it
    w = P.workload(config, prompt_tokens)
    if knobs is None:
        p = P.plan(config, chip_spec, prompt_tokens, search_chips=False)
        knobs = P.configured_knobs(config, P.config_mesh(config, n), chip)
        if not p["fits"] and p["smallest_fit"]:
            f = p["smallest_fit"]
            knobs = dc.replace(knobs, mesh=P.Mesh(*map(int, f["mesh"].split("x"))), micro_batch=f["micro_batch"],
                               remat=f["remat"], max_batch=f["max_batch"], kv_budget_gb=f["kv_budget_gb"],
                               max_tokens=f["max_tokens_per_micro_batch"],
                               max_batched_tokens=f["max_batched_tokens"])
    if knobs.remat == "auto":
        knobs = dc.replace(knobs, remat="full")
    m = knobs.mesh
    mesh = sharding.make_mesh(m.data, m.model, devices=np.asarray(devices), fsdp=m.fsdp)
    rules = sharding.parse_rules(config.mesh.get("rules", sharding.DEFAULT_RULES))
    shapes = run_shapes(cfg, config, w, knobs)
    shapes["remat"] = knobs.remat
    out = {"chip": chip_spec, "devices": n, "mesh": str(m), "layers": cfg.num_layers, "knobs": P.knob_flags(knobs, config),
           "programs": {}}
    for prog in programs_for(cfg, config, shapes, mesh, rules, "tpu"):
        x = analyse(prog)
        out["programs"][prog.name] = dict(shapes[prog.name], **{f"xla_{k}": v for k, v in x.items()})
    if remats:
        out["update_by_remat"] = update_by_remat(cfg, config, w, knobs, shapes, mesh, rules,
                                                 out["programs"]["update item"], remats)
    return out


def _out_of_memory(e: Exception) -> float | None:
    """The temporaries (bytes) XLA:TPU said a program needs when it refused to compile it for lack of HBM."""
    import re
    msg = str(e)
    if "RESOURCE_EXHAUSTED" not in msg and "Ran out of memory" not in msg:
        return None
    m = re.search(r"HLO temporaries \(([\d.]+)G\)", msg)
    return float(m.group(1)) * 2 ** 30 if m else math.nan


def update_by_remat(cfg: ModelConfig, config, w, knobs, shapes: dict, mesh, rules, done: dict,
                    remats: tuple = REMATS) -> dict[str, dict]:
    """The update item at each remat mode (the knobs' own from `done`, aot's entry for it): XLA:TPU's
    matmul FLOPs per device (trip-weighted), the useful ones (useful_update_flops / devices; the attention
    core left out where it runs in a Pallas kernel), their ratio (the recompute overhead), and XLA's and
    the plan's temporaries. A mode whose item does not fit the chip's HBM (XLA:TPU refuses to compile it) is
    compiled again at one row per row shard for its FLOPs (every term is linear in rows, so the ratio holds);
    its `fits` is False and xla_temporaries is what XLA said it needs at the run's rows."""
    import dataclasses as dc
    from marl_jax import plan as P
    u = shapes["update item"]
    n, few = knobs.mesh.size, knobs.mesh.rows
    out = {}
    for r in remats:
        rows, need = u["rows"], None
        if r == shapes.get("remat", "full"):
            x = {k[4:]: v for k, v in done.items() if k.startswith("xla_")}
        else:
            try:
                x = analyse(update_program(cfg, config, dict(shapes, remat=r), mesh, rules, "tpu"))
            except Exception as e:  # noqa: BLE001 (jax's JaxRuntimeError: only running out of HBM is handled)
                need = _out_of_memory(e)
                if need is None or rows <= few:
                    raise
                rows = few
                x = analyse(update_program(cfg, config, dict(shapes, remat=r, **{"update item": dict(u, rows=rows)}),
                                           mesh, rules, "tpu"))
        useful = useful_update_flops(cfg, rows=rows, T=u["T"], W=u["W"], mode=config.trainable.mode,
                                     rank=int(config.trainable.rank), attention=not x["kernels"])["useful"] / n
        out[r] = {"rows": rows, "fits": need is None, "xla_matmul_flops": x["matmul_flops"], "useful_flops": useful,
                  "ratio": x["matmul_flops"] / useful,
                  "xla_temporaries": x["temporaries"] if need is None else need,
                  "plan_temporaries": P.activation_bytes(cfg, config, w, dc.replace(knobs, remat=r)),
                  "attention_in_kernel": bool(x["kernels"]), "kernels": x["kernels"],
                  "unknown_loops": x["unknown_loops"],
                  "compile_s": x["compile_s"]}
    return out


def _tflop(flops: float, unknown_loops: float | None = 0) -> str:
    return f"{'>= ' if unknown_loops else ''}{flops / 1e12:.2f}"


def format_aot(r: dict[str, Any]) -> str:
    G = 2 ** 30
    lines = [f"XLA for {r['chip']} ({r['devices']} devices, mesh {r['mesh']}, {r['layers']} layers), compiled "
             f"without a TPU; knobs: {r['knobs']}", "",
             "| program | shape | XLA arguments GiB | XLA temporaries GiB | plan temporaries GiB | XLA outputs GiB | "
             "XLA matmul TFLOP | plan TFLOP | compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, p in r["programs"].items():
        shape = {"update item": lambda: f"{p['rows']} x {p['T']} tokens, {p['W']} scored",
                 "prefill chunk": lambda: f"{p['rows']} x {p['chunk']} against {p['prompt']}",
                 "decode step": lambda: f"{p['rows']} rows, {p['blocks']} blocks of {p['block']}, window {p['window']}"}[name]()
        lines.append(f"| {name} | {shape} | {p['xla_arguments'] / G:.2f} | {p['xla_temporaries'] / G:.2f} | "
                     f"{p['plan_temporaries'] / G:.2f} | {p['xla_outputs'] / G:.2f} | "
                     f"{_tflop(p['xla_matmul_flops'], p.get('xla_unknown_loops'))} | {p['plan_flops'] / 1e12:.2f} | "
                     f"{p['xla_compile_s']:.0f} |")
    lines.append("(per device; XLA matmul TFLOP: the dots and convolutions of the optimized HLO, loops weighted by "
                 "their trip counts (marl_jax.hlo_bytes), no elementwise work and no Pallas kernel's (splash, paged "
                 "attention), >= where a loop's trip count is data (counted once); the plan's are every matmul, "
                 "attention included, remat full's recompute a whole forward; --json has XLA's cost_analysis as "
                 "xla_flops, each loop body once)")
    by = r.get("update_by_remat")
    if by:
        p = r["programs"]["update item"]
        kernel = any(x["attention_in_kernel"] for x in by.values())
        lines += ["", f"update item ({p['rows']} x {p['T']} tokens, {p['W']} scored) by remat, per device:", "",
                  "| remat | rows compiled | XLA:TPU matmul TFLOP | useful TFLOP | ratio | Pallas kernel runs | "
                  "XLA temporaries GiB | plan temporaries GiB | compile s |", "|---|---|---|---|---|---|---|---|---|"]
        small = False
        for mode, x in by.items():
            small = small or x["rows"] != p["rows"]
            tmp = f"{x['xla_temporaries'] / G:.2f}" + ("" if x["fits"] else " (does not fit)")
            lines.append(f"| {mode} | {x['rows']} | {_tflop(x['xla_matmul_flops'], x.get('unknown_loops'))} | "
                         f"{x['useful_flops'] / 1e12:.2f} | {x['ratio']:.3f} | {x.get('kernels', 0):.0f} | {tmp} | "
                         f"{x['plan_temporaries'] / G:.2f} | {x['compile_s']:.0f} |")
        lines.append("(useful: forward + backward with nothing recomputed, plan_aot.useful_update_flops: LoRA "
                     "2 x (linear + head) + 3 x (adapters + attention), full training 3 x forward"
                     + ("; the attention core runs in a Pallas kernel (splash: its runs, trip-weighted, say what "
                        "is recomputed), so it is in neither count" if kernel else "")
                     + "; ratio: XLA over useful, the recompute"
                     + ("; a mode that does not fit (XLA:TPU refuses it; its temporaries: what XLA asked for at the "
                        "run's rows) is compiled at one row per row shard for its FLOPs and ratio" if small else "")
                     + ")")
    return "\n".join(lines)
