"""Accelerator benchmark on whatever backend JAX has: decode against the HBM roofline, update MFU, one
end-to-end training step. Random weights in Qwen3-0.6B shapes, bfloat16, nothing downloaded.

    python benchmarks/accelerator.py [--small] [--out=results.jsonl]

Prints JSON lines (and appends them to --out):
  {"bench": "device", ...}: backend, device kind, a measured bf16 matmul peak and copy bandwidth;
  {"bench": "decode", "model", "path", "batch", ...}: the sampler's decode step time (every row runs to the
      limit) at Qwen3-0.6B and Qwen3-1.7B shapes, batch 64 and 256, 512 new tokens after 256 and the last 512
      of 4096 (DECODE_SHAPES), on each cache path (decode_paths: dense; the paged pool as the backend reads it;
      on GPU the pool gathered too), against the HBM roofline: (weights + live KV read + new KV written per
      step) / bandwidth, the vendor's bandwidth where the chip is known, else the measured copy bandwidth.
      A shape whose cache exceeds 70% of the device's memory runs paged under a KV budget (kv_budget_gb,
      preemptions);
  {"bench": "decode_hf", ...}: transformers' generate (torch, static cache, greedy) on the same shapes and
      device: its decode step time and `speedup_vs_hf` (its step time over the sampler's, on the path
      rollout.paged_kv=auto takes there: `vs_path`);
  {"bench": "update", "policy": "shared" | "isolated", ...}: the jitted GRPO update (3 roles, LoRA r64
      on every linear layer, rows of 256 prompt + 512 completion tokens, per-role diagnostics on):
      step time and MFU = (forward + input-gradient FLOPs: all a LoRA step must compute, the frozen
      weights get no gradients; recomputation not counted) / time / measured bf16 peak; `mfu_6n`
      uses the usual 6 x params x tokens instead;
  {"bench": "attention", "check": ...}: each attention implementation of the backend (dense, blockwise,
      and cuDNN on GPU / splash on TPU) in bfloat16 against dense attention in float32, outputs and
      gradients, on right-padded causal rows with GQA (Qwen3-0.6B's 16 / 8 heads of 128), beside dense
      bfloat16's own error as the yardstick;
  {"bench": "attention", "tokens": T, ...}: forward + backward of one row of T tokens per implementation:
      seconds, useful TFLOP/s (the causal half of the scores) and XLA's temporaries for the gradient;
  {"bench": "e2e", ...}: orch_workers training steps (marl_jax.train.loop.Trainer.train_step) after the
      trainer's warm-up, on random weights and a small JSONL task file, at the prompt and completion limits
      of --e2e_preset (the paper's qwen3-0.6b,math: 512 + 5,120 tokens; a random model never stops, so every
      row runs to the limit) with --e2e_tasks tasks of its 8 episodes: step time split into sampler / reward /
      update / compile seconds, tokens/s, and the planner's roofline for the same step on this chip beside it.
Each timing follows a warm-up call (compilation excluded, reported separately as *_first_s).
`--small` shrinks every shape so the whole script runs on CPU in well under a minute (a test runs it).

Tokenizer: a word-level `tokenizers` vocabulary of 151936 entries (ChatML specials, single characters,
then filler tokens), built in memory. The Qwen3 tokenizer needs `qwen.tiktoken` (not shipped offline)
and the embedded SmolLM2 tokenizer needs the `gguf` package and a 49152-token vocabulary; this one
needs only `tokenizers`, matches the model's vocabulary, and decodes every id a random model samples.

Imports are lazy: the device machine need not have ml_collections, grain, gguf or tensorboardX for
the decode and update parts; the end-to-end part needs ml_collections and math-verify (it reports
itself skipped, naming the package, when they are missing).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = 151936
# Vendor numbers (as in marl_jax.plan.CHIPS): HBM bytes/s and dense bf16 FLOP/s by device kind.
KNOWN = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "TPU v4": (1.2e12, 275e12),
         "TPU v5 lite": (819e9, 197e12), "TPU v5e": (819e9, 197e12), "TPU v5p": (2.765e12, 459e12),
         "TPU v5": (2.765e12, 459e12), "TPU v6 lite": (1.64e12, 918e12), "TPU v6e": (1.64e12, 918e12)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes for a CPU test")
    p.add_argument("--out", default="", help="also append the JSON lines to this file")
    p.add_argument("--parts", default="attention,decode,update,e2e",
                   help="comma-separated subset of attention,decode,update,e2e")
    p.add_argument("--attention_lengths", default="4096,16384,32768",
                   help="row lengths of the attention timings (dense and blockwise only up to 16384)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--decode_batches", default="", help="only these decode batch sizes (default: every shape)")
    p.add_argument("--decode_models", default="", help="decode models (default Qwen/Qwen3-0.6B,Qwen/Qwen3-1.7B)")
    p.add_argument("--skip_hf", action="store_true", help="decode: no transformers generate beside the sampler")
    p.add_argument("--e2e_steps", type=int, default=2, help="training steps of the end-to-end part")
    p.add_argument("--e2e_preset", default="qwen3-0.6b,math",
                   help="orch_workers preset whose prompt and completion limits the end-to-end step takes")
    p.add_argument("--e2e_tasks", type=int, default=1,
                   help="tasks per end-to-end step (each with the preset's episodes)")
    p.add_argument("--e2e_new_tokens", type=int, default=0, help="completion limit per role (0: the preset's)")
    return p.parse_args(argv)


def emit(rec, out):
    line = json.dumps(rec, sort_keys=True)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def model_cfg(small: bool):
    from marl_jax.models.decoder import ModelConfig
    if small:
        return ModelConfig(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True,
                           rope_theta=1e6)
    from marl_jax.plan import PRESET_MODELS
    return PRESET_MODELS["Qwen/Qwen3-0.6B"]


def word_tokenizer(vocab_size: int):
    """ChatML specials, printable characters, then filler tokens '<t{i}>' up to vocab_size."""
    import string

    from tokenizers import AddedToken, Regex
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from marl_jax.models.tokenizer import Tokenizer

    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in string.digits + string.ascii_letters + string.punctuation + " \n":
        vocab.setdefault(ch, len(vocab))
    for i in range(len(vocab), vocab_size):
        vocab[f"<t{i}>"] = i
    backend = Backend(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return Tokenizer(backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def timed(fn, reps):
    """(first call seconds, best of reps seconds, last result)."""
    import jax
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - t
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return first, best, out


def device_info(small: bool, reps: int):
    import jax
    import jax.numpy as jnp
    dev = jax.devices()[0]
    n = 512 if small else 8192
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    _, t_mm, _ = timed(lambda: mm(a), reps + 2)
    m = (1 << 20) if small else (1 << 30)  # elements
    x = jnp.ones((m,), jnp.bfloat16)
    cp = jax.jit(lambda v: v + 1)
    _, t_cp, _ = timed(lambda: cp(x), reps + 2)
    kind = dev.device_kind
    spec = next((v for k, v in KNOWN.items() if k.lower() in kind.lower()), None)
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return {"bench": "device", "backend": jax.default_backend(), "device_kind": kind, "devices": jax.device_count(),
            "hbm_bytes": (stats or {}).get("bytes_limit"),
            "matmul_bf16_flops": 2 * n ** 3 / t_mm, "copy_bytes_per_s": 2 * 2 * m / t_cp,
            "spec_hbm_bytes_per_s": spec[0] if spec else None, "spec_bf16_flops": spec[1] if spec else None}


# (batch, prompt, new tokens) of the decode part. 4096 new tokens: the prompt holds the first 3584 of them
# (prefilled), the timed decode is the completion's last 512 steps, where the cache is longest (what the roofline
# fraction at 4096 new tokens is about), in an eighth of the device time. At batch 256 that context (4608 slots
# x 112 KiB for Qwen3-0.6B / 1.7B) is 132 GB: it runs paged under a KV budget, rows preempted when it runs dry.
DECODE_SHAPES = ((64, 256, 512), (256, 256, 512), (64, 512 + 3584, 512), (256, 512 + 3584, 512))
DECODE_MODELS = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B")


def decode_paths(backend: str) -> tuple[str, ...]:
    """The sampler's decode paths worth timing on a backend: the cache rollout.paged_kv=auto picks first."""
    return {"tpu": ("paged", "dense"), "gpu": ("dense", "paged", "paged_gather")}.get(backend, ("dense", "paged"))


