"""Run presets, importable from the installed package (configs/*.py in a checkout are thin entry points).

    from marl_jax.configs import get_config
    c = get_config("voting")                     # the embedded CPU run
    c = get_config("voting", "qwen3-1.7b,math")  # reference settings on that model and task
"""
from __future__ import annotations

import importlib

WORKFLOWS = ("single_agent", "eval_opt", "voting", "orch_workers")


def get_config(workflow: str, arg: str = ""):
    """The preset of `configs/<workflow>.py[:arg]` as a ConfigDict."""
    if workflow not in WORKFLOWS:
        raise ValueError(f"unknown workflow {workflow!r}; presets exist for {list(WORKFLOWS)}")
    return importlib.import_module(f"marl_jax.configs.{workflow}").get_config(arg)
