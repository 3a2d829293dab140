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
    matmul; activations are in config.model.dtype, the KV cache in rollout.kv_dtype (auto: the same);
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

import numpy as np

from marl_jax.models.decoder import ModelConfig
from marl_jax.config import kv_dtype, paged_kv

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
    name: str = ""  # the workflow's stage


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
        from marl_jax.generate.buckets import length_bucket
        return length_bucket(max(s.prompt + s.new for s in self.stages), minimum=64)

    @property
    def window(self) -> int:  # the update's W (scored positions)
        from marl_jax.generate.buckets import length_bucket
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
        out.append(Stage(st.role, rows, distinct, prompt_tokens + earlier, new, st.name))
        earlier += st.max_calls * new
    copies = {}
    if config.grpo.copy_alignment:
        from marl_jax.workflows.base import parallel_copies
        copies = parallel_copies(wf)
    groups = sum(copies.get(r, 1) for r in wf.roles) if config.grpo.diagnostics else 0
    return Workload(tuple(out), tuple(wf.roles), mapping, max(mapping.values()) + 1, groups, config.rollout.max_batch)


def call_shapes(config) -> dict[str, tuple[str, Any]]:
    """Each stage's sampler call as the run's compiled shapes size it (generate.types.CallShape: its rows,
    distinct prompts and longest prompt at the config's rollout.prompt_tokens), with its role: stage -> (role,
    shape). The sampler pads a call up to it and Sampler.warmup compiles its programs before the first step."""
    from marl_jax.generate.types import CallShape

    w = workload(config, int(config.rollout.get("prompt_tokens", 512)))
    return {s.name: (s.role, CallShape(s.rows, s.distinct, s.prompt)) for s in w.stages}


def sampler_shapes(config, backend: str = "cpu") -> list[dict[str, Any]]:
    """Per stage, the sampler's compiled shapes at its CallShape on `backend` (what Sampler.warmup compiles): the
    prompt region P, the new-token bucket, the first batch and every batch size compaction reaches, the
    attention windows, the cached regions of prefills loading prefix-cache hits, paged without a KV budget the
    pool's one size in blocks (0: a dense cache) and, over rollout.max_batch, the refill chunk's rows and its
    prefills' distinct prompts (0 and []: no refill), from the sampler's own rules (generate.buckets, its
    scheduler's config, the attention choice)."""
    import jax.numpy as jnp

    from marl_jax.generate import buckets
    from marl_jax.generate.sampler import Sampler
    from marl_jax.generate.scheduler import SchedulerConfig
    from marl_jax.models import attention

    r = config.rollout
    sc = SchedulerConfig(max_batch=int(r.max_batch), per_octave=int(r.compaction_buckets))
    paged = paged_kv(config, backend) and not float(r.get("kv_budget_gb", 0.0))
    blk = int(r.get("kv_block", 16)) if paged else 0
    kernel = paged and attention.choose(config.model.get("attention", "auto"), 1, 1, backend=backend,
                                        dtype=jnp.dtype(kv_dtype(config)), pool=True) == "paged"
    out = []
    for stage, (role, shape) in call_shapes(config).items():
        P, Tn = Sampler.prompt_region(shape), buckets.length_bucket(int(r.max_new_tokens.get(role, 256)))
        B = sc.first_batch(shape.rows)
        out.append({"stage": stage, "role": role, "prompt_slots": P, "new_slots": Tn, "batch": B,
                    "distinct": buckets.batch_bucket(min(shape.distinct, B)),
                    "batch_sizes": buckets.compaction_sizes(B, sc.min_batch, 1, sc.per_octave),
                    "windows": list(buckets.call_windows(P, Tn, blk, kernel)),
                    "cached_regions": list(buckets.cached_regions(P, buckets.PREFIX_BLOCK)),
                    "pool_blocks": buckets.shape_pool_blocks(B, shape.distinct, P, Tn, blk) if paged else 0,
                    # over max_batch, refills in chunks of refill_rows, their distinct prompts at these sizes
                    "refill_rows": buckets.refill_rows(B) if shape.rows > B else 0,
                    "refill_distinct": buckets.refill_distinct_sizes(buckets.refill_rows(B)) if shape.rows > B else []})
    return out


def update_lengths(config) -> tuple[int, int]:
    """The update's T (every row padded to it) and W (scored positions) for a run: the workload's longest row and
    completion at the config's rollout.prompt_tokens, bucketed (rl.batch.make_batch's seq_len and width)."""
    w = workload(config, int(config.rollout.get("prompt_tokens", 512)))
    return w.seq_len, w.window


def update_shapes(config, knobs: "Knobs | None" = None) -> list:
    """The update item shapes a run compiles (rl.layout.update_shapes at update_lengths), with the knobs' micro-batch
    and token budget (default: the config's); on one device (knobs' mesh) packed items run their LM head on their
    scored positions alone, as the trainer does."""
    from marl_jax.rl import layout
    from marl_jax.rl.update import UpdateConfig
    T, W = update_lengths(config)
    g = config.grpo
    mb, budget = int(g.micro_batch), int(g.get("max_tokens_per_micro_batch", 0))
    one_device = True
    if knobs is not None:
        mb, budget, one_device = knobs.micro_batch, knobs.max_tokens, knobs.mesh.size == 1
    return layout.update_shapes(T, W, micro_batch=mb, length_buckets=UpdateConfig.length_buckets, grid=int(g.length_grid), packing=bool(g.packing),
                                max_tokens=budget, head_over_rows=not (g.packing and one_device),
                                share=bool(g.packing) and int(g.share_prefix) > 0)