def bench_decode(cfg, params, batch, prompt_len, new_tokens, dev, reps, path="dense", model="", kv_budget_gb=0.0):
    """The sampler's decode at one shape on one path: "dense" (the dense cache), "paged" (the pool, read as the
    backend's paged path reads it: the Pallas kernel on TPU, paged_fused on GPU, the gathered blocks on CPU),
    "paged_gather" (the pool, its blocks gathered then attended: model.attention=dense). Every row runs to
    the limit (no stop ids). Step time over the decode seconds of the best of `reps` calls after a first one.
    Roofline: (weights + the live KV each step reads on average + the new KV) / bandwidth."""
    import dataclasses as dc

    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.generate.sampler import Sampler, SamplingParams
    if path == "paged_gather":
        cfg = dc.replace(cfg, attention="dense")
    sampler = Sampler(cfg, dtype=jnp.bfloat16, max_batch=batch, compaction=False, share_prefix=False,
                      paged=path != "dense", kv_dtype=jnp.bfloat16, prefix_cache_tokens=0,
                      kv_budget_bytes=int(kv_budget_gb * 2 ** 30))
    rng = np.random.RandomState(0)
    prompts = [rng.randint(100, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)  # no stop ids: every row runs to the limit

    def run():
        out = sampler.generate(params, prompts, jax.random.PRNGKey(1), sp)
        return out.lengths

    t = time.perf_counter()
    run()
    first = time.perf_counter() - t
    best = None
    for _ in range(reps):
        run()
        s = dict(sampler.stats)
        if best is None or s["decode_s"] < best["decode_s"]:
            best = s
    steps = best["decode_steps"]
    step_s = best["decode_s"] / steps
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    kv_per_token = 2 * cfg.num_layers * cfg.kv_dim * 2
    # Live cache per step, averaged over the decode: the prompt and half the new tokens, read once; and one new
    # slot written per row.
    live_kv = batch * (prompt_len + new_tokens / 2 + 1) * kv_per_token
    bw = dev["spec_hbm_bytes_per_s"] or dev["copy_bytes_per_s"]
    roofline_s = (weight_bytes + live_kv) / bw
    return {"bench": "decode", "model": model, "path": path, "batch": batch, "prompt": prompt_len,
            "new_tokens": new_tokens, "steps": steps, "step_s": step_s, "tokens_per_s": batch / step_s,
            "weight_bytes": weight_bytes, "live_kv_bytes": live_kv, "roofline_step_s": roofline_s,
            "roofline_fraction": roofline_s / step_s, "kv_budget_gb": kv_budget_gb,
            "preemptions": best.get("preemptions", 0),
            "bandwidth_used": "spec" if dev["spec_hbm_bytes_per_s"] else "measured_copy",
            "prefill_s": best["prefill_s"], "first_call_s": first}


def bench_decode_hf(cfg, batch, prompt_len, new_tokens, reps, model=""):
    """transformers' generate on the same shapes and device, random weights of the same shapes in bfloat16, a
    static KV cache, greedy, every row to the limit: decode step time = (time for new_tokens - time for 1) /
    (new_tokens - 1), so its prefill is left out as the sampler's is."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from marl_jax.models.decoder import config_to_hf
    hf = {k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", "torch_dtype")}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    conf = AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16).to(device).eval()
    ids = torch.randint(100, cfg.vocab_size, (batch, prompt_len), device=device)
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.no_grad():
            t = time.perf_counter()
            m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       cache_implementation="static", pad_token_id=0, eos_token_id=None)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t

    gen(2)  # warm-up (allocations, kernels)
    one = min(gen(1) for _ in range(max(reps, 1)))
    full = min(gen(new_tokens) for _ in range(max(reps, 1)))
    del m
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"bench": "decode_hf", "model": model, "batch": batch, "prompt": prompt_len, "new_tokens": new_tokens,
            "step_s": (full - one) / (new_tokens - 1), "device": device, "static_cache": True}


@dataclasses.dataclass
class Row:
    prompt_tokens: list
    completion_tokens: list
    logprobs: list
    role: str
    call_index: int = 0
    trained: bool = True


def bench_update(cfg, base, rows_per_role, prompt_len, completion_len, rank, micro_batch, dev, reps):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.policy.lora import PolicySpec, init_trainable
    from marl_jax.rl import optim
    from marl_jax.rl.batch import make_batch, make_groups
    from marl_jax.rl.update import UpdateConfig, init_state, make_train_step

    roles = ["orchestrator", "worker", "synthesizer"]
    rng = np.random.RandomState(0)
    rows = [Row(rng.randint(3, cfg.vocab_size, prompt_len).tolist(), rng.randint(3, cfg.vocab_size, completion_len).tolist(),
                list(-rng.rand(completion_len)), role) for role in roles for _ in range(rows_per_role)]
    advs = (rng.choice([-1.0, 1.0], len(rows)) * rng.uniform(0.2, 1.5, len(rows))).astype(np.float32)
    ucfg = UpdateConfig(micro_batch=micro_batch, remat="full", dtype=jnp.bfloat16)
    tx = optim.per_slot(optim.make_optimizer(lr=1e-5, grad_clip=1.0))
    tokens = len(rows) * (prompt_len + completion_len)
    scored = len(rows) * completion_len
    # Forward FLOPs: every token through the layers (attention over half the row on average), the LM
    # head on the scored positions only.
    per_tok = cfg.flops_per_token((prompt_len + completion_len) // 2) - 2 * cfg.hidden_size * cfg.vocab_size
    fwd = tokens * per_tok + scored * 2 * cfg.hidden_size * cfg.vocab_size
    out = []
    for name, r2s in (("shared", {r: 0 for r in roles}), ("isolated", {r: i for i, r in enumerate(roles)})):
        slots = len(set(r2s.values()))
        spec = PolicySpec(rank=rank, alpha=32.0, num_slots=slots)
        groups = make_groups(roles, r2s, None)
        batch = make_batch(rows, advs, role_to_slot=r2s, num_slots=slots, groups=groups, micro_batch=micro_batch,
                           pad_id=0, agg=ucfg.agg)
        batch = jax.tree_util.tree_map(jnp.asarray, batch)
        step = make_train_step(cfg, spec, ucfg, tx, num_groups=len(groups.names), group_slot=groups.slot,
                               group_role=[roles.index(r) for r in groups.role], num_roles=len(roles),
                               role_slot=[r2s[r] for r in roles])
        holder = {"state": init_state(init_trainable(spec, cfg, base, jax.random.PRNGKey(0)), tx)}

        def run():
            holder["state"], m = step(holder["state"], base, batch)
            return m["loss"]

        first, best, _ = timed(run, reps)
        peak = dev["matmul_bf16_flops"]
        S, R, T = batch.tokens.shape
        out.append({"bench": "update", "policy": name, "slots": slots, "rows": len(rows), "prompt": prompt_len,
                    "completion": completion_len, "lora_rank": rank, "micro_batch": micro_batch, "remat": "full",
                    "arrays": [S, R, T], "step_s": best, "first_call_s": first, "model_flops": 2 * fwd,
                    "mfu": 2 * fwd / best / peak, "mfu_6n": 6 * cfg.num_params() * tokens / best / peak,
                    "hfu_with_recompute": 3 * fwd / best / peak, "peak_flops_measured": peak,
                    "mfu_vs_spec": (2 * fwd / best / dev["spec_bf16_flops"]) if dev["spec_bf16_flops"] else None})
    return out


def bench_attention(small: bool, lengths, reps: int):
    """The backend's attention kernels against dense float32: errors, then speed and memory by length."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.models import attention as A
    kernel = {"gpu": "cudnn", "tpu": "splash"}.get(jax.default_backend())
    impls = ["dense", "blockwise"] + ([kernel] if kernel else [])
    Hq, Hkv, hd = (4, 2, 16) if small else (16, 8, 128)
    f32, bf16 = jnp.float32, jnp.bfloat16

    def qkv(B, T, seed):
        ks = jax.random.split(jax.random.PRNGKey(seed), 3)
        return (jax.random.normal(ks[0], (B, T, Hq, hd), f32), jax.random.normal(ks[1], (B, T, Hkv, hd), f32),
                jax.random.normal(ks[2], (B, T, Hkv, hd), f32))

    def grad_fn(impl):  # the layout and weights are arguments: closed over, they would be baked in as constants
        def loss(q, k, v, lay, w):
            return (A.attention(q, k, v, lay, impl).astype(f32) * w).sum()
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    recs = []
    # Errors: two rows (full and 70% valid), weights zero on padding (its outputs are unspecified).
    B, T = 2, (256 if small else 2048)
    q, k, v = qkv(B, T, 0)
    lengths_ = jnp.asarray([T, int(T * 0.7)])
    valid = jnp.arange(T)[None] < lengths_[:, None]
    lay = A.causal(valid, right_padded=True)
    w = jax.random.normal(jax.random.PRNGKey(9), (B, T, Hq * hd), f32) * valid[..., None]
    ref_out = A.attention(q, k, v, lay, "dense") * valid[..., None]
    _, ref_g = grad_fn("dense")(q, k, v, lay, w)
    qb, kb, vb = (x.astype(bf16) for x in (q, k, v))

    def rel(a, b):
        return float(jnp.max(jnp.abs(a.astype(f32) - b)) / jnp.max(jnp.abs(b)))
    for impl in impls:
        out = A.attention(qb, kb, vb, lay, impl).astype(f32) * valid[..., None]
        _, g = grad_fn(impl)(qb, kb, vb, lay, w)
        recs.append({"bench": "attention", "check": impl, "dtype": "bfloat16", "reference": "dense float32",
                     "tokens": T, "rows": B, "heads": [Hq, Hkv, hd], "out_rel_err": rel(out, ref_out),
                     **{f"d{n}_rel_err": rel(a, b) for n, a, b in zip("qkv", g, ref_g)}})
    # Speed and memory: one full causal row per length.
    for T in lengths:
        q, k, v = (x.astype(bf16) for x in qkv(1, T, 1))
        lay = A.causal(jnp.ones((1, T), bool), right_padded=True)
        w = jnp.ones((1, T, Hq * hd), f32)
        useful = 3.5 * 4 * Hq * hd * T * (T + 1) / 2  # forward: 2 matmuls over the causal half; backward 2.5x
        for impl in impls:
            if impl in ("dense", "blockwise") and T > 16384:
                continue
            t0 = time.perf_counter()
            compiled = grad_fn(impl).lower(q, k, v, lay, w).compile()
            compile_s = time.perf_counter() - t0
            mem = compiled.memory_analysis()
            _, best, _ = timed(lambda: compiled(q, k, v, lay, w), reps)
            recs.append({"bench": "attention", "tokens": T, "impl": impl, "heads": [Hq, Hkv, hd], "dtype": "bfloat16",
                         "fwd_bwd_s": best, "useful_tflops_per_s": useful / best / 1e12, "compile_s": compile_s,
                         "temp_gib": (mem.temp_size_in_bytes / 2 ** 30) if mem is not None else None})
    return recs


def bench_e2e(cfg, params, small: bool, reps: int, preset: str = "", tasks: int = 1, new_tokens: int = 0,
              chip: str | None = None):
    try:
        import ml_collections  # noqa: F401  (the config schema)
        import math_verify  # noqa: F401  (the math grader)
    except ImportError as e:
        return {"bench": "e2e", "skipped": f"missing package {e.name}: install it (see benchmarks/accelerator_device.sh)"}
    import numpy as np

    from marl_jax.configs.orch_workers import get_config
    from marl_jax.models.loading import LoadedModel
    from marl_jax.plan import CHIPS, plan
    from marl_jax.train.loop import Trainer

    tok = word_tokenizer(cfg.vocab_size)
    workdir = tempfile.mkdtemp(prefix="accel-e2e-")
    rng = np.random.RandomState(0)
    path = os.path.join(workdir, "tasks.jsonl")
    with open(path, "w") as f:
        for i in range(64):
            a, b = rng.randint(0, 50, 2)
            f.write(json.dumps({"problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    c = get_config("" if small else preset)  # small: the CPU preset
    c.task.update(source="file", path=path, question_key="problem", answer_key="answer", size=48, val_size=16,
                  extraction="last_number")
    c.model.dtype = "bfloat16"
    if small:
        c.num_tasks, c.rollout.group_size, c.rollout.prompt_tokens = 2, 2, 256  # this tokenizer's prompts fit
        for r in c.rollout.max_new_tokens:
            c.rollout.max_new_tokens[r] = 8
    else:
        c.num_tasks = tasks
        for r in c.rollout.max_new_tokens:
            c.rollout.max_new_tokens[r] = new_tokens or c.rollout.max_new_tokens[r]
    c.trainable.update(rank=8 if small else 64, alpha=32.0)
    # An entropy bonus keeps rows whose advantage is 0 (a random model rarely varies its reward), so the
    # update trains every sampled row, as it would on a model that solves some of the tasks.
    c.grpo.update(remat="full", micro_batch=8, entropy_coef=1e-4)
    c.train.update(steps=1 + reps, tensorboard=False, plots=False)
    trainer = Trainer(c, workdir, model=LoadedModel(cfg, params, tok, "random-qwen3-0.6b-shapes"), progress=False)
    warm = trainer.warmup()  # as launch/run.py does before step 1
    recs = [trainer.train_step(step) for step in range(1 + reps)]
    best = min(recs[1:], key=lambda r: r["step_s"]) if len(recs) > 1 else recs[0]
    keys = ("step_s", "sampler_s", "glue_s", "reward_s", "update_s", "tokens_per_s", "compile_s")
    rec = {"bench": "e2e", "workflow": "orch_workers", "preset": "" if small else preset, "tasks": c.num_tasks,
           "episodes": c.rollout.group_size, "prompt_tokens": int(c.rollout.prompt_tokens),
           "max_new_tokens": int(next(iter(c.rollout.max_new_tokens.values()))), "lora_rank": c.trainable.rank,
           **{k: best.get(k) for k in keys}, **{k: warm[k] for k in ("warmup_s", "warmup_programs")},
           "steps_s": [r["step_s"] for r in recs], "steps_compile_s": [r["compile_s"] for r in recs],
           "steps_compile_programs": [r["compile_programs"] for r in recs]}
    # The planner's roofline for the same config: this GPU's, else (CPU) an H100's, named.
    rec["plan_chip"] = chip if chip in CHIPS else "H100-80GB"
    try:  # the measurement is kept whatever the planner says
        t = plan(c, rec["plan_chip"], search_chips=False)["time"]
        rec.update({f"plan_{k}": t[k] for k in ("step_s", "decode_s", "prefill_s", "update_s")})
        rec["vs_plan"] = rec["plan_step_s"] / best["step_s"]
    except Exception as e:
        rec["plan_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


def run_decode(args, dev):
    """Every model x shape x path of the decode part, transformers' generate beside it (speedup_vs_hf: its step
    time over the sampler's at the same shape, on the path rollout.paged_kv=auto picks on this backend)."""
    import jax
    import jax.numpy as jnp

    from marl_jax.generate.buckets import paged_by_default
    from marl_jax.models import decoder
    backend = jax.default_backend()
    if args.small:
        models = [("small", model_cfg(True))]
        shapes = [(8, 16, 16), (16, 16, 16)]
    else:
        from marl_jax.plan import PRESET_MODELS
        models = [(m, PRESET_MODELS[m]) for m in (args.decode_models.split(",") if args.decode_models else DECODE_MODELS)]
        shapes = DECODE_SHAPES
    if args.decode_batches:
        shapes = [s for s in shapes if s[0] in {int(b) for b in args.decode_batches.split(",")}]
    hbm = float(dev.get("hbm_bytes") or 0)
    default = "paged" if paged_by_default(backend) else "dense"
    for name, cfg in models:
        params = jax.jit(lambda k: decoder.init_params(cfg, k, jnp.bfloat16))(jax.random.PRNGKey(0))
        weights = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
        for batch, prompt, new in shapes:
            kv = batch * (prompt + new) * 2 * cfg.num_layers * cfg.kv_dim * 2
            budget = 0.0
            if hbm and kv > 0.7 * hbm - weights:  # does not fit: the pool of a KV budget that does
                budget = (0.7 * hbm - weights) / 2 ** 30
            ours = {}
            for path in decode_paths(backend):
                if budget and path == "dense":
                    continue
                try:
                    rec = bench_decode(cfg, params, batch, prompt, new, dev, args.reps, path, name, budget)
                except Exception as e:  # e.g. out of memory: reported, the others still run
                    rec = {"bench": "decode", "model": name, "path": path, "batch": batch, "prompt": prompt,
                           "new_tokens": new, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                ours[path] = rec
                yield rec
            if args.skip_hf:
                continue
            try:
                hf = bench_decode_hf(cfg, batch, prompt, new, 1, name)
            except Exception as e:  # transformers or torch missing, or out of memory
                yield {"bench": "decode_hf", "model": name, "batch": batch, "prompt": prompt, "new_tokens": new,
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            mine = ours.get(default) if "step_s" in ours.get(default, {}) else next(
                (r for r in ours.values() if "step_s" in r), None)
            if mine is not None:
                hf["speedup_vs_hf"] = hf["step_s"] / mine["step_s"]
                hf["vs_path"] = mine["path"]
            yield hf
        del params


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from marl_jax.models import decoder

    parts = set(args.parts.split(","))
    small = args.small
    t0 = time.perf_counter()
    dev = device_info(small, args.reps)
    emit(dev, args.out)
    cfg = model_cfg(small)
    if "attention" in parts:
        lengths = [512] if small else [int(x) for x in args.attention_lengths.split(",") if x]
        for rec in bench_attention(small, lengths, args.reps):
            emit(rec, args.out)
    params = jax.jit(lambda k: decoder.init_params(cfg, k, jnp.bfloat16))(jax.random.PRNGKey(0))
    if "decode" in parts:
        for rec in run_decode(args, dev):
            emit(rec, args.out)
    if "update" in parts:
        for rec in bench_update(cfg, params, 2 if small else 16, 16 if small else 256, 32 if small else 512,
                                8 if small else 64, 2 if small else 8, dev, args.reps):
            emit(rec, args.out)
    if "e2e" in parts:
        kind = dev.get("device_kind", "")
        chip = "H200" if "H200" in kind else "H100-80GB" if "H100" in kind else None
        emit(bench_e2e(cfg, jax.device_get(params), small, args.e2e_steps - 1, args.e2e_preset, args.e2e_tasks,
                       args.e2e_new_tokens, chip), args.out)
    emit({"bench": "total", "wall_s": time.perf_counter() - t0}, args.out)


if __name__ == "__main__":
    sys.exit(main())
