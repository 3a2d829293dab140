"""voting workflow. `python launch/run.py --config=configs/voting.py[:<model>,<task>]`; see marl_jax/config.py."""
from marl_jax import config as common


def get_config(arg: str = ""):
    c = common.base_config("voting", ('generator', 'aggregator'))
    c.workflow_options.n_votes = 3
    c = common.apply_preset(c, arg)
    return c
