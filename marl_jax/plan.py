"""Will a config fit a chip and mesh, and how long will a training step take? Answered on paper.

    python -m marl_jax.plan --config=configs/voting.py:qwen3-4b,math --chip=v5e-8
    python -m marl_jax.plan --config=configs/orch_workers.py:qwen3-1.7b,math --chip=H200 --json
    python -m marl_jax.plan --config=configs/voting.py:qwen3-4b,math --chip=v5p-8 --config.mesh.model=2

The same --config.<key>=<value> overrides as launch/run.py. Per device it counts the bytes of the
base weights, the trainable weights, their gradients, the optimizer state, the rollout's KV cache and
the update's activations under each remat mode and micro-batch, says whether the step fits, searches
the smallest sharding / micro-batch / remat that does, and gives a roofline estimate of the rollout
and update time of one training step.

What is counted is what the code allocates (the memory model is checked against XLA's own memory
analysis in tests/test_plan.py):
  - base weights are held in config.model.param_dtype (auto: bfloat16 for a bfloat16 checkpoint such as
    the Qwen3 presets, float32 otherwise; see param_dtype) and are cast to config.model.dtype inside each
    matmul; the KV cache and activations are in config.model.dtype;
  - trainable weights, gradients and AdamW's two moments are float32, one set per policy slot;
    with per-role diagnostics the update also holds one gradient accumulator per diagnostic group;
  - the mesh is (data, fsdp, model): weights are split over fsdp and model where the dimension
    divides (LoRA adapters are replicated), rows over data * fsdp, heads and MLP columns over model.
Sequence lengths are worst cases: every row runs to its max_new_tokens, and a stage's prompt holds
--prompt_tokens plus every earlier stage's completions (a synthesizer reads all workers).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import types
from typing import Any, Iterable

from marl_jax.models.decoder import ModelConfig

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm: float  # bytes per chip
    bf16_flops: float  # dense bf16 FLOP/s per chip
    hbm_bw: float  # bytes/s per chip
    per_host: int  # chips attached to one host
    kind: str  # "tpu" | "gpu"
    cores_per_chip: int = 1  # TPU slice names count TensorCores for v4 / v5p (2 per chip)


# Per-chip numbers from the vendors' pages:
#   v4: cloud.google.com/tpu/docs/v4 (32 GiB HBM2, 275 TFLOP/s bf16, 1200 GB/s, 4 chips per host;
#       v4-8 = 4 chips / 8 TensorCores)
#   v5e: cloud.google.com/tpu/docs/v5e (16 GiB HBM2, 197 TFLOP/s bf16, 819 GB/s; v5litepod-8 = 8 chips, one host)
#   v5p: cloud.google.com/tpu/docs/v5p (95 GiB HBM2e, 459 TFLOP/s bf16, 2765 GB/s, 4 chips per host;
#       v5p-8 = 4 chips / 8 TensorCores)
#   v6e: cloud.google.com/tpu/docs/v6e (32 GiB HBM, 918 TFLOP/s bf16, 1640 GB/s; v6e-8 = 8 chips, one host)
#   H100-80GB: nvidia.com/en-us/data-center/h100 (SXM: 80 GB HBM3, 989 TFLOP/s dense bf16, 3.35 TB/s)
#   H200: nvidia.com/en-us/data-center/h200 (SXM: 141 GB HBM3e, 989 TFLOP/s dense bf16, 4.8 TB/s)
CHIPS = {
    "v4": Chip("TPU v4", 32 * GiB, 275e12, 1200e9, 4, "tpu", cores_per_chip=2),
    "v5e": Chip("TPU v5e", 16 * GiB, 197e12, 819e9, 8, "tpu"),
    "v5p": Chip("TPU v5p", 95 * GiB, 459e12, 2765e9, 4, "tpu", cores_per_chip=2),
    "v6e": Chip("TPU v6e", 32 * GiB, 918e12, 1640e9, 8, "tpu"),
    "H100-80GB": Chip("NVIDIA H100 SXM 80GB", 80e9, 989e12, 3.35e12, 8, "gpu"),
    "H200": Chip("NVIDIA H200 SXM", 141e9, 989e12, 4.8e12, 8, "gpu"),
}
# Share of HBM a program may plan to use: the runtime, XLA's scratch and fragmentation take the rest
# (on GPUs set XLA_PYTHON_CLIENT_MEM_FRACTION=.95; JAX preallocates 75% by default).
USABLE = 0.9


def parse_chip(spec: str) -> tuple[Chip, int]:
    """'v5e-8' -> (v5e, 8 chips); 'v4-16' -> (v4, 8 chips: v4/v5p names count TensorCores);
    'H200' -> (H200, 1); 'H100-80GBx8' -> (H100-80GB, 8)."""
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", spec)
    if m:
        chip = CHIPS[m.group(1)]
        n = int(m.group(2))
        if n % chip.cores_per_chip:
            raise ValueError(f"--chip={spec}: {m.group(1)} slice names count TensorCores ({chip.cores_per_chip} "
                             "per chip), so the number must be even (v4-8, v4-16, ...)")
        return chip, n // chip.cores_per_chip
    m = re.fullmatch(r"(H100-80GB|H200)(?:x(\d+))?", spec)
    if m:
        return CHIPS[m.group(1)], int(m.group(2) or 1)
    raise ValueError(f"unknown --chip={spec!r}; use a TPU slice (v4-8, v5e-8, v5p-8, v6e-8, v5e-16, ...) or a GPU "
                     "(H100-80GB, H200; 'H200x8' for 8 of them)")


def _qwen3(hidden, inter, layers, heads, tie):
    return ModelConfig(family="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1e6, tie_word_embeddings=tie, qk_norm=True, max_position_embeddings=40960)


# Shapes from each model's public config.json (no hub is contacted here).
PRESET_MODELS = {
    "Qwen/Qwen3-0.6B": _qwen3(1024, 3072, 28, 16, True),
    "Qwen/Qwen3-1.7B": _qwen3(2048, 6144, 28, 16, True),
    "Qwen/Qwen3-4B": _qwen3(2560, 9728, 36, 32, False),
    "smollm2-135m-instruct": ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                         rope_theta=1e5, tie_word_embeddings=True),
}


# Stored dtype of each preset's checkpoint: the public Qwen3 safetensors are bfloat16, the embedded model is
# a GGUF the loader dequantizes to float32.
PRESET_STORAGE = {"Qwen/Qwen3-0.6B": "bfloat16", "Qwen/Qwen3-1.7B": "bfloat16", "Qwen/Qwen3-4B": "bfloat16",
                  "smollm2-135m-instruct": "float32"}


@functools.lru_cache(maxsize=None)
def _stored_dtype(name: str) -> str:
    """What model.param_dtype=auto holds a model in: a preset's, or a local folder's from its safetensors
    headers (config.json's torch_dtype when it has no weights); float32 for anything else."""
    if name in PRESET_STORAGE:
        return PRESET_STORAGE[name]
    from marl_jax.models import hf
    folder = os.path.expanduser(name)
    try:
        return hf.resolve_param_dtype("auto", hf.storage_dtypes(folder).values()).name
    except (FileNotFoundError, NotADirectoryError, ValueError):
        pass
    try:
        with open(os.path.join(folder, "config.json")) as f:
            meta = json.load(f)
        return "bfloat16" if (meta.get("torch_dtype") or meta.get("dtype")) == "bfloat16" else "float32"
    except (OSError, ValueError):
        return "float32"


def param_dtype(config) -> str:
    """The dtype the loader holds the base weights in: model.param_dtype, auto resolved as the loader does."""
    want = config.model.get("param_dtype", "auto")
    return _stored_dtype(config.model.name) if want == "auto" else want


def model_config(name: str) -> ModelConfig:
    """A preset's shapes, or a local Hugging Face folder's config.json."""
    if name in PRESET_MODELS:
        return PRESET_MODELS[name]
    path = os.path.join(os.path.expanduser(name), "config.json")
    if os.path.isfile(path):
        from marl_jax.models.decoder import config_from_hf
        with open(path) as f:
            return config_from_hf(json.load(f))
    raise ValueError(f"--config.model.name={name!r} is neither a preset ({', '.join(PRESET_MODELS)}) nor a "
                     "folder holding config.json; point it at a Hugging Face checkpoint folder")


# ---------------------------------------------------------------------------------------------
# What one training step runs


@dataclasses.dataclass(frozen=True)
class Stage:
    role: str
    rows: int  # sampler rows = tasks * episodes * calls
    distinct: int  # distinct prompts (identical prompts are prefilled once)
    prompt: int  # tokens, worst case
    new: int  # max new tokens


@dataclasses.dataclass(frozen=True)
class Workload:
    stages: tuple[Stage, ...]
    roles: tuple[str, ...]
    role_slot: dict
    num_slots: int
    num_groups: int
    max_batch: int

    @property
    def seq_len(self) -> int:  # the update's T (longest row, bucketed as rl.batch does)
        from marl_jax.generate.sampler import length_bucket
        return length_bucket(max(s.prompt + s.new for s in self.stages), minimum=64)

    @property
    def window(self) -> int:  # the update's W (scored positions)
        from marl_jax.generate.sampler import length_bucket
        return length_bucket(max(s.new for s in self.stages), minimum=16)

    def slot_rows(self) -> list[int]:
        out = [0] * self.num_slots
        for s in self.stages:
            out[self.role_slot[s.role]] += s.rows
        return out


def workload(config, prompt_tokens: int = 512) -> Workload:
    from marl_jax.policy.slots import role_to_slot
    from marl_jax.workflows import make_workflow

    wf = make_workflow(config.workflow, **dict(config.workflow_options))
    stages_ = wf.plan([types.SimpleNamespace(kind=config.task.kind)])
    mapping = role_to_slot(tuple(wf.roles), config.policy)
    n_ep = config.num_tasks * config.rollout.group_size
    out, earlier = [], 0
    for st in stages_:
        new = int(config.rollout.max_new_tokens.get(st.role, 256))
        rows = n_ep * st.max_calls
        # The first stage's G episodes (and parallel calls) share one prompt; later prompts differ.
        distinct = config.num_tasks if not out else rows
        out.append(Stage(st.role, rows, distinct, prompt_tokens + earlier, new))
        earlier += st.max_calls * new
    copies = {}
    if config.grpo.copy_alignment:
        from marl_jax.train.loop import parallel_copies
        copies = parallel_copies(wf)
    groups = sum(copies.get(r, 1) for r in wf.roles) if config.grpo.diagnostics else 0
    return Workload(tuple(out), tuple(wf.roles), mapping, max(mapping.values()) + 1, groups, config.rollout.max_batch)


# ---------------------------------------------------------------------------------------------
# Bytes per device


@dataclasses.dataclass(frozen=True)
class Mesh:
    data: int = 1
    fsdp: int = 1
    model: int = 1

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.model

    @property
    def rows(self) -> int:  # devices rows are split over
        return self.data * self.fsdp

    def __str__(self):
        return f"{self.data}x{self.fsdp}x{self.model}"


def _div(n: int, k: int) -> int:
    """Mesh axis k splits a dimension n only when it divides it (as marl_jax.models.sharding does)."""
    return k if k > 1 and n % k == 0 else 1


def param_leaves(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape without the layer axis, times) of every parameter, as decoder.init_params lays them out."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    out = [("embed", (V, D), 1), ("final_norm", (D,), 1)]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head", (D, V), 1))
    for name, shape in (("attn_norm", (D,)), ("mlp_norm", (D,)), ("wq", (D, cfg.q_dim)), ("wk", (D, cfg.kv_dim)),
                        ("wv", (D, cfg.kv_dim)), ("wo", (cfg.q_dim, D)), ("w_gate", (D, F)), ("w_up", (D, F)),
                        ("w_down", (F, D))):
        out.append((name, shape, L))
    if cfg.qkv_bias:
        out += [("bq", (cfg.q_dim,), L), ("bk", (cfg.kv_dim,), L), ("bv", (cfg.kv_dim,), L)]
    if cfg.qk_norm:
        out += [("q_norm", (cfg.head_dim,), L), ("k_norm", (cfg.head_dim,), L)]
    return out


