"""benchmarks/update_in_run.py parses launch/run.py's config flags and stops on a mistake in one line (the run
itself is a benchmark: `python benchmarks/update_in_run.py --config=configs/orch_workers.py --small`)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "update_in_run.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_help_names_what_it_compares():
    p = run("--help")  # absl's --help (as launch/run.py's) exits 1 after printing
    assert "in_run_over_bench" in p.stdout and "--steps" in p.stdout


def test_an_unknown_config_key_is_one_line_and_exit_2():
    p = run("--config=configs/orch_workers.py", "--config.grpo.micro_bach=4", "--steps=1")
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "micro_bach" in err[0] and "Traceback" not in p.stderr, p.stderr
