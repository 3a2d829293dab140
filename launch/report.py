"""Report of a sweep: heatmaps against the base model, Isolated vs Shared, curves, cliffs, every number.

    python launch/report.py --root=runs/cpu-small --out=docs/results/cpu-small

Reads every run folder ``<root>/<cell>/`` (cell.json / config.json + metrics.jsonl) and writes
``<out>/README.md``, ``<out>/cells.csv`` and the figures. Cells without metrics or whose run failed
are listed as missing in the README.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from absl import app, flags

from marl_jax.train.cliff import DEFAULTS

flags.DEFINE_string("root", None, "Sweep folder holding one run folder per cell.", required=True)
flags.DEFINE_string("out", None, "Report folder (created). Default: <root>/report.")
flags.DEFINE_enum("base", "cell", ["cell", "step0"],
                  "Base model accuracy: a matching base cell when present, else step 0 (cell); or always step 0.")
flags.DEFINE_float("cliff_drop", float(DEFAULTS["drop"]), "Accuracy drop from the running peak that counts as a cliff.")
flags.DEFINE_bool("include_incomplete", False, "Also use runs whose metrics stop early in the figures.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    from marl_jax.experiments.report import write_report

    out = FLAGS.out or os.path.join(FLAGS.root, "report")
    try:
        res = write_report(FLAGS.root, out, base_from=FLAGS.base, include_incomplete=FLAGS.include_incomplete,
                           cliff_drop=FLAGS.cliff_drop)
    except FileNotFoundError as e:
        raise app.UsageError(str(e))
    n = len(res["summaries"])
    print(f"{n} cells, {len(res['pairs'])} matched shared/isolated pairs, {len(res['missing'])} missing, failed "
          f"or incomplete")
    for s in res["summaries"]:
        if s["status"] != "ok":
            print(f"  {s['name']}: {s['status']} ({s['problem']})")
    print(f"report: {res['readme']} ({len(res['files'])} files)")


if __name__ == "__main__":
    from marl_jax.cli import run

    run(main, "report.py")
