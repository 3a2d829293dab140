"""orch_workers workflow. `python launch/run.py --config=configs/orch_workers.py[:<model>,<task>]`; the preset lives in
marl_jax/configs/orch_workers.py (importable from the installed package)."""
from marl_jax.configs.orch_workers import get_config  # noqa: F401
