"""Run an experiment matrix cell by cell (each a `launch/run.py` run in <root>/<cell>).

    python launch/sweep.py --matrix=configs/matrix.py:cpu-small --root=runs/cpu-small
    python launch/sweep.py --matrix=configs/matrix.py:paper --root=runs/paper --print_commands   # for a scheduler
    python launch/sweep.py --matrix=configs/matrix.py:cpu-small --root=runs/x --only=voting --dry_run
    python launch/sweep.py ... --matrix.seeds=0,1 --matrix.overrides.train.steps=16 --set=optim.lr=5e-4

Finished cells are skipped and unfinished ones resume in their workdir, so re-running the same command
continues a sweep. Each cell's output goes to <root>/<cell>/run.log (and the terminal); <root>/sweep.jsonl
records every cell's exit code and wall time. A failed cell does not stop the sweep; the exit status is 1
when any cell failed, and the failures are listed at the end.
"""
from __future__ import annotations

import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from absl import flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("matrix", None, "configs/matrix.py:<preset> (paper | cpu-small)", lock_config=True)
flags.DEFINE_string("root", None, "Folder holding one workdir per cell, plus sweep.jsonl.")
flags.DEFINE_bool("print_commands", False, "Print one shell command per cell (run from the repository root); run nothing.")
flags.DEFINE_bool("dry_run", False, "Print each cell's status and what the sweep would do; run nothing.")
flags.DEFINE_string("only", "", "Only cells whose name contains one of these comma-separated substrings.")
flags.DEFINE_multi_string("set", [], "Extra --config.<key>=<value> for every cell, as key=value (repeatable).")
flags.DEFINE_string("python", sys.executable, "Python interpreter for the cells' commands.")
flags.DEFINE_bool("progress", True, "Show a progress bar over cells.")
FLAGS = flags.FLAGS


def _fail(msg: str) -> None:
    from marl_jax.cli import fail

    fail("sweep.py", msg)  # one line, exit status 2 (bad --matrix keys and values: marl_jax.cli.run)


def _extra(sets: list[str]) -> dict[str, str]:
    out = {}
    for s in sets:
        key, eq, value = s.partition("=")
        if not eq or not key:
            raise ValueError(f"--set={s!r}: expected key=value, e.g. --set=optim.lr=5e-4")
        out[key.removeprefix("--config.").removeprefix("config.")] = value
    return out


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}")
    from marl_jax.experiments import matrix as mx

    if FLAGS.matrix is None:
        _fail("--matrix is required, e.g. --matrix=configs/matrix.py:cpu-small")
    if not FLAGS.root:
        _fail("--root is required, e.g. --root=runs/cpu-small")
    root = os.path.abspath(FLAGS.root)
    try:
        cells = mx.select(mx.cells_from(FLAGS.matrix, _extra(FLAGS.set)), FLAGS.only)
        if not cells:
            raise ValueError(f"no cell name contains any of {FLAGS.only.split(',')}")
        steps = {c.name: int(mx.cell_config(c, root).train.steps) for c in cells}  # every command parses
    except ValueError as e:
        _fail(str(e))

    if FLAGS.print_commands:
        print(f"# {len(cells)} cells; run each from {mx.REPO}", file=sys.stderr)
        for c in cells:
            print(shlex.join(mx.cell_command(c, root, FLAGS.python)))
        return 0
    if FLAGS.dry_run:
        for c in cells:
            status = mx.cell_status(os.path.join(root, c.name), steps[c.name])
            action = {"done": "skip", "partial": "resume", "new": "run"}[status]
            print(f"{action:6s} {status:7s} {c.name}  steps={steps[c.name]}")
        return 0

    results = mx.run_sweep(cells, root, python=FLAGS.python, steps=steps, progress=FLAGS.progress)
    ran = [r for r in results if r.action != "skip"]
    print(f"\nsweep: {len(results)} cells, {len(results) - len(ran)} already done, {len(ran)} launched "
          f"({sum(r.wall_s for r in ran):.0f}s); records in {os.path.join(root, mx.SWEEP_FILE)}")
    report = mx.failure_report(results)
    if report:
        print(report, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from marl_jax.cli import run

    run(main, "sweep.py")
