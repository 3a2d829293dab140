"""single_agent workflow. `python launch/run.py --config=configs/single_agent.py[:<model>,<task>]`; the preset lives in
marl_jax/configs/single_agent.py (importable from the installed package)."""
from marl_jax.configs.single_agent import get_config  # noqa: F401
