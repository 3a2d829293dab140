"""orch_workers workflow presets: get_config("") is the embedded CPU run, get_config("<model>,<task>") the reference
settings (see marl_jax/config.py). `python launch/run.py --config=configs/orch_workers.py[:<model>,<task>]` reads this."""
from marl_jax import config as common


def get_config(arg: str = ""):
    c = common.base_config("orch_workers", ('orchestrator', 'worker', 'synthesizer'))
    c.workflow_options.variant = "strategies"  # or "decompose"
    c.workflow_options.max_items = 3
    c = common.apply_preset(c, arg)
    return c
