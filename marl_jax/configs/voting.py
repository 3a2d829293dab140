"""voting workflow presets: get_config("") is the embedded CPU run, get_config("<model>,<task>") the reference
settings (see marl_jax/config.py). `python launch/run.py --config=configs/voting.py[:<model>,<task>]` reads this."""
from marl_jax import config as common


def get_config(arg: str = ""):
    c = common.base_config("voting", ('generator', 'aggregator'))
    c.workflow_options.n_votes = 3
    c = common.apply_preset(c, arg)
    return c
