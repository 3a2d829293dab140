"""eval_opt workflow. `python launch/run.py --config=configs/eval_opt.py[:<model>,<task>]`; the preset lives in
marl_jax/configs/eval_opt.py (importable from the installed package)."""
from marl_jax.configs.eval_opt import get_config  # noqa: F401