def format_shapes(shapes) -> str:
    """'8 x Packed(1, 256), ...' in one line: an item's rows and its shape."""
    from marl_jax.rl.layout import Packed
    one = lambda k: (f"{k.rows} rows in {k.shape.p} x {k.shape.t}" if isinstance(k.shape, Packed)
                     else f"{k.rows} x {k.shape.t}")
    return ", ".join(one(k) for k in shapes)


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
    max_batch: int  # rows decoding at once (rollout.max_batch, vLLM's max_num_seqs)
    kv_budget_gb: float = 0.0  # rollout.kv_budget_gb: the paged pool per device (0: dense / paged bound)
    max_tokens: int = 0  # grpo.max_tokens_per_micro_batch (0: micro_batch rows per item)
    backend: str = "cpu"  # the chip's kind (cpu | tpu | gpu): what model.attention=auto resolves on, and on "tpu"
    # the prefill chunk's and decode step's temporaries as XLA:TPU holds them
    max_batched_tokens: int = 0  # rollout.max_batched_tokens: prompt tokens one refill prefills (0: no cap)


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


def _heads(cfg: ModelConfig, mesh: Mesh) -> tuple[int, int, int]:
    """(query heads, kv width, query width) one device holds under the model axis."""
    hq = cfg.num_heads // _div(cfg.num_heads, mesh.model)
    return hq, cfg.kv_dim // _div(cfg.num_kv_heads, mesh.model), hq * cfg.head_dim


def slot_bytes(cfg: ModelConfig, config, mesh: Mesh) -> float:
    """Keys and values of one cache slot, all layers, on one device."""
    return 2 * cfg.num_layers * _heads(cfg, mesh)[1] * _bytes(kv_dtype(config))  # rollout.kv_dtype


def layer_weight_bytes(cfg: ModelConfig, e: int, mesh: Mesh = Mesh()) -> float:
    """One layer's weights in the compute dtype as the layer loop holds them (gathered over fsdp, split over model)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    _, kvd, qd = _heads(cfg, mesh)
    f = F // _div(F, mesh.model)
    return (D * (2 * qd + 2 * kvd) + 3 * D * f) * e


def prefill_chunk_bytes(cfg: ModelConfig, rows: float, chunk: int, prompt: int, e: int, mesh: Mesh = Mesh(),
                        backend: str = "cpu") -> float:
    """Temporaries of one prefill chunk on one device: `rows` prompts' `chunk` tokens against `prompt` cache slots
    (the last chunk: the widest window). Dense attention when the chunk's scores are small, otherwise blockwise
    (the kernels cannot express a chunk against a cache): linear in the prompt. backend "cpu" (and GPUs): counted
    from XLA:CPU's memory analysis of decoder.forward_cached (tests/test_plan.py); "tpu": from the buffers live
    at XLA:TPU's peak (tests/test_plan_aot.py)."""
    from marl_jax.rl.memory import attention_impl
    hq, kvd, qd = _heads(cfg, mesh)
    c = min(chunk, prompt)
    dense = attention_impl(cfg, c, prompt, "cpu") == "dense"
    if backend == "tpu":
        # The layer's window of the cache, three copies: its keys read back from the cache ([B, H, hd, T]),
        # then keys and values laid out in the attention's blocks; the chunk's queries in float32 and its
        # keys and values (bfloat16, written and blocked); the last position's float32 logits and softmax.
        out = 3 * rows * prompt * kvd * e + rows * c * (4 * qd + 4 * kvd * e) + rows * cfg.vocab_size * 8
        if dense:
            out += rows * hq * c * prompt * (4 + e)  # scores, probabilities
        return out
    # The chunk's activations, the layer's window of keys and values read back (and laid out for attention),
    # the last position's logits.
    out = (rows * c * (3.5 * cfg.hidden_size + 2 * qd + 2 * kvd) * e + 2.5 * rows * prompt * kvd * e
           + rows * cfg.vocab_size * 8 + 0.75 * layer_weight_bytes(cfg, e, mesh))
    if dense:
        out += rows * hq * c * prompt * (4 + e) + rows * c * prompt  # scores, probabilities, mask
    return out


def decode_step_bytes(cfg: ModelConfig, rows: float, window: int, e: int, mesh: Mesh = Mesh(), backend: str = "cpu",
                      pool_slots: int = 0) -> float:
    """Temporaries of one decode step on one device. backend "cpu" (and GPUs), or a dense cache: a layer's keys
    and values over the window (gathered from the pool's blocks, or sliced from the dense cache), the scores,
    and the float32 logits and their softmax.

    backend "tpu" over a paged pool (`pool_slots` > 0, bfloat16): decode runs jax's Pallas paged-attention kernel
    (marl_jax.models.attention.paged_decode) over the whole stacked pool, viewed as the kernel's pages for free,
    so nothing of the pool's size is materialised: XLA:TPU holds the float32 logits and the queries and
    outputs around the kernel per row, and a fraction of a layer's weights staged in VMEM-sized buffers. Read
    from XLA for v5p at 32 and 128 rows per device over 3000 blocks (hidden 512, 2048 vocabulary): 8 KV heads
    1.79 / 2.91 MB, 2 heads 0.79 / 1.77, 1 head 0.72 / 1.80; this term is within 1% at 8 heads and over-counts
    by up to 30% with fewer (tests/test_plan_aot.py). Small beside the pool either way."""
    hq, kvd, _ = _heads(cfg, mesh)
    if backend == "tpu" and pool_slots and e == 2:
        return rows * (cfg.vocab_size * 4 + hq * cfg.head_dim * 2) + 0.15 * layer_weight_bytes(cfg, e, mesh)
    return rows * (2 * window * kvd * e + hq * window * (4 + e) + cfg.vocab_size * 4 * 2) + 0.75 * layer_weight_bytes(
        cfg, e, mesh)


