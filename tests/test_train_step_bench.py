"""benchmarks/train_step.py at a tiny size, packed over shared prefixes as the README's headline row runs it:
it finishes, both implementations compute the same first-step loss, and it prints each side's peak memory and
its ratio (the figures themselves are the benchmark's, not a test's)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_tiny_packed_run_agrees_with_pytorch_and_prints_memory():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--rows=4", "--episodes=2",
                        "--prompt_len=24", "--completion_len=8", "--micro_batch=2", "--packing", "--share_prefix=4",
                        "--remat=dots", "--reps=1", "--diag_reps=0", "--unpacked"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    out = p.stdout
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"^speedup=\d+\.\d+$", out, re.M), out[-2000:]
    assert "WARNING: the two first-step losses differ" not in out
    mem = re.search(r"peak resident memory .*: marl_jax ([\d.]+) GB.*, pytorch ([\d.]+) GB", out)
    assert mem and float(mem.group(1)) > 0 and float(mem.group(2)) > 0, out[-2000:]
    assert "packing_speedup=" in out
