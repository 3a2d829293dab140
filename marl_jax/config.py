"""Config schema, defaults and presets shared by every `configs/<workflow>.py:get_config(arg)`.

arg is "" (the embedded offline CPU run) or "<model>,<task>", e.g. "qwen3-1.7b,math". Model presets
point at local Hugging Face folders (no hub here: set --config.model.name=/path/to/Qwen3-1.7B);
task "math" / "code" carry the reference's hyperparameters.
"""
from __future__ import annotations

import ml_collections

# Reference hyperparameters (see docs): 64 tasks x 8 episodes, T=0.7, LoRA r64/a32, AdamW 2e-5.
MODELS = {
    "smollm2-135m": "smollm2-135m-instruct",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-4b": "Qwen/Qwen3-4B",
}
TASKS = ("math", "code", "cpu")


def base_config(workflow: str, roles: tuple[str, ...]) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.preset = ""
    c.workflow = workflow
    c.workflow_options = ml_collections.ConfigDict()
    c.workflow_options.prompt_dir = ""  # "" packaged reference prompts | "compact" | a folder with <kind>.json
    c.policy = "shared"  # "shared" (SP) | "isolated" (IP)

    c.model = ml_collections.ConfigDict(dict(name="smollm2-135m-instruct", dtype="float32"))
    # auto | float32 | bfloat16: how the frozen base weights are held (dtype above is the compute dtype; each
    # weight is cast to it at use). auto keeps a bfloat16 checkpoint in bfloat16 (lossless, half the bytes) and
    # anything else (float32, dequantized GGUF) in float32; what is trained is float32 whatever this says
    c.model.param_dtype = "auto"
    # auto | dense | blockwise | splash | cudnn: how attention is computed (marl_jax.models.attention; auto picks
    # per backend and length); every choice computes the same values
    c.model.attention = "auto"
    c.trainable = ml_collections.ConfigDict(dict(mode="lora", rank=64, alpha=32.0, targets="all"))

    c.task = ml_collections.ConfigDict(dict(
        kind="math",
        source="reasoning_gym",  # reasoning_gym | file | humaneval | code_file
        name="basic_arithmetic",  # reasoning-gym dataset
        difficulty=ml_collections.ConfigDict(dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)),
        path="",  # JSONL / parquet for source=file / code_file
        question_key="problem", answer_key="answer", tests_key="tests", id_key="",
        size=2000,  # tasks generated / read
        val_size=64,  # held-out tasks for validation
        extraction="boxed",  # boxed | last_number | boxed_or_last_number
        code_timeout_s=3.0,
    ))
    c.num_tasks = 64  # tasks per step; each is run group_size times
    c.rollout = ml_collections.ConfigDict(dict(
        group_size=8, temperature=0.7, top_p=1.0, top_k=0, credit="broadcast",
        group_by_call_index="auto",  # auto (the workflow's default) | true | false
        max_new_tokens=ml_collections.ConfigDict({r: 1024 for r in roles}),
        # The longest prompt before any earlier stage's output (system prompt, instructions, problem) that the
        # run's compiled shapes are sized for: the update pads every row to this plus the workflow's completion
        # limits along its stages, bucketed (marl_jax.plan.update_lengths), so its programs come from one set
        # compiled before the first step; a longer prompt still runs, compiling what it needs when met
        # (compile_s in metrics.jsonl). The planner's default --prompt_tokens.
        prompt_tokens=512,
        max_batch=256,
        # KV cache: dense (rows x (prompt + max new tokens) slots) or paged (blocks of kv_block slots from one
        # pool, held only where rows have tokens; same completions, less memory); auto: paged on TPU, where
        # decode reads the pool in place (marl_jax.generate.buckets.paged_by_default), dense elsewhere
        paged_kv="auto", kv_block=16,
        # What keys and values are stored in: auto = model.dtype; bfloat16 halves the cache under float32
        # compute (they are read back in model.dtype), and TPU paged decode's kernel needs a bfloat16 pool
        kv_dtype="auto",
        # Compaction of finished rows moves through 2 batch sizes per octave; a tail still decoding after
        # compaction_patience steps is fitted to compaction_buckets sizes per octave (marl_jax.generate.sampler).
        # Each size is a decode program to compile (train.warmup compiles them all before the first step): 2
        # (the coarse grid only) computes ~10% more row-steps on a long tail than 16 and compiles a fifth as many
        # (docs/sampler.md#compiled-shapes)
        compaction_buckets=2, compaction_patience=64,
        # Prompts are prefilled in chunks of at most prefill_chunk tokens against the cache: prefill memory
        # grows linearly with the prompt, not quadratically; same completions (marl_jax.generate.prefill)
        prefill_chunk=2048,
        # KV budget (vLLM's memory-bounded scheduling): > 0 fixes the paged pool at this many GiB per device
        # (the cache is then paged); rows are admitted while their blocks fit and, when the pool runs dry
        # mid-decode, the last admitted rows are preempted and later recomputed: same completions. max_batch is
        # the most rows decoding at once (vLLM's max_num_seqs); max_batched_tokens > 0 caps the prompt tokens a
        # refill prefills next to the running rows' decode tokens (vLLM's max_num_batched_tokens). 0: off.
        kv_budget_gb=0.0, max_batched_tokens=0,
    ))
    c.advantage = ml_collections.ConfigDict(dict(standardize=True, eps=1e-6))
    c.grpo = ml_collections.ConfigDict(dict(
        clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="seq-mean-token-mean",
        kl_coef=ml_collections.ConfigDict({r: 0.0 for r in roles}), kl_estimator="k3",
        entropy_coef=0.0, old_logp="sampler", micro_batch=8, diagnostics=True, diagnostics_every=1,
        metrics=True, copy_alignment=True,
        remat="full",  # none | dots | full: what the backward pass recomputes (memory vs ~20% more flops);
        # auto: per token window, the least recomputation whose activations fit remat_budget_gb (marl_jax.rl.memory)
        remat_budget_gb=4.0,
        # Sequence packing: a micro-batch's rows laid end to end in fewer sequences (attention never crosses
        # rows), fewer positions computed when rows are uneven; more compiled branches (marl_jax.rl.update)
        packing=False,
        # With packing: rows of a micro-batch that start with the same share_prefix+ tokens (a task's
        # episodes, a role's instructions) are laid over one copy of that prefix, computed once (0: off)
        share_prefix=0,
        # The layers as straight-line code instead of a loop: no per-layer copies of activations through the
        # loop's stacked buffers in the backward pass, about twice the compile time (marl_jax.models.decoder)
        unroll=False,
        # Token window sizes per octave for the update's micro-batches (marl_jax.rl.update.length_ladder): a
        # finer grid computes less padding and compiles more item programs over a run
        length_grid=2,
        # Token-budget micro-batches (verl's use_dynamic_bsz): each update micro-batch holds as many rows of one
        # role group as this many computed positions allow (one long row alone, many short ones together)
        # instead of micro_batch rows; same loss and gradients (marl_jax.rl.layout.budget_items). 0: off
        max_tokens_per_micro_batch=0,
        # Truncated importance sampling (verl's tis_imp_ratio_cap, TRL's vllm_importance_sampling_cap): each
        # token's policy-gradient term times min(p_trainer / p_sampler, tis_cap), no gradient through it, where
        # the sampler's log-prob and the trainer's recomputation of it differ (bfloat16 rollouts, another
        # attention kernel); needs old_logp=recompute. 0: off (docs/levers.md#sampler-and-trainer-log-probs)
        tis_cap=0.0,
    ))
    c.optim = ml_collections.ConfigDict(dict(
        lr=2e-5, weight_decay=0.01, grad_clip=1.0, schedule="constant", warmup_steps=0, min_lr_ratio=0.0))
    c.train = ml_collections.ConfigDict(dict(
        steps=300, seed=0, val_every=10, val_temperature=0.7, val_samples=1, ckpt_every=10, keep_ckpts=3,
        cliff_drop=0.15, cliff_patience=3, stop_on_cliff=False, restore_best_on_cliff=True,
        tensorboard=True, plots=True,
        # Compile the update's programs (every item shape the config allows, rl.layout.update_shapes) before the
        # first step, so that no later step compiles one (compile_s in metrics.jsonl)
        warmup=True,
    ))
    # Levers on each role's exact gradient before clipping (formulas: marl_jax/rl/levers.py). damping: lambda
    # of gradient-coherence damping (0 = off) over an EMA of damping_window steps; fanout: none | inverse |
    # inverse_sqrt (a role with k parallel copies steps by 1/k or 1/sqrt(k)); balance: none | equal | weights |
    # capped (Shared-Policy: each role's share of its slot's gradient mass). Need grpo.diagnostics_every=1.
    c.levers = ml_collections.ConfigDict(dict(
        damping=0.0, damping_window=64, fanout="none", balance="none",
        balance_weights=ml_collections.ConfigDict({r: 1.0 for r in roles}), balance_cap=0.5))
    # Devices: data x fsdp x model (data=-1: all the rest). rules: a preset of
    # marl_jax.models.sharding.RULES, optionally with overrides ("fsdp_tp;vocab=none").
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, model=1, rules="fsdp_tp"))
    return c