# Which axis of a matrix "model" splits (the other one goes to "fsdp"); vectors are replicated.
_MODEL_AXIS = {"embed": 0, "lm_head": 1, "wq": 1, "wk": 1, "wv": 1, "wo": 0, "w_gate": 1, "w_up": 1, "w_down": 0}


def sharded_param_count(cfg: ModelConfig, mesh: Mesh) -> float:
    """Parameters held by one device."""
    total = 0.0
    for name, shape, times in param_leaves(cfg):
        n = math.prod(shape) * times
        if name in _MODEL_AXIS and len(shape) == 2:
            ax = _MODEL_AXIS[name]
            n /= _div(shape[ax], mesh.model) * _div(shape[1 - ax], mesh.fsdp)
        total += n
    return total


def lora_params(cfg: ModelConfig, rank: int, targets: Iterable[str]) -> int:
    """Adapter parameters of one slot (A [in, r] and B [r, out] per target matrix per layer)."""
    from marl_jax.policy.lora import _io
    return sum(cfg.num_layers * rank * sum(_io(cfg, t)) for t in targets)


def _bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


@dataclasses.dataclass(frozen=True)
class Knobs:
    mesh: Mesh
    micro_batch: int
    remat: str
    max_batch: int  # rows per sampler call (rollout.max_batch): bounds the KV cache