def budget_concurrency(cfg: ModelConfig, config, st: "Stage", mesh: Mesh, max_batch: int, budget_gb: float,
                       block: int) -> dict[str, int]:
    """Under a KV budget: rows of a stage decoding at once (all their blocks in the pool, every row at its
    limit), rows admitted on their prompt blocks alone (vLLM admits on the prompt), and the slots one row
    reaches before the pool runs dry with all of those admitted (preemption's worst case). The pool's size is
    the sampler's rule (marl_jax.generate.buckets.budget_pool_blocks)."""
    from marl_jax.generate import buckets
    P, Tn = buckets.length_bucket(st.prompt), buckets.length_bucket(st.new)
    full = buckets.blocks_for(P + Tn, block)
    rows = buckets.batch_bucket(min(st.rows, max_batch), 8, mesh.rows) // mesh.rows
    blocks = buckets.budget_pool_blocks(int(budget_gb * GiB), int(block * slot_bytes(cfg, config, mesh)),
                                        buckets.full_pool_blocks(rows, P, Tn, block)) - 1  # block 0: the null block
    fit = max(0, blocks // full) * mesh.rows
    want = min(st.rows, max_batch)
    admitted = min(want, max(0, blocks // max(1, buckets.blocks_for(P, block))) * mesh.rows)
    dry = (blocks * mesh.rows * block) // max(1, admitted) - P if admitted else 0
    return {"concurrent": min(want, fit), "admitted": admitted, "slots_at_preemption": max(0, min(dry, P + Tn)),
            "blocks": blocks, "row_blocks": full}


class _FirstRefill:
    """The rows prefill_rows drives the sampler's scheduler over: an empty batch of B rows (the paged pool's
    tables empty) that records what the first refill admits."""

    def __init__(self, B: int, width: int):
        from marl_jax.generate.scheduler import View
        z = np.zeros(B, np.int64)
        self._view = View(np.zeros(B, bool), z + 1, z, z - 1, np.zeros((B, width), np.int32))
        self.admitted: list[int] = []

    def view(self):
        return self._view

    def admit(self, rows, slots):
        self.admitted = list(rows)


def prefill_rows(cfg: ModelConfig, config, st: "Stage", mesh: Mesh, max_batch: int, budget_gb: float = 0.0,
                 max_batched_tokens: int = 0, paged: bool = False) -> tuple[int, int]:
    """(distinct prompts, rows) on one device of the largest prefill the sampler runs for a stage.

    The sampler's prefill builds a dense cache of the distinct prompts, then one of every row it prefills: the
    rows one refill admits, decided here by the sampler's own scheduler (marl_jax.generate.scheduler) over the
    stage's first batch of worst-case prompts: no more than the free rows, max_batched_tokens' prompt tokens
    and, under a KV budget, the rows whose prompt blocks fit the pool beside the watermark (a task's episodes
    share their prompt's blocks; the batch's first rows go to the first shard, so the refill stops there when
    its blocks run out). Dense, the first rows are prefilled straight into the decode batch."""
    from marl_jax.generate import buckets
    from marl_jax.generate.block_pool import BlockPool
    from marl_jax.generate.scheduler import Scheduler, SchedulerConfig
    D = mesh.rows
    sc = SchedulerConfig(max_batch=max_batch, min_batch=max(8, D), shards=D, max_batched_tokens=max_batched_tokens)
    B = sc.first_batch(st.rows)
    g = max(1, st.rows // max(st.distinct, 1))  # episodes per prompt, next to each other in the batch
    n = min(st.rows, B)
    prompts = [(i // g, st.prompt) for i in range(n)]  # (key, length): a task's g rows share one prompt
    blk = int(config.rollout.get("kv_block", 16))
    P, Tn = buckets.length_bucket(st.prompt), buckets.length_bucket(st.new)
    width = buckets.blocks_for(P + Tn, blk)
    pool = None
    if paged or budget_gb > 0:
        full = buckets.full_pool_blocks(B // D, P, Tn, blk)
        N = (buckets.budget_pool_blocks(int(budget_gb * GiB), int(blk * slot_bytes(cfg, config, mesh)), full)
             if budget_gb > 0 else full)
        pool = BlockPool(D, N, blk, B // D, width, full, fixed=budget_gb > 0)
    rows = _FirstRefill(B, width)
    Scheduler(sc, prompts, pool).refill(rows, np.arange(B))
    u = len({prompts[i][0] for i in rows.admitted})
    if pool is None:  # dense: the first rows go straight into the decode batch
        return buckets.batch_bucket(u, 1, D) // D, B // D
    return buckets.batch_bucket(u, 1, D) // D, buckets.batch_bucket(len(rows.admitted), 1, D) // D


def kv_bytes(cfg: ModelConfig, config, w: Workload, mesh: Mesh, max_batch: int,
             kv_budget_gb: float | None = None, max_batched_tokens: int | None = None,
             backend: str = "cpu") -> tuple[float, float, int]:
    """(KV cache bytes with a decode step's temporaries, prefill transient bytes, rows decoding at once) per
    device for the largest sampler call.

    KV budget (rollout.kv_budget_gb > 0): the pool is that many GiB per device, whatever the rows; rows are
    admitted while their blocks fit, so at most budget_concurrency rows decode at once. Otherwise dense: every
    row holds prompt + max new tokens; paged (rollout.paged_kv): the pool when every row runs to its limit
    (buckets.shape_pool_blocks, the size the sampler gives a call under a CallShape); a task's episodes share
    their prompt's blocks. Prefill (prefill_rows) runs in chunks of rollout.prefill_chunk tokens over a dense
    cache of the distinct prompts; paged, that cache is then copied to every admitted row's and written into
    the pool's blocks, so the prefill transient is the larger of (distinct cache + a chunk's temporaries) and
    (distinct cache + rows' cache). Dense, the rows' cache is the decode cache itself. backend: the chip's kind
    ("tpu" counts the programs' temporaries as XLA:TPU holds them, see prefill_chunk_bytes and
    decode_step_bytes)."""
    from marl_jax.generate import buckets
    from marl_jax.generate.buckets import batch_bucket as _batch_bucket, length_bucket
    e = _bytes(config.model.dtype)
    budget = float(config.rollout.get("kv_budget_gb", 0.0)) if kv_budget_gb is None else kv_budget_gb
    mbt = int(config.rollout.get("max_batched_tokens", 0)) if max_batched_tokens is None else max_batched_tokens
    paged = paged_kv(config, backend) or budget > 0
    blk = int(config.rollout.get("kv_block", 16))
    chunk = int(config.rollout.get("prefill_chunk", 2048))
    if mbt:
        chunk = min(chunk, mbt)  # the sampler's rule: a refill's chunk shares max_batched_tokens
    slot = slot_bytes(cfg, config, mesh)
    worst_kv, worst_pre, worst_b = 0.0, 0.0, 0
    for st in w.stages:
        B = _batch_bucket(min(st.rows, max_batch), 8, mesh.rows)
        P, Tn = length_bucket(st.prompt), length_bucket(st.new)
        b = B / mesh.rows
        bu, bg = prefill_rows(cfg, config, st, mesh, max_batch, budget, mbt, paged)
        pool_slots = 0  # slots of the paged pool on one device (0: a dense cache)
        if budget > 0:
            conc = budget_concurrency(cfg, config, st, mesh, max_batch, budget, blk)["concurrent"]
            b = math.ceil(max(conc, 1) / mesh.rows)
            kv = budget * GiB
            pool_slots = int(budget * GiB // (blk * slot)) * blk
        else:
            kv = b * (P + Tn) * slot
            if paged:  # the sampler's pool under the stage's CallShape: one size, never grown
                N = buckets.shape_pool_blocks(int(b), st.distinct, P, Tn, blk)
                kv = N * blk * slot
                pool_slots = N * blk
        chunk_bytes = prefill_chunk_bytes(cfg, bu, chunk, P, e, mesh, backend)
        if paged:
            pre = bu * P * slot + max(chunk_bytes, bg * P * slot)
        else:
            pre = bu * (P + Tn) * slot + chunk_bytes
        step = decode_step_bytes(cfg, b, P + Tn, e, mesh, backend, pool_slots)
        if kv + step + pre > worst_kv + worst_pre:
            worst_kv, worst_pre, worst_b = kv + step, pre, int(b * mesh.rows)
    return worst_kv, worst_pre, worst_b


def item_rows(knobs: Knobs, T: int) -> int:
    """Rows of one update item (all devices): micro_batch, or what the token budget holds at T tokens."""
    from marl_jax.rl.memory import budget_rows
    return budget_rows(knobs.max_tokens, T) if knobs.max_tokens else knobs.micro_batch


def activation_bytes(cfg: ModelConfig, config, w: Workload, knobs: Knobs, T: int | None = None,
                     W: int | None = None) -> float:
    """Temporaries of one update work item (one micro-batch of one slot, or one token budget's rows at the
    longest window) per device: marl_jax.rl.memory.activation_bytes under the item's attention."""
    from marl_jax.rl import layout, memory
    T = T or w.seq_len
    W = W or w.window
    m = knobs.mesh
    n = item_rows(knobs, T)
    seqs, L = n, T
    g = config.grpo
    if g.get("packing") and int(g.get("share_prefix", 0)) > 0 and not knobs.max_tokens:
        L = layout.pack_length(T, True)  # fixed micro-batches packed over shared prefixes: longer sequences
        seqs = math.ceil(n * T / L)
    rows = math.ceil(seqs / m.rows)
    impl = memory.attention_impl(cfg, L, L, knobs.backend)
    r = config.trainable.rank if config.trainable.mode == "lora" else 0
    # W per sequence keeps the LM head's positions those of the item's rows
    return memory.activation_bytes(cfg, rows=rows, T=L, W=math.ceil(n * min(W, T) / seqs), remat=knobs.remat,
                                   e=_bytes(config.model.dtype), rank=r, model_shards=m.model, impl=impl)


def batch_bytes(w: Workload, micro_batch: int, mesh: Mesh) -> float:
    """The update's input arrays per device ([S, R, T] tokens and mask, [S, R, W] targets / mask / logp)."""
    from marl_jax.rl.batch import rows_bucket
    R = rows_bucket(max(w.slot_rows()), micro_batch)
    return w.num_slots * R * (w.seq_len * 5 + w.window * 12 + 20) / mesh.rows


def memory(cfg: ModelConfig, config, w: Workload, knobs: Knobs) -> dict[str, float]:
    st = static_bytes(cfg, config, w, knobs.mesh)
    kv, prefill, B = kv_bytes(cfg, config, w, knobs.mesh, knobs.max_batch, knobs.kv_budget_gb, knobs.max_batched_tokens,
                              knobs.backend)
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
    """Seconds: decode (HBM bound: weights + live KV read per step), prefill and update (FLOP bound).

    Decode runs in waves of the rows that decode at once (rollout.max_batch, or under a KV budget the rows
    whose blocks fit the pool). preempt_s is preemption's worst case under a budget: rows admitted on their
    prompt blocks beyond those that fit at full length are each preempted once, when the pool runs dry, and
    re-prefill their prompt and the tokens they had (counted in step_s)."""
    from marl_jax.generate.buckets import length_bucket
    m = knobs.mesh
    n = m.size
    e = _bytes(config.model.dtype)
    N = cfg.num_params()
    lora = config.trainable.mode == "lora"
    kv_tok = 2 * cfg.num_layers * cfg.kv_dim * _bytes(kv_dtype(config))  # KV bytes per cached token
    blk = int(config.rollout.get("kv_block", 16))
    decode = prefill = preempt = 0.0
    waves_max = 0
    for st in w.stages:
        B = min(st.rows, knobs.max_batch)
        P, Tn = length_bucket(st.prompt), length_bucket(st.new)
        if knobs.kv_budget_gb > 0:
            cc = budget_concurrency(cfg, config, st, m, knobs.max_batch, knobs.kv_budget_gb, blk)
            B = max(1, cc["concurrent"])
            extra = max(0, cc["admitted"] - B)  # preempted once per wave, at slots_at_preemption
            waves = math.ceil(st.rows / B)
            ctx = cc["slots_at_preemption"]
            preempt += waves * extra * ctx * cfg.flops_per_token(ctx // 2) / (n * chip.bf16_flops)
        waves = math.ceil(st.rows / B)
        waves_max = max(waves_max, waves)
        # Every decode step reads the weights each device holds after the fsdp gather (in param_dtype, cast
        # in the matmul) and the live cache (prompt + half the new tokens on average), rows split over data * fsdp.
        per_step = N * _bytes(param_dtype(config)) / m.model + B / m.rows * (P + Tn / 2) * kv_tok / _div(cfg.num_kv_heads, m.model)
        flops = 2 * B / n * cfg.flops_per_token(P + Tn // 2) / 2
        decode += waves * Tn * max(per_step / chip.hbm_bw, flops / chip.bf16_flops)
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
    return {"decode_s": decode, "prefill_s": prefill, "preempt_s": preempt, "update_s": update,
            "update_flops": fwd + bwd + recompute, "decode_waves": waves_max,
            "step_s": decode + prefill + preempt + update}


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


def _row_fits(cfg, config, w, mesh, budget_gb) -> bool:
    """Every stage's longest row fits the pool alone (else the sampler refuses it)."""
    blk = int(config.rollout.get("kv_block", 16))
    return all(budget_concurrency(cfg, config, st, mesh, 1, budget_gb, blk)["concurrent"] >= 1 for st in w.stages)


def kv_budget_that_fits(cfg, config, w: Workload, knobs: Knobs, limit: float) -> float:
    """The largest KV budget (GiB per device, in steps of 0.5) with which the rollout fits `limit`, no more than
    the rows at once need; 0 when none does (not even one row of the longest stage fits beside the rest)."""
    probe = dataclasses.replace(knobs, kv_budget_gb=0.5)
    mem = memory(cfg, config, w, probe)
    room = limit - (mem["rollout_peak"] - mem["kv_cache"]) - 1.0 * GiB  # decode step transients: 1 GiB margin
    dense = kv_bytes(cfg, config, w, knobs.mesh, knobs.max_batch, 0.0, backend=knobs.backend)[0]
    g = math.floor(min(room, dense) / GiB * 2) / 2
    while g >= 0.5:
        k = dataclasses.replace(knobs, kv_budget_gb=g)
        if _row_fits(cfg, config, w, knobs.mesh, g) and memory(cfg, config, w, k)["rollout_peak"] <= limit:
            return g
        g -= 0.5
    return 0.0


def token_budgets(w: Workload, mesh: Mesh) -> list[int]:
    """Candidate grpo.max_tokens_per_micro_batch values, largest first: the longest row times 64 ... 1 rows per device."""
    return [w.seq_len * mesh.rows * k for k in (64, 32, 16, 8, 4, 2, 1)]


def fit_update(cfg, config, w, knobs: Knobs, limit: float) -> Knobs | None:
    """The largest token budget (or, as configured, micro-batch) and the least remat whose update fits."""
    if knobs.max_tokens or config.grpo.get("max_tokens_per_micro_batch", 0):
        cands = [dict(max_tokens=b) for b in token_budgets(w, knobs.mesh)]
    else:
        cands = [dict(micro_batch=mb) for mb in sorted({int(knobs.micro_batch) >> i for i in range(12)} - {0},
                                                        reverse=True)]
        cands += [dict(max_tokens=b) for b in token_budgets(w, knobs.mesh)]
    for c in cands:
        for r in REMATS:
            k = dataclasses.replace(knobs, remat=r, **c)
            if memory(cfg, config, w, k)["update_peak"] <= limit:
                return k
    return None


MAX_BATCHED_TOKENS = (16384, 8192, 4096, 2048)  # the reference's vLLM max_num_batched_tokens first, then halves


def fit_rollout(cfg, config, w, knobs: Knobs, limit: float) -> Knobs | None:
    """The knobs as they are when the rollout fits, else with the KV budget that fits (None: none does). A
    budget's refills prefill the rows they admit at once, so unless rollout.max_batched_tokens is set, the
    budget comes with the reference's 16,384 prompt tokens per refill (or fewer, when that does not fit)."""
    if memory(cfg, config, w, knobs)["rollout_peak"] <= limit:
        return knobs
    caps = [knobs.max_batched_tokens] if knobs.max_batched_tokens else []
    caps += [t for t in MAX_BATCHED_TOKENS if not caps or t < caps[0]]
    for t in caps:
        k = dataclasses.replace(knobs, max_batched_tokens=t)
        g = kv_budget_that_fits(cfg, config, w, k, limit)
        if g:
            return dataclasses.replace(k, kv_budget_gb=g)
    return None


def smallest_fit(cfg, config, w, chip: Chip, n: int, knobs: Knobs | None = None) -> Knobs | None:
    """On n chips: the least sharding (fewest fsdp * model devices) under which the step fits, with the
    configured max_batch and, where needed, a KV budget (the rollout) and a token budget or smaller
    micro-batch and more remat (the update)."""
    limit = USABLE * chip.hbm
    base = knobs or Knobs(Mesh(n), int(config.grpo.micro_batch), "full", int(config.rollout.max_batch),
                          float(config.rollout.get("kv_budget_gb", 0.0)),
                          int(config.grpo.get("max_tokens_per_micro_batch", 0)), chip.kind,
                          int(config.rollout.get("max_batched_tokens", 0)))
    for mesh in sorted(meshes(n), key=lambda m: (m.fsdp * m.model, m.model)):
        k = dataclasses.replace(base, mesh=mesh)
        if (k.max_tokens or k.kv_budget_gb) and mesh.rows != base.mesh.rows:  # budgets scale with the rows
            k = dataclasses.replace(k, max_tokens=k.max_tokens and k.max_tokens * mesh.rows // max(base.mesh.rows, 1))
        up = fit_update(cfg, config, w, k, limit)
        if up is None:
            continue
        ro = fit_rollout(cfg, config, w, up, limit)
        if ro is not None:
            return ro
    return None


def knob_flags(k: Knobs, config) -> str:
    """The --config flags that set these knobs."""
    out = [f"--config.mesh.data={k.mesh.data} --config.mesh.fsdp={k.mesh.fsdp} --config.mesh.model={k.mesh.model}"]
    if k.max_tokens:
        out.append(f"--config.grpo.max_tokens_per_micro_batch={k.max_tokens}")
    else:
        out.append(f"--config.grpo.micro_batch={k.micro_batch}")
    out.append(f"--config.grpo.remat={k.remat}")
    if k.kv_budget_gb:
        out.append(f"--config.rollout.kv_budget_gb={k.kv_budget_gb:g} --config.rollout.paged_kv=true")
    if k.max_batched_tokens != int(config.rollout.get("max_batched_tokens", 0)):
        out.append(f"--config.rollout.max_batched_tokens={k.max_batched_tokens}")
    if k.max_batch != int(config.rollout.max_batch):
        out.append(f"--config.rollout.max_batch={k.max_batch}")
    return " ".join(out)


def configured_knobs(config, mesh: Mesh, chip: Chip) -> Knobs:
    return Knobs(mesh, int(config.grpo.micro_batch), str(config.grpo.remat), int(config.rollout.max_batch),
                 float(config.rollout.get("kv_budget_gb", 0.0)), int(config.grpo.get("max_tokens_per_micro_batch", 0)),
                 chip.kind, int(config.rollout.get("max_batched_tokens", 0)))


def plan(config, chip_spec: str, prompt_tokens: int | None = None, search_chips: bool = True) -> dict[str, Any]:
    prompt_tokens = prompt_tokens or int(config.rollout.get("prompt_tokens", 512))
    chip, n = parse_chip(chip_spec)
    cfg = model_config(config.model.name)
    w = workload(config, prompt_tokens)
    mesh = config_mesh(config, n)
    knobs = configured_knobs(config, mesh, chip)
    if knobs.remat == "auto":
        knobs = dataclasses.replace(knobs, remat="full")
    mem = memory(cfg, config, w, knobs)
    limit = USABLE * chip.hbm
    mbs = sorted({1, 2, 4, 8, 16, int(config.grpo.micro_batch)})
    table = {r: {mb: memory(cfg, config, w, dataclasses.replace(knobs, micro_batch=mb, remat=r,
                                                                max_tokens=0))["update_peak"]
                 for mb in mbs} for r in REMATS}
    # With the configured mesh first (the knobs to set on it), else the least sharding that fits.
    fit = None
    up = fit_update(cfg, config, w, knobs, limit)
    if up is not None:
        fit = fit_rollout(cfg, config, w, up, limit)
    fit = fit or smallest_fit(cfg, config, w, chip, n, knobs)
    # The largest token budget (grpo.max_tokens_per_micro_batch) whose update fits with those knobs' mesh and remat.
    tb = None
    if fit is not None:
        tb = next((b for b in token_budgets(w, fit.mesh) if memory(cfg, config, w, dataclasses.replace(
            fit, max_tokens=b))["update_peak"] <= limit), None)
    fewest = None
    if search_chips:
        fewest = next((k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if smallest_fit(cfg, config, w, chip, k)), None)
    kv_layout = ("paged, a KV budget of %g GiB per device" % knobs.kv_budget_gb if knobs.kv_budget_gb
                 else f"paged, {int(config.rollout.kv_block)}-slot blocks" if paged_kv(config, knobs.backend)
                 else "dense")
    return {
        "chip": chip_spec, "chip_name": chip.name, "devices": n, "hosts": math.ceil(n / chip.per_host),
        "hbm_per_device": chip.hbm, "usable_per_device": limit,
        "model": config.model.name, "params": cfg.num_params(), "dtype": config.model.dtype,
        "param_dtype": param_dtype(config), "attention": config.model.get("attention", "auto"),
        "workflow": config.workflow, "policy": config.policy, "slots": w.num_slots,
        "trainable": config.trainable.mode + (f" r{config.trainable.rank}" if config.trainable.mode == "lora" else ""),
        "stages": [dataclasses.asdict(s) for s in w.stages], "seq_len": w.seq_len, "window": w.window,
        "kv_layout": kv_layout, "prefill_chunk": int(config.rollout.get("prefill_chunk", 2048)),
        "mesh": str(mesh), "micro_batch": knobs.micro_batch, "max_tokens_per_micro_batch": knobs.max_tokens,
        "remat": knobs.remat, "max_batch": knobs.max_batch, "kv_budget_gb": knobs.kv_budget_gb,
        "memory": mem, "fits": mem["peak"] <= limit,
        "update_peak_by_remat_and_micro_batch": table,
        "smallest_fit": None if fit is None else {
            "mesh": str(fit.mesh), "micro_batch": fit.micro_batch, "max_tokens_per_micro_batch": fit.max_tokens,
            "remat": fit.remat, "max_batch": fit.max_batch, "kv_budget_gb": fit.kv_budget_gb,
            "max_batched_tokens": fit.max_batched_tokens, "flags": knob_flags(fit, config), "memory": memory(cfg, config, w, fit),
            "time": roofline(cfg, config, w, fit, chip)},
        "token_budget": tb,
        # the update's programs, from the config's lengths (rollout.prompt_tokens, not --prompt_tokens)
        "update_lengths": update_lengths(config), "update_shapes": [
            {"rows": k.rows, "shape": type(k.shape).__name__, **k.shape._asdict()} for k in update_shapes(config, knobs)],
        "sampler_shapes": sampler_shapes(config, knobs.backend),
        "fewest_chips": fewest,
        "time": roofline(cfg, config, w, knobs, chip),
    }


def _gb(x: float) -> str:
    return f"{x / GiB:8.2f}"


def format_plan(p: dict[str, Any]) -> str:
    m = p["memory"]
    items = (f"token budget {p['max_tokens_per_micro_batch']}" if p.get("max_tokens_per_micro_batch")
             else f"micro-batch {p['micro_batch']}")
    lines = [
        f"{p['workflow']} / {p['policy']} on {p['model']} ({p['params'] / 1e9:.2f}B params, {p['dtype']} compute, "
        f"{p.get('param_dtype', 'float32')} base weights, attention {p.get('attention', 'auto')}, "
        f"{p['trainable']}, {p['slots']} slot(s))",
        f"chip {p['chip']}: {p['devices']} x {p['chip_name']} on {p['hosts']} host(s), "
        f"{p['hbm_per_device'] / GiB:.1f} GiB HBM each (plan to {p['usable_per_device'] / GiB:.1f} GiB)",
        f"mesh (data x fsdp x model) {p['mesh']}, {items}, remat {p['remat']}, "
        f"update rows of {p['seq_len']} tokens ({p['window']} scored), prefill chunks of {p.get('prefill_chunk')}",
        "stages (worst case: every row runs to its limit): " + "; ".join(
            f"{s['role']} {s['rows']} rows, prompt {s['prompt']} + {s['new']}" for s in p["stages"]),
        "",
        f"KV cache: {p['kv_layout']}, up to {m['sampler_batch']} rows decoding at once",
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
    lines += ["", "knobs that fit this slice: " + (
        f"{f['flags']} (peak {_gb(f['memory']['peak']).strip()} GiB)" if f else "nothing: use more chips"),
        "token budget that fits with them: " + (f"--config.grpo.max_tokens_per_micro_batch={p['token_budget']} "
                                                  f"(an update item of at most that many tokens over the mesh's rows)"
                                                  if p.get("token_budget") else "none"),
        f"fewest chips of this kind that hold it: {p['fewest_chips'] or 'more than 256'}", ""]

    def t_line(name, t):
        pre = f" + preemption worst case {t['preempt_s']:.1f} s" if t.get("preempt_s") else ""
        return (f"roofline per training step, {name}: decode {t['decode_s']:.1f} s ({t.get('decode_waves', 1)} "
                f"wave(s)) + prefill {t['prefill_s']:.1f} s{pre} + update {t['update_s']:.1f} s = {t['step_s']:.1f} s")
    if p.get("update_shapes") is not None:
        from marl_jax.rl.layout import ItemShape, Packed, Window
        T, W = p["update_lengths"]
        keys = [ItemShape((Packed(d["p"], d["t"]) if d["shape"] == "Packed" else Window(d["t"])), d["rows"])
                for d in p["update_shapes"]]
        lines += [f"update item programs ({len(keys)}, compiled before step 1; rows of {T} tokens, {W} scored, at "
                  f"rollout.prompt_tokens): " + format_shapes(keys), ""]
    for st in p.get("sampler_shapes") or ():
        lines.append(f"sampler programs, {st['stage']} ({st['role']}): prompt {st['prompt_slots']} + {st['new_slots']} "
                     f"new slots, {st['distinct']} distinct of {st['batch']} rows, decode at batch "
                     f"{'/'.join(map(str, st['batch_sizes']))} x windows {'/'.join(map(str, st['windows']))}, "
                     f"prefix-cache hits prefilled at cached regions {'/'.join(map(str, st['cached_regions']))}"
                     + (f", a paged pool of {st['pool_blocks']} blocks" if st.get("pool_blocks") else "")
                     + (f", refills of {st['refill_rows']} rows prefilling "
                        f"{'/'.join(map(str, st['refill_distinct']))} distinct prompts" if st.get("refill_rows") else ""))
    if p.get("sampler_shapes"):
        lines.append("")
    lines.append(t_line("as configured", p["time"]))
    if f:
        lines.append(t_line("with the knobs", f["time"]))
    lines.append("(lower bounds: perfect overlap, no compilation or host work, every row at its limit)")
    return "\n".join(lines)


PRESET_WORKFLOWS = ("eval_opt", "voting", "orch_workers", "single_agent")
PRESET_ARGS = tuple(f"qwen3-{m},{t}" for m in ("0.6b", "1.7b", "4b") for t in ("math", "code"))
TABLE_CHIPS = ("ref", "v5p-8", "v6e-8", "H100-80GB", "v5e-8")


def _ref_chip(workflow: str) -> str:
    """The reference's hardware: 2 x H100-80GB, 4 for orch_workers (its launcher asks for 4 GPUs)."""
    return "H100-80GBx4" if workflow == "orch_workers" else "H100-80GBx2"


def preset_rows(chips=TABLE_CHIPS, prompt_tokens: int = 512, overrides: dict | None = None) -> list[dict]:
    """Every paper preset on every chip: fits as configured, with the knobs the plan prints, or not (then the
    fewest chips of that kind that hold it)."""
    from marl_jax.configs import get_config
    out = []
    for wf in PRESET_WORKFLOWS:
        for arg in PRESET_ARGS:
            config = get_config(wf, arg)
            for key, v in (overrides or {}).items():
                node = config
                *head, last = key.split(".")
                for h in head:
                    node = node[h]
                node[last] = v
            for chip in chips:
                spec = _ref_chip(wf) if chip == "ref" else chip
                p = plan(config, spec, prompt_tokens, search_chips=False)
                f = p["smallest_fit"]
                row = {"preset": f"{wf}:{arg}", "chip": spec, "fits": p["fits"], "peak_gib": p["memory"]["peak"] / GiB,
                       "step_s": p["time"]["step_s"], "knobs": None, "fewest_chips": None}
                if f:
                    row.update(knobs=f["flags"], knob_peak_gib=f["memory"]["peak"] / GiB, knob_step_s=f["time"]["step_s"],
                               preempt_s=f["time"]["preempt_s"], waves=f["time"]["decode_waves"])
                else:
                    chip_, _ = parse_chip(spec)
                    w = workload(config, prompt_tokens)
                    cfg = model_config(config.model.name)
                    row["fewest_chips"] = next((k for k in (1, 2, 4, 8, 16, 32, 64) if
                                                smallest_fit(cfg, config, w, chip_, k)), None)
                out.append(row)
    return out


def format_table(rows: list[dict]) -> str:
    """One line per preset, one column per chip: 'yes s' (fits as configured), 'knobs s' (fits with the knobs
    the plan prints), 'no (N)' (fewest chips of that kind that hold it); then the knobs per cell."""
    chips = list(dict.fromkeys("ref" if r["chip"].startswith("H100-80GBx") else r["chip"] for r in rows))
    names = {"ref": "reference (2 x H100-80GB; 4 for orch_workers)"}
    lines = ["| preset | " + " | ".join(names.get(c, c) for c in chips) + " |", "|---" * (len(chips) + 1) + "|"]
    by = {}
    for r in rows:
        by.setdefault(r["preset"], []).append(r)

    def cell(r):
        if r["fits"]:
            return f"yes, {r['step_s']:.0f} s"
        if r["knobs"]:
            return f"knobs, {r['knob_step_s']:.0f} s"
        return f"no ({r['fewest_chips'] or '>64'} chips)"
    for preset, rs in by.items():
        lines.append(f"| {preset} | " + " | ".join(cell(r) for r in rs) + " |")
    lines += ["", "| preset | chip | peak as configured GiB | knobs | peak with knobs GiB | decode waves | "
              "preemption worst case s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["knobs"] and not r["fits"]:
            knobs = r["knobs"].replace("--config.", "")
            lines.append(f"| {r['preset']} | {r['chip']} | {r['peak_gib']:.1f} | `{knobs}` | {r['knob_peak_gib']:.1f} | "
                         f"{r['waves']} | {r['preempt_s']:.1f} |")
    return "\n".join(lines)


def main(argv):
    from absl import app
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if FLAGS.table:
        print(format_table(preset_rows(prompt_tokens=FLAGS.prompt_tokens or 512)))
        return
    from marl_jax.config import validate
    config = FLAGS.config
    if config is None:
        raise app.UsageError("--config is required (or --table)")
    try:
        validate(config)
        if FLAGS.aot:
            from marl_jax import plan_aot
            try:
                r = plan_aot.aot(config, FLAGS.chip, prompt_tokens=FLAGS.prompt_tokens or None, layers=FLAGS.aot_layers)
            except ValueError as e:  # no libtpu, or a GPU: one line, not the usage text
                raise SystemExit(f"marl_jax.plan: {e}")
            print(json.dumps(r, indent=1, default=str) if FLAGS.json else plan_aot.format_aot(r))
            return
        p = plan(config, FLAGS.chip, FLAGS.prompt_tokens or None)
    except ValueError as e:
        raise app.UsageError(str(e))
    print(json.dumps(p, indent=1, default=str) if FLAGS.json else format_plan(p))


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "configs/<workflow>.py[:<model>,<task>]", lock_config=True)
    flags.DEFINE_string("chip", "v5e-8", "v4-8 | v5e-8 | v5p-8 | v6e-8 (any slice size) | H100-80GB | H200 "
                        "(xN for N GPUs)")
    flags.DEFINE_integer("prompt_tokens", 0, "prompt tokens before any earlier stage's output (system prompt, "
                         "instructions and the problem)")
    flags.DEFINE_bool("json", False, "print JSON instead of tables")
    flags.DEFINE_bool("aot", False, "compile the run's update item, prefill chunk and decode step for the TPU slice "
                      "(libtpu, no TPU needed: pip install -e \".[aot]\") and print XLA's bytes and FLOPs beside the plan's")
    flags.DEFINE_integer("aot_layers", 0, "with --aot: compile (and plan) a model of this many layers (0: all)")
    FLAGS = flags.FLAGS
    flags.DEFINE_bool("table", False, "every paper preset on the reference's GPUs, v5p-8, v6e-8, one H100-80GB and "
                      "v5e-8 (docs/planner.md)")
    from marl_jax.cli import run

    run(main, "marl_jax.plan")