def apply_preset(c: ml_collections.ConfigDict, arg: str) -> ml_collections.ConfigDict:
    """"" -> embedded CPU run; "<model>,<task>" -> reference settings on that model and task."""
    c.preset = arg or "cpu"
    if not arg:
        return cpu_default(c)
    parts = [p.strip() for p in arg.split(",")]
    if len(parts) != 2 or parts[0] not in MODELS or parts[1] not in ("math", "code"):
        raise ValueError(f"config argument {arg!r}: expected '<model>,<task>' with model in {sorted(MODELS)} "
                         "and task in ['math', 'code'], e.g. configs/voting.py:qwen3-1.7b,math "
                         "(or no argument for the embedded CPU run)")
    model, task = parts
    c.model.name = MODELS[model]
    c.model.dtype = "bfloat16" if model.startswith("qwen3") else "float32"
    c.num_tasks = 64
    c.rollout.group_size = 8
    c.train.steps = 300
    if task == "math":
        c.task.update(kind="math", source="file", path="data/dapo_math_17k.parquet", question_key="prompt",
                      answer_key="reward_model.ground_truth", extraction="boxed", size=17000, val_size=500)
        for r in c.rollout.max_new_tokens:
            c.rollout.max_new_tokens[r] = 5120
    else:
        c.task.update(kind="code", source="code_file", path="data/deepcoder_train.jsonl", question_key="problem",
                      tests_key="tests", size=24000, val_size=256)
        for r in c.rollout.max_new_tokens:
            c.rollout.max_new_tokens[r] = 2048
    return c


