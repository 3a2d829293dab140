"""Experiment matrices for launch/sweep.py --matrix=configs/matrix.py:<preset>; the presets live in
marl_jax/configs/matrix.py (importable from the installed package)."""
from marl_jax.configs.matrix import CPU_SMALL, LEVERS, LEVERS_CELL, MULTI_AGENT, get_config  # noqa: F401