def static_bytes(cfg: ModelConfig, config, w: Workload, mesh: Mesh) -> dict[str, float]:
    """Weights, trainable weights, gradients and optimizer state per device."""
    from marl_jax.policy.lora import parse_targets
    base = sharded_param_count(cfg, mesh) * _bytes(param_dtype(config))  # as the loader holds them
    if config.trainable.mode == "lora":
        from marl_jax.policy.lora import _ALIASES
        targets = [_ALIASES.get(t, t) for t in parse_targets(config.trainable.targets)]
        slot = lora_params(cfg, config.trainable.rank, targets) * 4.0  # replicated
    else:
        slot = sharded_param_count(cfg, mesh) * 4.0
    S, G = w.num_slots, w.num_groups
    # The update's gradient buffers: one accumulator per diagnostic group (+ the per-slot sums and the
    # per-role sums the diagnostics compare), or one per slot without diagnostics; plus optax's updates.
    K = len(w.roles)
    grads = slot * ((G + S + K) if G else 2 * S)
    return {"base_weights": base, "trainable": slot * S, "gradients": grads, "optimizer": 2 * slot * S}


def paged_pool_blocks(rows: int, distinct: int, P: int, Tn: int, block: int) -> tuple[int, int]:
    """Paged KV pool of one row shard when every row runs to its limit: (blocks at the end, blocks before
    the last growth), replaying the sampler's rule (Sampler._empty_paged / _ensure_blocks): a first pool for
    the prompts and a block of growth per row, then 1.5x steps, never beyond a dense cache of the rows.
    The rows hold at most the distinct prompts' whole blocks once plus, each, its own part of the prompt's
    last block and its completion's blocks (+1 for the null block)."""
    from marl_jax.generate.sampler import _batch_bucket, paged_first_pool
    full = 1 + rows * -(-(P + Tn) // block)
    whole, per = P // block, -(-P // block)
    need = min(full, 1 + min(distinct, rows) * whole + rows * (per - whole + -(-Tn // block) + 1))
    N = prev = paged_first_pool(rows, min(distinct, rows), P, Tn, block)
    while N < need:  # a decode step takes at most one block per row, so each growth is by N // 2
        prev, N = N, min(_batch_bucket(N + max(N // 2, 1), 16), full)
    return N, prev


def kv_bytes(cfg: ModelConfig, config, w: Workload, mesh: Mesh, max_batch: int) -> tuple[float, float, int]:
    """(KV cache bytes, prefill transient bytes, batch) per device for the largest sampler call.

    Dense: every row holds prompt + max new tokens. Paged (rollout.paged_kv): the pool when every row runs to
    its limit, plus the pool before its last growth, which lives until the grown copy exists; a task's
    episodes share their prompt's blocks. When rows stop early (RL's long tail) the pool stays smaller:
    this is the bound, not the typical use."""
    from marl_jax.generate.sampler import _batch_bucket, length_bucket
    e = _bytes(config.model.dtype)
    kv_heads = cfg.num_kv_heads // _div(cfg.num_kv_heads, mesh.model)
    q_heads = cfg.num_heads // _div(cfg.num_heads, mesh.model)
    paged = bool(config.rollout.get("paged_kv", False))
    blk = int(config.rollout.get("kv_block", 16))
    worst_kv, worst_pre, worst_b = 0.0, 0.0, 0
    for st in w.stages:
        B = _batch_bucket(min(st.rows, max_batch), 8, mesh.rows)
        Bu = _batch_bucket(min(st.distinct, max_batch), 8, mesh.rows)
        P, Tn = length_bucket(st.prompt), length_bucket(st.new)
        b, bu = B / mesh.rows, Bu / mesh.rows
        slot_bytes = 2 * cfg.num_layers * kv_heads * cfg.head_dim * e  # keys and values of one slot
        kv = b * (P + Tn) * slot_bytes
        window = kv  # what a decode step's attention reads per layer (all layers' worth)
        if paged:
            distinct = math.ceil(min(st.distinct, B) / mesh.rows)
            N, prev = paged_pool_blocks(int(b), distinct, P, Tn, blk)
            kv = (N + (prev if prev < N else 0)) * blk * slot_bytes
        # Prefill, before rows are expanded to their episodes: the distinct prompts' cache (paged: prompt
        # slots only), one layer's attention scores over the prompt (float32, and their probabilities) and
        # its residual stream (coefficients from XLA's memory analysis of the prefill program, tests/test_plan.py).
        pre = (2 * cfg.num_layers * bu * kv_heads * cfg.head_dim * (P + (0 if paged else Tn)) * e
               + bu * q_heads * P * P * (4 + 0.7 * e) + bu * P * cfg.hidden_size * e)
        # A decode step holds one layer's keys and values over the attention window (about 1.5 copies,
        # from XLA's memory analysis; paged: the gathered blocks) and the float32 logits with their softmax.
        step = 1.5 * window / cfg.num_layers + b * cfg.vocab_size * 4 * 2
        if kv + step + pre > worst_kv + worst_pre:
            worst_kv, worst_pre, worst_b = kv + step, pre, B
    return worst_kv, worst_pre, worst_b


def activation_bytes(cfg: ModelConfig, config, w: Workload, knobs: Knobs, T: int | None = None,
                     W: int | None = None) -> float:
    """Temporaries of one update work item (one micro-batch of one slot) per device."""
    T = T or w.seq_len
    W = W or w.window
    e = _bytes(config.model.dtype)
    m = knobs.mesh
    b = math.ceil(knobs.micro_batch / m.rows)
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    hq = cfg.num_heads // _div(cfg.num_heads, m.model)
    qd, kvd = hq * cfg.head_dim, cfg.kv_dim // _div(cfg.num_kv_heads, m.model)
    f = F // _div(F, m.model)
    r = config.trainable.rank if config.trainable.mode == "lora" else 0
    tok = b * T
    # One layer, everything kept (per token): the residual stream, norms and their float32 statistics
    # (8 D wide), q before / after norm and rope and the attention output (6 q wide), k and v (5 kv
    # wide), the MLP's gate, up, sigmoid, silu and product (5 F wide), LoRA's x @ A (7, rank wide,
    # float32); and per query-key pair the float32 scores and the probabilities. Coefficients counted
    # from the decoder and checked against XLA's memory analysis (tests/test_plan.py).
    layer_vectors = tok * (8 * D + 6 * qd + 5 * kvd + 5 * f) * e + tok * 7 * r * 4
    layer_attn = b * hq * T * T * (4 + e)
    layer = layer_vectors + layer_attn
    if knobs.remat == "none":
        # Every layer's activations, plus about one layer's cotangents in the backward pass.
        saved = (L + 0.75) * layer
    elif knobs.remat == "dots":
        # The weight matmuls' outputs are kept (with LoRA, the adapter's too), the rest is recomputed one
        # layer at a time; that layer's attention and its cotangent are the transient.
        dots = tok * (2 * D + qd + 2 * kvd + 2 * f) * e * (2 if r else 1) + tok * 7 * r * 4
        saved = L * dots + 0.25 * layer_vectors + 2 * layer_attn
    else:
        # Each layer's input (and its cotangent), plus one layer recomputed with its attention cotangent.
        saved = L * 2 * tok * D * e + layer_vectors + 1.5 * layer_attn
    # The scored window's logits in float32, their softmax and its cotangent.
    logits = 3 * b * W * V * 4 / _div(V, m.model)  # the vocabulary is split over "model"
    return saved + logits


def batch_bytes(w: Workload, micro_batch: int, mesh: Mesh) -> float:
    """The update's input arrays per device ([S, R, T] tokens and mask, [S, R, W] targets / mask / logp)."""
    from marl_jax.rl.batch import rows_bucket
    R = rows_bucket(max(w.slot_rows()), micro_batch)
    return w.num_slots * R * (w.seq_len * 5 + w.window * 12 + 20) / mesh.rows


def memory(cfg: ModelConfig, config, w: Workload, knobs: Knobs) -> dict[str, float]:
    st = static_bytes(cfg, config, w, knobs.mesh)
    kv, prefill, B = kv_bytes(cfg, config, w, knobs.mesh, knobs.max_batch)
    act = activation_bytes(cfg, config, w, knobs)
    held = st["base_weights"] + st["trainable"] + st["optimizer"]
    out = dict(st, kv_cache=kv, prefill_transient=prefill, sampler_batch=B, activations=act,
               update_batch=batch_bytes(w, knobs.micro_batch, knobs.mesh))
    out["rollout_peak"] = held + kv + prefill
    out["update_peak"] = held + st["gradients"] + act + out["update_batch"]
    out["peak"] = max(out["rollout_peak"], out["update_peak"])
    return out


# ---------------------------------------------------------------------------------------------
# Roofline time of one training step


def roofline(cfg: ModelConfig, config, w: Workload, knobs: Knobs, chip: Chip) -> dict[str, float]:
    """Seconds: decode (HBM bound: weights + live KV read per step), prefill and update (FLOP bound)."""
    from marl_jax.generate.sampler import length_bucket
    m = knobs.mesh
    n = m.size
    e = _bytes(config.model.dtype)
    N = cfg.num_params()
    lora = config.trainable.mode == "lora"
    kv_tok = 2 * cfg.num_layers * cfg.kv_dim * e  # KV bytes per cached token
    decode = prefill = 0.0
    for st in w.stages:
        chunks = math.ceil(st.rows / knobs.max_batch)
        B = min(st.rows, knobs.max_batch)
        P, Tn = length_bucket(st.prompt), length_bucket(st.new)
        # Every decode step reads the weights each device holds after the fsdp gather (in param_dtype, cast
        # in the matmul) and the live cache (prompt + half the new tokens on average), rows split over data * fsdp.
        per_step = N * _bytes(param_dtype(config)) / m.model + B / m.rows * (P + Tn / 2) * kv_tok / _div(cfg.num_kv_heads, m.model)
        flops = 2 * B / n * cfg.flops_per_token(P + Tn // 2) / 2
        decode += chunks * Tn * max(per_step / chip.hbm_bw, flops / chip.bf16_flops)
        prefill += st.distinct * st.prompt * cfg.flops_per_token(st.prompt // 2) / (n * chip.bf16_flops)
    tokens = sum(st.rows * (st.prompt + st.new) for st in w.stages)
    ctx = w.seq_len // 2
    fwd = tokens * cfg.flops_per_token(ctx)
    # Backward: input gradients (2x forward) and, for full training, weight gradients (another 2x forward
    # of the linear layers); LoRA's adapter gradients are small.
    bwd = 2 * fwd + (0 if lora else 2 * tokens * 2 * N)
    attn_fwd = tokens * 2 * 2 * cfg.num_layers * cfg.q_dim * ctx
    recompute = {"none": 0.0, "dots": attn_fwd, "full": fwd}[knobs.remat]
    update = (fwd + bwd + recompute) / (n * chip.bf16_flops)
    return {"decode_s": decode, "prefill_s": prefill, "update_s": update, "update_flops": fwd + bwd + recompute,
            "step_s": decode + prefill + update}


# ---------------------------------------------------------------------------------------------
# Search


def meshes(n: int) -> list[Mesh]:
    """Every (data, fsdp, model) with data * fsdp * model = n."""
    out = []
    for model in range(1, n + 1):
        if n % model:
            continue
        for fsdp in range(1, n // model + 1):
            if (n // model) % fsdp == 0:
                out.append(Mesh(n // model // fsdp, fsdp, model))
    return out


def config_mesh(config, n: int) -> Mesh:
    mc = config.mesh
    model, fsdp = int(mc.get("model", 1)), int(mc.get("fsdp", 1))
    data = int(mc.get("data", -1))
    if data == -1:
        if n % (model * fsdp):
            raise ValueError(f"mesh fsdp={fsdp} x model={model} does not divide the {n} devices; "
                             "set --config.mesh.fsdp / --config.mesh.model to divisors of the device count")
        data = n // (model * fsdp)
    if data * fsdp * model != n:
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x model={model} needs {data * fsdp * model} devices, "
                         f"the chip slice has {n}; set --config.mesh.data=-1")
    return Mesh(data, fsdp, model)


REMATS = ("none", "dots", "full")


def smallest_fit(cfg, config, w, chip: Chip, n: int) -> Knobs | None:
    """On n chips: the least sharding (fewest fsdp * model devices) under which some settings fit, with
    the largest sampler batch, then the largest micro-batch and the least remat that fit."""
    limit = USABLE * chip.hbm
    mbs = sorted({int(config.grpo.micro_batch) >> i for i in range(12)} - {0}, reverse=True)
    batches = sorted({int(config.rollout.max_batch) >> i for i in range(12)} - {0}, reverse=True)
    for mesh in sorted(meshes(n), key=lambda m: (m.fsdp * m.model, m.model)):
        probe = Knobs(mesh, mbs[0], "full", batches[0])
        mb_remat = next(((mb, r) for mb in mbs for r in REMATS
                         if memory(cfg, config, w, dataclasses.replace(probe, micro_batch=mb, remat=r))["update_peak"]
                         <= limit), None)
        mx = next((B for B in batches
                   if memory(cfg, config, w, dataclasses.replace(probe, max_batch=B))["rollout_peak"] <= limit), None)
        if mb_remat and mx:
            return Knobs(mesh, mb_remat[0], mb_remat[1], mx)
    return None


def plan(config, chip_spec: str, prompt_tokens: int = 512) -> dict[str, Any]:
    chip, n = parse_chip(chip_spec)
    cfg = model_config(config.model.name)
    w = workload(config, prompt_tokens)
    mesh = config_mesh(config, n)
    knobs = Knobs(mesh, int(config.grpo.micro_batch), str(config.grpo.remat), int(config.rollout.max_batch))
    mem = memory(cfg, config, w, knobs)
    limit = USABLE * chip.hbm
    mbs = sorted({1, 2, 4, 8, 16, int(config.grpo.micro_batch)})
    table = {r: {mb: memory(cfg, config, w, dataclasses.replace(knobs, micro_batch=mb, remat=r))["update_peak"]
                 for mb in mbs} for r in REMATS}
    fit = smallest_fit(cfg, config, w, chip, n)
    fewest = next((k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if smallest_fit(cfg, config, w, chip, k)), None)
    return {
        "chip": chip_spec, "chip_name": chip.name, "devices": n, "hosts": math.ceil(n / chip.per_host),
        "hbm_per_device": chip.hbm, "usable_per_device": limit,
        "model": config.model.name, "params": cfg.num_params(), "dtype": config.model.dtype,
        "param_dtype": param_dtype(config),
        "workflow": config.workflow, "policy": config.policy, "slots": w.num_slots,
        "trainable": config.trainable.mode + (f" r{config.trainable.rank}" if config.trainable.mode == "lora" else ""),
        "stages": [dataclasses.asdict(s) for s in w.stages], "seq_len": w.seq_len, "window": w.window,
        "kv_layout": (f"paged, {int(config.rollout.kv_block)}-slot blocks" if config.rollout.get("paged_kv", False)
                      else "dense"),
        "mesh": str(mesh), "micro_batch": knobs.micro_batch, "remat": knobs.remat, "max_batch": knobs.max_batch,
        "memory": mem, "fits": mem["peak"] <= limit,
        "update_peak_by_remat_and_micro_batch": table,
        "smallest_fit": None if fit is None else {"mesh": str(fit.mesh), "micro_batch": fit.micro_batch,
                                                  "remat": fit.remat, "max_batch": fit.max_batch,
                                                  "time": roofline(cfg, config, w, fit, chip)},
        "fewest_chips": fewest,
        "time": roofline(cfg, config, w, knobs, chip),
    }


def _gb(x: float) -> str:
    return f"{x / GiB:8.2f}"


def format_plan(p: dict[str, Any]) -> str:
    m = p["memory"]
    lines = [
        f"{p['workflow']} / {p['policy']} on {p['model']} ({p['params'] / 1e9:.2f}B params, {p['dtype']} compute, "
        f"{p.get('param_dtype', 'float32')} base weights, "
        f"{p['trainable']}, {p['slots']} slot(s))",
        f"chip {p['chip']}: {p['devices']} x {p['chip_name']} on {p['hosts']} host(s), "
        f"{p['hbm_per_device'] / GiB:.1f} GiB HBM each (plan to {p['usable_per_device'] / GiB:.1f} GiB)",
        f"mesh (data x fsdp x model) {p['mesh']}, micro-batch {p['micro_batch']}, remat {p['remat']}, "
        f"update rows of {p['seq_len']} tokens ({p['window']} scored)",
        "stages (worst case: every row runs to its limit): " + "; ".join(
            f"{s['role']} {s['rows']} rows, prompt {s['prompt']} + {s['new']}" for s in p["stages"]),
        "",
        f"KV cache: {p['kv_layout']}" + (" (worst case: the pool when every row runs to its limit, plus the pool "
                                         "before its last growth; a task's episodes share prompt blocks)"
                                         if p["kv_layout"] != "dense" else ""),
        "",
        "| per device | GiB |",
        "|---|---|",
    ]
    for k in ("base_weights", "trainable", "gradients", "optimizer", "kv_cache", "prefill_transient",
              "activations", "update_batch", "rollout_peak", "update_peak"):
        lines.append(f"| {k} | {_gb(m[k]).strip()} |")
    lines.append(f"| **peak** | **{_gb(m['peak']).strip()}** ({'fits' if p['fits'] else 'does NOT fit'}) |")
    lines += ["", "update peak (GiB) by remat and micro-batch:", "",
              "| remat | " + " | ".join(f"mb {mb}" for mb in next(iter(p["update_peak_by_remat_and_micro_batch"].values())))
              + " |", "|---" * (1 + len(next(iter(p["update_peak_by_remat_and_micro_batch"].values())))) + "|"]
    for remat, row in p["update_peak_by_remat_and_micro_batch"].items():
        lines.append(f"| {remat} | " + " | ".join(_gb(v).strip() for v in row.values()) + " |")
    f = p["smallest_fit"]
    lines += ["", "smallest that fits on this slice: " + (
        f"--config.mesh (data x fsdp x model) {f['mesh']} --config.grpo.micro_batch={f['micro_batch']} "
        f"--config.grpo.remat={f['remat']} --config.rollout.max_batch={f['max_batch']}" if f
        else "nothing: use more chips"),
        f"fewest chips of this kind that hold it: {p['fewest_chips'] or 'more than 256'}", ""]

    def t_line(name, t):
        return (f"roofline per training step, {name}: decode {t['decode_s']:.1f} s + prefill {t['prefill_s']:.1f} s + "
                f"update {t['update_s']:.1f} s = {t['step_s']:.1f} s")
    lines.append(t_line("as configured", p["time"]))
    if f:
        lines.append(t_line("smallest fit", f["time"]))
    lines.append("(lower bounds: perfect overlap, no compilation or host work, every row at its limit)")
    return "\n".join(lines)


def main(argv):
    from absl import app
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    from marl_jax.config import validate
    config = FLAGS.config
    try:
        validate(config)
        p = plan(config, FLAGS.chip, FLAGS.prompt_tokens)
    except ValueError as e:
        raise app.UsageError(str(e))
    print(json.dumps(p, indent=1, default=str) if FLAGS.json else format_plan(p))


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "configs/<workflow>.py[:<model>,<task>]", lock_config=True)
    flags.DEFINE_string("chip", "v5e-8", "v4-8 | v5e-8 | v5p-8 | v6e-8 (any slice size) | H100-80GB | H200 "
                        "(xN for N GPUs)")
    flags.DEFINE_integer("prompt_tokens", 512, "prompt tokens before any earlier stage's output (system prompt, "
                         "instructions and the problem)")
    flags.DEFINE_bool("json", False, "print JSON instead of tables")
    FLAGS = flags.FLAGS
    flags.mark_flag_as_required("config")
    app.run(main)