def cpu_default(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The embedded offline run: SmolLM2-135M on one-digit additions, sized for 2 CPU cores.

    The 135M model rarely boxes its answer, so the reward reads the last number; compact prompts,
    32-token completions and 4 tasks x 4 episodes keep a step near a minute; 6 steps with greedy
    validation on 32 held-out tasks at steps 0, 3 and 6.
    """
    c.workflow_options.prompt_dir = "compact"  # short prompts: a third fewer tokens to prefill and train on
    c.task.update(extraction="last_number", size=512, val_size=32)
    c.task.difficulty.update(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",),
                             allow_parentheses=False, allow_negation=False)
    c.num_tasks = 4
    c.rollout.group_size = 4
    for r in c.rollout.max_new_tokens:
        c.rollout.max_new_tokens[r] = 32
    # The first call's compact prompt: 39-41 tokens (single_agent, voting, eval_opt), 70-72 (orch_workers'
    # orchestrator); later stages quote earlier outputs in longer templates: the slack of 96 holds them. The
    # sampler pads every prompt to it and the update's rows are sized from it.
    c.rollout.prompt_tokens = 48 if c.workflow == "single_agent" else 96
    c.trainable.update(rank=8, alpha=16.0)
    c.optim.update(lr=3e-4, grad_clip=1.0)  # 1e-3 collapsed to guessed one-line answers within 7 steps
    # Short sequences: keep the matmul activations (remat "dots") instead of recomputing whole layers. A
    # task's episodes and a role's rows share long prompt prefixes: packed over one copy of each, the update
    # computes half the positions (same loss and gradients). Items of up to 1,024 positions, packed across
    # groups, instead of 8 rows each: 1.6x faster on the peers' short workload (benchmarks/update_anatomy.py).
    c.grpo.update(micro_batch=8, remat="dots", packing=True, share_prefix=16, max_tokens_per_micro_batch=1024)
    c.train.update(steps=6, val_every=3, ckpt_every=3, val_temperature=0.0)
    return c


def paged_kv(config, backend: str) -> bool:
    """Whether the sampler's KV cache is paged on `backend`: rollout.paged_kv (auto | true | false), and always
    under a KV budget."""
    from marl_jax.generate.buckets import paged_by_default
    want = str(config.rollout.get("paged_kv", "auto")).lower()
    paged = paged_by_default(backend) if want == "auto" else want == "true"
    return paged or float(config.rollout.get("kv_budget_gb", 0.0)) > 0


def kv_dtype(config) -> str:
    """The dtype the sampler stores keys and values in: rollout.kv_dtype, auto meaning model.dtype."""
    want = config.rollout.get("kv_dtype", "auto")
    return config.model.dtype if want == "auto" else want


_CHOICES = {
    "workflow": ("single_agent", "eval_opt", "voting", "orch_workers"),
    "policy": ("shared", "isolated"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("auto", "float32", "bfloat16"),
    "rollout.kv_dtype": ("auto", "float32", "bfloat16"),
    "model.attention": ("auto", "dense", "blockwise", "splash", "cudnn"),
    "trainable.mode": ("lora", "full"),
    "task.kind": ("math", "code"),
    "task.source": ("reasoning_gym", "file", "humaneval", "code_file"),
    "task.extraction": ("boxed", "last_number", "boxed_or_last_number"),
    "rollout.credit": ("broadcast", "per_agent"),
    "grpo.agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "grpo.kl_estimator": ("k1", "k3", "low_var"),
    "levers.fanout": ("none", "inverse", "inverse_sqrt"),
    "levers.balance": ("none", "equal", "weights", "capped"),
    "grpo.old_logp": ("sampler", "recompute"),
    "grpo.remat": ("none", "dots", "full", "auto"),
    "optim.schedule": ("constant", "warmup_cosine"),
}
_POSITIVE = ("num_tasks", "rollout.group_size", "rollout.max_batch", "rollout.kv_block", "rollout.compaction_buckets",
             "rollout.compaction_patience", "rollout.prefill_chunk", "grpo.micro_batch", "train.val_every", "train.ckpt_every", "trainable.rank", "task.size",
             "train.val_samples", "levers.damping_window", "grpo.length_grid")


def _get(c, dotted):
    for k in dotted.split("."):
        c = c[k]
    return c


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Raise ValueError naming the key and the fix for values the trainer cannot use."""
    errors = []
    for key, choices in _CHOICES.items():
        v = _get(c, key)
        if v not in choices:
            errors.append(f"--config.{key}={v!r} is not one of {list(choices)}")
    for key in _POSITIVE:
        if _get(c, key) < 1:
            errors.append(f"--config.{key} must be >= 1, got {_get(c, key)}")
    if c.train.steps < 0:
        errors.append(f"--config.train.steps must be >= 0, got {c.train.steps}")
    if c.rollout.group_size < 2:
        errors.append(f"--config.rollout.group_size={c.rollout.group_size}: GRPO needs >= 2 episodes per task "
                      "(a group of one has advantage 0)")
    if not 0.0 < c.rollout.top_p <= 1.0:
        errors.append(f"--config.rollout.top_p must be in (0, 1], got {c.rollout.top_p}")
    if c.rollout.temperature < 0:
        errors.append(f"--config.rollout.temperature must be >= 0, got {c.rollout.temperature}")
    if str(c.rollout.paged_kv).lower() not in ("auto", "true", "false"):
        errors.append(f"--config.rollout.paged_kv must be auto, true or false, got {c.rollout.paged_kv!r}")
    if str(c.rollout.group_by_call_index).lower() not in ("auto", "true", "false"):
        errors.append(f"--config.rollout.group_by_call_index must be auto, true or false, "
                      f"got {c.rollout.group_by_call_index!r}")
    if c.grpo.share_prefix < 0:
        errors.append(f"--config.grpo.share_prefix must be >= 0 (0 = off), got {c.grpo.share_prefix}")
    elif c.grpo.share_prefix and not c.grpo.packing:
        errors.append(f"--config.grpo.share_prefix={c.grpo.share_prefix} lays rows over shared prefixes in packed "
                      "sequences: add --config.grpo.packing=true")
    for key in ("kv_budget_gb", "max_batched_tokens"):
        if c.rollout[key] < 0:
            errors.append(f"--config.rollout.{key} must be >= 0 (0 = off), got {c.rollout[key]}")
    if c.grpo.max_tokens_per_micro_batch < 0:
        errors.append("--config.grpo.max_tokens_per_micro_batch must be >= 0 (0 = off: grpo.micro_batch rows per "
                      f"micro-batch), got {c.grpo.max_tokens_per_micro_batch}")
    tis_cap = c.grpo.get("tis_cap", 0.0)
    if tis_cap < 0:
        errors.append(f"--config.grpo.tis_cap must be >= 0 (0 = off), got {tis_cap}")
    elif tis_cap and c.grpo.old_logp != "recompute":
        errors.append(f"--config.grpo.tis_cap={tis_cap} weights the PPO ratio against the trainer's own old log-probs "
                      "by the trainer-to-sampler ratio: add --config.grpo.old_logp=recompute")
    if int(c.rollout.get("prompt_tokens", 512)) < 1:
        errors.append(f"--config.rollout.prompt_tokens must be >= 1, got {c.rollout.prompt_tokens}")
    if c.optim.lr <= 0:
        errors.append(f"--config.optim.lr must be > 0, got {c.optim.lr}")
    if c.task.source in ("file", "code_file") and not c.task.path:
        errors.append(f"task.source={c.task.source} needs --config.task.path=/path/to/data.jsonl")
    if c.task.kind == "code" and c.task.source in ("reasoning_gym", "file"):
        errors.append(f"task.kind=code needs --config.task.source=humaneval or code_file, not {c.task.source}")
    if c.task.kind == "math" and c.task.source in ("humaneval", "code_file"):
        errors.append(f"task.kind=math needs --config.task.source=reasoning_gym or file, not {c.task.source}")
    for k, v in c.grpo.kl_coef.items():
        if v < 0:
            errors.append(f"--config.grpo.kl_coef.{k} must be >= 0, got {v}")
    lv = c.levers
    if not 0.0 <= lv.damping <= 1.0:
        errors.append(f"--config.levers.damping (lambda) must be in [0, 1], got {lv.damping}")
    if lv.balance == "capped" and not 0.0 < lv.balance_cap <= 1.0:
        errors.append(f"--config.levers.balance_cap must be in (0, 1], got {lv.balance_cap}")
    if lv.balance == "weights" and (min(lv.balance_weights.values(), default=0.0) < 0
                                    or sum(lv.balance_weights.values()) <= 0):
        errors.append("--config.levers.balance=weights needs --config.levers.balance_weights.<role> >= 0, not all 0")
    if lv.balance != "none" and c.policy == "isolated":
        errors.append(f"--config.levers.balance={lv.balance} balances roles that share a slot; under "
                      "policy=isolated every slot holds one role: use --config.policy=shared or balance=none")
    levers_on = lv.damping > 0 or lv.balance != "none" or lv.fanout != "none"
    if levers_on and not (c.grpo.diagnostics and c.grpo.diagnostics_every == 1):
        errors.append("levers act on the exact per-role gradients: set --config.grpo.diagnostics=True and "
                      "--config.grpo.diagnostics_every=1 (or turn the levers off)")
    for k, v in c.rollout.max_new_tokens.items():
        if v < 1:
            errors.append(f"--config.rollout.max_new_tokens.{k} must be >= 1, got {v}")
    for key in ("fsdp", "model"):
        if c.mesh[key] < 1:
            errors.append(f"--config.mesh.{key} must be >= 1, got {c.mesh[key]}")
    if c.mesh.data < 1 and c.mesh.data != -1:
        errors.append(f"--config.mesh.data must be >= 1 or -1 (every device left), got {c.mesh.data}")
    try:
        from marl_jax.models.sharding import parse_rules
        parse_rules(c.mesh.rules)
    except ValueError as e:
        errors.append(f"--config.mesh.rules: {e}")
    if errors:
        raise ValueError("invalid config:\n  " + "\n  ".join(errors))
    return c
