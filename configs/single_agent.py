"""single_agent workflow. `python launch/run.py --config=configs/single_agent.py[:<model>,<task>]`; see marl_jax/config.py."""
from marl_jax import config as common


def get_config(arg: str = ""):
    c = common.base_config("single_agent", ('generator',))
    c = common.apply_preset(c, arg)
    return c
