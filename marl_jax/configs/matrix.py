"""Experiment matrices for `python launch/sweep.py --matrix=configs/matrix.py:<preset> --root=runs/<preset>`.

Presets:
  paper      {eval_opt, voting, orch_workers} x {shared, isolated} x {math, code} x {qwen3-0.6b, 1.7b, 4b} x seed 0,
             plus a single_agent control and a base-model validation (train.steps=0) per task and model.
             Reference hyperparameters (configs/<workflow>.py:<model>,<task>); point them at local files with
             --matrix.model_dir=/ckpts (holding Qwen3-0.6B/ ...) and --matrix.data_dir=/data.
  cpu-small  the same three workflows x {shared, isolated} on the embedded SmolLM2-135M (one-digit sums),
             plus single_agent and base: 8 cells for 2 CPU cores in about an hour. Cell size: CPU_SMALL below.
  levers     the levers of marl_jax/rl/levers.py where their mechanism applies: {voting, orch_workers} x
             Shared {baseline, balance (equal gradient-mass shares), fanout (1/k), damping (lambda 0.3)} +
             Isolated {baseline, damping} x seeds 0, 1, 2 on the cpu-small cell, validated at temperature
             0.7 with 2 samples on each of 64 tasks at steps 0 and 6: 36 cells, 7-8 minutes each on this
             idle 2-core machine (about 50 on a loaded one).

Any field can be overridden: --matrix.seeds=0,1,2  --matrix.workflows=voting,eval_opt  --matrix.base=false
--matrix.overrides.train.steps=16 (keys already in the preset's overrides; launch/sweep.py --set=key=value adds others).
"""
from marl_jax.experiments.matrix import matrix_config

MULTI_AGENT = ("eval_opt", "voting", "orch_workers")

# Every cpu-small cell gets these (on top of the embedded preset); sized for ~5-8 minutes a cell on 2 cores.
CPU_SMALL = {
    "train.steps": 6,
    "train.val_every": 3,
    "train.ckpt_every": 3,
    "num_tasks": 4,
    "rollout.group_size": 4,
    "task.val_size": 32,
}


# Validation for error bars: pass@1 as the mean of 2 samples at T=0.7 on each of 64 held-out tasks.
LEVERS_CELL = {**CPU_SMALL, "train.val_every": 6, "train.ckpt_every": 6, "task.val_size": 64,
               "train.val_temperature": 0.7, "train.val_samples": 2, "grpo.diagnostics_every": 1}
LEVERS = {  # variant -> (policies, overrides)
    "baseline": (("shared", "isolated"), {}),
    "balance": (("shared",), {"levers.balance": "equal"}),
    "fanout": (("shared",), {"levers.fanout": "inverse"}),
    "damping": (("shared", "isolated"), {"levers.damping": 0.3, "levers.damping_window": 4}),
}


def get_config(arg: str = "cpu-small"):
    arg = arg or "cpu-small"
    if arg == "paper":
        return matrix_config(preset="reference", workflows=MULTI_AGENT, policies=("shared", "isolated"),
                             tasks=("math", "code"), models=("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"), seeds=(0,))
    if arg == "cpu-small":
        return matrix_config(preset="cpu", workflows=MULTI_AGENT, policies=("shared", "isolated"), tasks=("math",),
                             models=("smollm2-135m",), seeds=(0,), overrides=CPU_SMALL)
    if arg == "levers":
        return matrix_config(preset="cpu", workflows=("voting", "orch_workers"), policies=("shared", "isolated"),
                             tasks=("math",), models=("smollm2-135m",), seeds=(0, 1, 2), single_agent=False,
                             base=False, overrides=LEVERS_CELL, variants=LEVERS)
    raise ValueError(f"configs/matrix.py: unknown preset {arg!r}; use configs/matrix.py:paper, "
                     "configs/matrix.py:cpu-small or configs/matrix.py:levers")
