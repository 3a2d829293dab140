"""voting workflow. `python launch/run.py --config=configs/voting.py[:<model>,<task>]`; the preset lives in
marl_jax/configs/voting.py (importable from the installed package)."""
from marl_jax.configs.voting import get_config  # noqa: F401
