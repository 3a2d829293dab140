"""Run a workflow's episodes and print what every agent saw and said.

    python -m marl_jax.rollout --config=configs/voting.py --config.num_tasks=4 [--out=rows.jsonl] [--seed=0]

Any ``--config.<key>=<value>`` override of the config file applies (see marl_jax/config.py). The run
builds the runtime, takes config.num_tasks tasks from the chosen split (--split, --task_offset), runs
config.rollout.group_size episodes of each at config.rollout.temperature, prints one transcript per
episode (prompts, outputs, parsed verdicts / selections / items, rewards, GRPO group keys) and a summary
(success, per-role accuracy, the time split between sampler, host glue and reward), and writes every
row (prompt and completion tokens, log-probs, role, slot, reward, group key) as JSONL to --out.

Compiled programs are cached on disk across runs (see marl_jax.jax_setup; MARL_JAX_CACHE=off disables).

The policy is the base model with freshly initialised trainable parameters (LoRA B = 0, so exactly
the base model's behaviour), or, with --trained_workdir, the ``trainable`` entry of a checkpoint that
training saved there (--step: latest, best or a step number).
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Sequence

from absl import flags
from ml_collections import config_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Register the CLI's flags (only when run as a program, so importing this module has no side effects)."""
    config_flags.DEFINE_config_file(
        "config", None, "Config file, e.g. configs/voting.py (or configs/voting.py:qwen3-1.7b,math).")
    flags.DEFINE_string("out", "rollout_rows.jsonl", "Where to write the rows as JSONL ('' to skip).")
    flags.DEFINE_integer("seed", 0, "PRNG seed of the sampler (and of the fresh trainable init).")
    flags.DEFINE_enum("split", "train", ["train", "val"], "Which task split to take tasks from.")
    flags.DEFINE_integer("task_offset", 0, "Index of the first task taken from the split.")
    flags.DEFINE_integer("max_chars", 0, "Clip prompts and outputs longer than this in transcripts "
                         "(0: print them whole).")
    flags.DEFINE_integer("transcripts", -1, "Print at most this many episode transcripts (-1: all).")
    flags.DEFINE_string("trained_workdir", None, "A training workdir whose checkpoint's trainable "
                        "parameters to sample from (default: the untrained base policy).")
    flags.DEFINE_string("step", "latest", "Checkpoint of --trained_workdir: latest, best or a step number.")


TRAINABLE_KEY = "trainable"  # where the training state keeps the slot-stacked trainable parameters


def load_trainable(workdir: str, step: str, template: Any) -> tuple[Any, int]:
    """(trainable pytree, step) from ``<workdir>/checkpoints``; template: the runtime's fresh trainable.

    Raises ValueError naming the fix when the checkpoint has no trainable entry or its tree or shapes
    differ from what this config builds (another policy, rank, model or trainable mode).
    """
    import jax
    import numpy as np

    from marl_jax.train.checkpoint import Checkpointer

    with Checkpointer(workdir, read_only=True) as ckpt:
        if step == "latest":
            n = ckpt.latest_step()
        elif step == "best":
            n = ckpt.best_step()
        elif step.isdigit():
            n = int(step)
        else:
            raise ValueError(f"--step={step!r}: use latest, best or a step number")
        if n is None:
            raise ValueError(f"no {'best ' if step == 'best' else ''}checkpoint under {workdir!r}/checkpoints; "
                             f"saved steps: {ckpt.all_steps()}")
        state, _ = ckpt.restore(n)
    if not isinstance(state, dict) or TRAINABLE_KEY not in state:
        have = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"checkpoint {n} in {workdir!r} has no {TRAINABLE_KEY!r} entry (it holds {have})")
    got = state[TRAINABLE_KEY]
    want_def, got_def = jax.tree_util.tree_structure(template), jax.tree_util.tree_structure(got)
    if want_def != got_def:
        raise ValueError(f"checkpoint {n} in {workdir!r}: its trainable tree does not match this config's "
                         f"(policy, trainable.mode/targets); pass the config the run was trained with.\n"
                         f"  checkpoint: {got_def}\n  config:     {want_def}")
    bad = [(jax.tree_util.keystr(p), np.shape(g), np.shape(w)) for (p, w), g in
           zip(jax.tree_util.tree_leaves_with_path(template), jax.tree_util.tree_leaves(got))
           if np.shape(g) != np.shape(w)]
    if bad:
        path, g, w = bad[0]
        raise ValueError(f"checkpoint {n} in {workdir!r}: trainable{path} has shape {g}, this config builds {w} "
                         f"({len(bad)} leaves differ); pass the config the run was trained with "
                         "(policy, trainable.rank, model)")
    leaves = [jax.numpy.asarray(g, dtype=w.dtype) for g, w in
              zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(template))]
    return jax.tree_util.tree_unflatten(want_def, leaves), n


def make_policy_sampler(rt, trainable: Any, key: Any):
    """The workflow sample() callable over the runtime's sampler, at the config's rollout settings."""
    from marl_jax.policy.sampling import PolicySampler

    r = rt.config.rollout
    return PolicySampler(rt.sampler, rt.base, trainable, key, temperature=float(r.temperature),
                         top_p=float(r.top_p), top_k=int(r.top_k),
                         stop_ids=tuple(rt.tokenizer.eos_token_ids))


def rollout(rt, tasks: Sequence, sample) -> Any:
    """run_episodes with every option taken from the runtime's config."""
    from marl_jax.workflows.rollout import run_episodes

    return run_episodes(rt.workflow, tasks, int(rt.config.rollout.group_size), sample, rt.tokenizer,
                        role_to_slot=rt.role_to_slot, credit=rt.config.rollout.credit, grade_fn=rt.grade_fn,
                        max_new_tokens=rt.max_new_tokens(), group_by_call_index=rt.group_by_call_index())


