"""Train a multi-agent workflow with GRPO.

    python launch/run.py --config=configs/orch_workers.py [--config.policy=isolated] [--workdir=runs/x]
    python launch/run.py --config=configs/voting.py:qwen3-1.7b,math --config.model.name=/ckpts/Qwen3-1.7B

Any config key can be overridden with --config.<key>=<value>; an unknown key or flag and a bad value
stop the run with one line naming it and the fix, and exit status 2 (marl_jax/cli.py). Re-running with
the same --workdir resumes from its last checkpoint; a checkpoint made under another config (anything
but step counts and logging) is refused, listing the differing keys, unless --allow_config_change.
Known bad inputs (task files, model folders, checkpoints, meshes, a full disk) stop the run with one
message naming the fix (MARL_JAX_TRACEBACK=1 shows the traceback too). On several hosts, set
--multihost (or the usual JAX coordinator environment).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "configs/<workflow>.py[:<model>,<task>]", lock_config=True)
flags.DEFINE_string("workdir", None, "Run folder (metrics, checkpoints, summary). Default: runs/<workflow>-<policy>.")
flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() (multi-host TPU/GPU).")
flags.DEFINE_bool("progress", True, "Show a progress bar.")
flags.DEFINE_bool("allow_config_change", False, "Resume a workdir's checkpoint even though the config differs from "
                  "the one it was saved with (beyond step counts and logging).")
FLAGS = flags.FLAGS
# Errors the library raises for bad inputs, each with a message naming the fix: shown without a traceback.
# (UnicodeError and json errors are ValueErrors; CheckpointWriteError is an OSError.)
KNOWN_ERRORS = (ValueError, FileNotFoundError, OSError)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    import jax

    if FLAGS.multihost or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()
    from marl_jax.config import validate
    from marl_jax.jax_setup import enable_compilation_cache, loaded_allocator

    enable_compilation_cache()
    from marl_jax.train.loop import train

    config = FLAGS.config
    try:
        validate(config)
    except ValueError as e:
        raise app.UsageError(str(e))
    workdir = FLAGS.workdir or os.path.join("runs", f"{config.workflow}-{config.policy}")
    print(f"workflow={config.workflow} policy={config.policy} model={config.model.name} "
          f"task={config.task.kind}/{config.task.source} steps={config.train.steps} workdir={workdir} "
          f"allocator={loaded_allocator().split(' ')[0]}")
    try:
        out = train(config, workdir, progress=FLAGS.progress, allow_config_change=FLAGS.allow_config_change)
    except KNOWN_ERRORS as e:
        if os.environ.get("MARL_JAX_TRACEBACK"):
            raise
        print(f"\nerror: {e}", file=sys.stderr)
        sys.exit(2)
    if jax.process_index() == 0:
        print()
        print(out["table"])
        cliff = out["cliff"]
        if cliff is not None:
            print(f"\nterminal cliff: {'detected at step ' + str(cliff.step) if cliff.detected else 'none'} "
                  f"(peak {cliff.peak_value:.3f} at step {cliff.peak_step}, final {cliff.final_value:.3f})")
        print(f"\nsummary, plots and metrics: {workdir}/summary.md, {workdir}/*.png, {workdir}/metrics.jsonl")


if __name__ == "__main__":
    from marl_jax import cli
    from marl_jax.jax_setup import use_fast_allocator

    # restarts once under tcmalloc if installed, else glibc with malloc tunables (MARL_JAX_MALLOC=off: never)
    try:
        use_fast_allocator()
    except FileNotFoundError as e:  # a $MARL_JAX_MALLOC that names no installed allocator
        cli.fail("run.py", e)
    flags.mark_flag_as_required("config")
    cli.run(main, "run.py")
