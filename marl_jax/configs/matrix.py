"""Experiment matrices for `python launch/sweep.py --matrix=configs/matrix.py:<preset> --root=runs/<preset>`.

Presets:
  paper      {eval_opt, voting, orch_workers} x {shared, isolated} x {math, code} x {qwen3-0.6b, 1.7b, 4b} x seed 0,
             plus a single_agent control and a base-model validation (train.steps=0) per task and model.
             Reference hyperparameters (configs/<workflow>.py:<model>,<task>); point them at local files with
             --matrix.model_dir=/ckpts (holding Qwen3-0.6B/ ...) and --matrix.data_dir=/data.
  cpu-small  the same three workflows x {shared, isolated} on the embedded SmolLM2-135M (one-digit sums),
             plus single_agent and base: 8 cells for 2 CPU cores in about an hour. Cell size: CPU_SMALL below.

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


def get_config(arg: str = "cpu-small"):
    arg = arg or "cpu-small"
    if arg == "paper":
        return matrix_config(preset="reference", workflows=MULTI_AGENT, policies=("shared", "isolated"),
                             tasks=("math", "code"), models=("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"), seeds=(0,))
    if arg == "cpu-small":
        return matrix_config(preset="cpu", workflows=MULTI_AGENT, policies=("shared", "isolated"), tasks=("math",),
                             models=("smollm2-135m",), seeds=(0,), overrides=CPU_SMALL)
    raise ValueError(f"configs/matrix.py: unknown preset {arg!r}; use configs/matrix.py:paper or configs/matrix.py:cpu-small")