def _fmt(x: float) -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else f"{x:.3f}"


def summary(result, roles: Sequence[str], calls: Sequence[dict] = ()) -> str:
    """Success, per-role accuracy / calls / lengths, workflow extras and the time split, as text."""
    m, t = result.metrics, result.timing
    n_ep = len(result.episodes)
    lines = [f"episodes {n_ep}  rows {len(result.rows)}  success {_fmt(m.get('success', math.nan))}  "
             f"solve none/partial/all {_fmt(m['solve_none'])}/{_fmt(m['solve_partial'])}/{_fmt(m['solve_all'])}"]
    lines.append(f"{'role':<14}{'accuracy':>10}{'calls/ep':>10}{'resp len':>10}{'prompt len':>12}{'truncated':>11}")
    for role in roles:
        lines.append(f"{role:<14}{_fmt(m.get(f'{role}/accuracy', math.nan)):>10}"
                     f"{m.get(f'{role}/calls', 0.0):>10.2f}{m.get(f'{role}/response_len', math.nan):>10.1f}"
                     f"{m.get(f'{role}/prompt_len', math.nan):>12.1f}{m.get(f'{role}/truncated', math.nan):>11.2f}")
    per_role = {f"{r}/{k}" for r in roles for k in ("accuracy", "calls", "response_len", "prompt_len", "truncated")}
    extras = {k: v for k, v in m.items()
              if k not in per_role and k not in ("success", "episodes", "solve_none", "solve_all", "solve_partial")}
    if extras:
        lines.append("  ".join(f"{k} {_fmt(float(v))}" for k, v in sorted(extras.items())))
    total = t.get("total_s", 0.0) or 1e-9
    split = "  ".join(f"{k} {t.get(k + '_s', 0.0):.2f}s ({100 * t.get(k + '_s', 0.0) / total:.0f}%)"
                      for k in ("sampler", "glue", "reward"))
    lines.append(f"time {total:.2f}s ({n_ep / total:.2f} episodes/s): {split}")
    if calls:
        tokens = sum(c["tokens"] for c in calls)
        pre = sum(c.get("prefill_s", 0.0) for c in calls)
        dec = sum(c.get("decode_s", 0.0) for c in calls)
        lines.append(f"sampler: {len(calls)} calls, {tokens} tokens generated, prefill {pre:.2f}s, decode {dec:.2f}s")
        for c in calls:
            lines.append(f"  {c['stage']:<14} slot {c['slot']}  {c['rows']:>4} rows  {c['tokens']:>6} tokens  "
                         f"{c['seconds']:.2f}s")
    return "\n".join(lines)


def _fail(message: str) -> None:
    """Exit 2 with one line naming the mistake and the fix (marl_jax.cli: the rule every entry point shares)."""
    from marl_jax.cli import fail

    fail("marl_jax.rollout", message)


def _load_config():
    from marl_jax.config import validate

    config = FLAGS.config
    if config is None:
        _fail("pass --config=configs/<workflow>.py (single_agent, eval_opt, voting, orch_workers)")
    try:
        return validate(config)
    except OSError as e:  # config_flags defers a missing / broken config file to first use
        _fail(str(e))
    except ValueError as e:
        _fail(str(e))


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; flags are written --name=value")
    config = _load_config()
    import jax

    from marl_jax.jax_setup import enable_compilation_cache
    from marl_jax.train.build import build
    from marl_jax.workflows.rollout import format_transcript, rows_to_jsonl

    enable_compilation_cache()  # repeated runs skip XLA compiles (MARL_JAX_CACHE=off disables)

    t0 = time.perf_counter()
    try:
        rt = build(config)
    except (ValueError, FileNotFoundError) as e:  # bad model path, data file, split sizes: say which
        _fail(str(e))
    pool = rt.train_tasks if FLAGS.split == "train" else rt.val_tasks
    start, n = FLAGS.task_offset, int(config.num_tasks)
    tasks = pool[start:start + n]
    if len(tasks) < n:
        _fail(f"the {FLAGS.split} split has {len(pool)} tasks; --task_offset={start} with "
              f"--config.num_tasks={n} runs past its end")
    key_init, key_sample = jax.random.split(jax.random.key(FLAGS.seed))
    trainable = rt.init_trainable(key_init)
    source = "base model (fresh trainable)"
    if FLAGS.trained_workdir:
        try:
            trainable, step = load_trainable(FLAGS.trained_workdir, FLAGS.step, trainable)
        except (ValueError, FileNotFoundError) as e:
            _fail(str(e))
        source = f"{FLAGS.trained_workdir} step {step}"
    print(f"{config.workflow} ({config.policy} policy, slots {rt.role_to_slot}) on {config.model.name}, "
          f"policy: {source}; {len(tasks)} {FLAGS.split} tasks x {config.rollout.group_size} episodes, "
          f"temperature {config.rollout.temperature}; setup {time.perf_counter() - t0:.1f}s", flush=True)

    sample = make_policy_sampler(rt, trainable, key_sample)
    result = rollout(rt, tasks, sample)

    shown = result.episodes if FLAGS.transcripts < 0 else result.episodes[:FLAGS.transcripts]
    for ep in shown:
        print(format_transcript(ep, max_chars=FLAGS.max_chars or None))
        print()
    print("=" * 30 + " summary " + "=" * 30)
    print(summary(result, rt.roles, sample.calls))
    if FLAGS.out:
        out = os.path.abspath(FLAGS.out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        rows_to_jsonl(result.rows, out)
        print(f"wrote {len(result.rows)} rows to {out}")
    sys.stdout.flush()


if __name__ == "__main__":
    from marl_jax.cli import run

    define_flags()
    run(main, "marl_jax.rollout")
