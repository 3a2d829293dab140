"""Experiment matrices: the cells of a sweep, their launch commands, their status, and a sequential runner.

A matrix (see configs/matrix.py) is a ConfigDict of axes (workflows x policies x tasks x models x seeds)
plus controls (a single-agent run and a base-model validation per task, model and seed) and config
overrides shared by every cell. Each cell is one `launch/run.py` run in `<root>/<cell.name>`; a sweep
runs the cells one after another, skips finished ones and relaunches unfinished ones in their old
workdir (run.py resumes from the last checkpoint).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_SCRIPT = "launch/run.py"  # relative to the repository root, where cells run
WORKFLOWS = ("single_agent", "eval_opt", "voting", "orch_workers")
POLICIES = ("shared", "isolated")
TASKS = ("math", "code")
PRESETS = ("reference", "cpu")  # configs/<wf>.py:<model>,<task> | configs/<wf>.py (the embedded CPU run)
CPU_MODEL, CPU_TASK = "smollm2-135m", "math"  # what the bare config file runs
KINDS = ("train", "base")
CELL_FILE, LOG_FILE, SWEEP_FILE = "cell.json", "run.log", "sweep.jsonl"
_AXES = ("workflows", "policies", "tasks", "models", "seeds")
# Files the sweep itself writes into a workdir; anything else means run.py got going.
_SWEEP_FILES = (CELL_FILE, LOG_FILE)

__all__ = ["Cell", "CellResult", "matrix_config", "cells_from", "cell_command", "cell_config", "cell_status",
           "write_cell_json", "run_sweep", "failure_report", "flatten", "nest", "select", "error_text"]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the matrix. `config_arg` is what follows `configs/<workflow>.py:` ("" = the embedded CPU run)."""

    name: str
    workflow: str
    policy: str
    task: str
    model: str
    seed: int
    kind: str  # "train" | "base" (validation of the untrained model: train.steps=0)
    overrides: Mapping[str, Any]  # dotted config key -> value, passed as --config.<key>=<value>
    config_arg: str = ""
    variant: str = ""  # name of the matrix variant (e.g. a lever setting); "" without variants

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["overrides"] = dict(self.overrides)
        return d


# ----------------------------------------------------------------------------------------------- matrix


def nest(flat: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """{"train.steps": 8} -> ConfigDict(train=ConfigDict(steps=8)), so `--matrix.overrides.train.steps=16` works."""
    out: dict[str, Any] = {}
    for key, v in flat.items():
        d = out
        *parents, leaf = key.split(".")
        for p in parents:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ValueError(f"override {key!r} nests under a key that already has a value")
        d[leaf] = v
    return ml_collections.ConfigDict(out)


def flatten(c: Mapping[str, Any] | ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    """The inverse of `nest`: nested dicts -> {"a.b": value}."""
    items = c.items() if not isinstance(c, ml_collections.ConfigDict) else c.to_dict().items()
    out: dict[str, Any] = {}
    for k, v in items:
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def matrix_config(*, preset: str = "reference", workflows: Sequence[str] = ("eval_opt", "voting", "orch_workers"),
                  policies: Sequence[str] = POLICIES, tasks: Sequence[str] = TASKS,
                  models: Sequence[str] = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"), seeds: Sequence[int] = (0,),
                  single_agent: bool = True, base: bool = True, model_dir: str = "", data_dir: str = "",
                  overrides: Mapping[str, Any] | None = None,
                  variants: Mapping[str, tuple[Sequence[str], Mapping[str, Any]]] | None = None
                  ) -> ml_collections.ConfigDict:
    """A matrix ConfigDict. Axes are tuples (overridable as `--matrix.seeds=0,1`); `overrides` is a flat
    {"train.steps": 8} dict applied to every cell (stored nested: `--matrix.overrides.train.steps=16`).

    model_dir: folder holding the reference checkpoints by their Hugging Face folder name (model.name becomes
    <model_dir>/Qwen3-1.7B); data_dir: folder holding the reference data files (task.path becomes
    <data_dir>/dapo_math_17k.parquet). Empty: the presets' own values.
    """
    m = ml_collections.ConfigDict()
    m.preset = preset
    m.workflows, m.policies, m.tasks = tuple(workflows), tuple(policies), tuple(tasks)
    m.models, m.seeds = tuple(models), tuple(seeds)
    m.single_agent = single_agent  # add a single_agent (shared) control per task, model and seed
    m.base = base  # add a base-model validation (train.steps=0) per task, model and seed
    m.model_dir = model_dir
    m.data_dir = data_dir
    m.overrides = nest(dict(overrides or {}))
    if variants:  # name -> (policies it runs under, flat overrides): one cell per variant per policy
        m.variants = ml_collections.ConfigDict({
            name: dict(policies=tuple(pols), overrides=nest(dict(ov))) for name, (pols, ov) in variants.items()})
    return m


def _axis(m, name: str) -> list:
    """An axis as a list; "a,b" items (from `--matrix.workflows=a,b`) are split."""
    v = m[name]
    items = [v] if isinstance(v, (str, int)) else list(v)
    out = []
    for it in items:
        if isinstance(it, str):
            out.extend(p.strip() for p in it.split(",") if p.strip())
        else:
            out.append(it)
    return out


def _check_matrix(m) -> dict[str, list]:
    from marl_jax.config import MODELS

    missing = [k for k in ("preset", *_AXES, "single_agent", "base", "model_dir", "data_dir", "overrides") if k not in m]
    if missing:
        raise ValueError(f"matrix config lacks {missing}; build it with marl_jax.experiments.matrix.matrix_config()")
    ax = {k: _axis(m, k) for k in _AXES}
    errors = []
    if m.preset not in PRESETS:
        errors.append(f"--matrix.preset={m.preset!r} is not one of {list(PRESETS)}")
    for key, choices in (("workflows", WORKFLOWS), ("policies", POLICIES), ("tasks", TASKS), ("models", tuple(MODELS))):
        bad = [v for v in ax[key] if v not in choices]
        if bad:
            errors.append(f"--matrix.{key}: {bad} not in {list(choices)}")
        if len(set(ax[key])) != len(ax[key]):
            errors.append(f"--matrix.{key} repeats a value: {ax[key]}")
    try:
        ax["seeds"] = [int(s) for s in ax["seeds"]]
    except (TypeError, ValueError):
        errors.append(f"--matrix.seeds must be integers, e.g. --matrix.seeds=0,1,2; got {ax['seeds']}")
    for key in _AXES:
        if not ax[key] and not (key in ("workflows", "policies") and (m.single_agent or m.base)):
            errors.append(f"--matrix.{key} is empty")
    if m.preset == "cpu":
        if ax["models"] != [CPU_MODEL] or ax["tasks"] != [CPU_TASK]:
            errors.append(f"preset=cpu runs the embedded {CPU_MODEL} on {CPU_TASK}: set --matrix.models={CPU_MODEL} "
                          f"--matrix.tasks={CPU_TASK}, or --matrix.preset=reference for {ax['models']} x {ax['tasks']}")
        if m.model_dir or m.data_dir:
            errors.append("model_dir / data_dir apply to preset=reference only")
    if errors:
        raise ValueError("invalid matrix:\n  " + "\n  ".join(errors))
    return ax


def _reference_paths(m, model: str, task: str) -> dict[str, Any]:
    """model.name / task.path overrides that point the reference presets at local folders."""
    from marl_jax import config as common

    out: dict[str, Any] = {}
    if m.preset != "reference":
        return out
    if m.model_dir:
        out["model.name"] = os.path.join(m.model_dir, common.MODELS[model].split("/")[-1])
    if m.data_dir:
        c = common.apply_preset(common.base_config("single_agent", ("generator",)), f"{model},{task}")
        out["task.path"] = os.path.join(m.data_dir, os.path.basename(c.task.path))
    return out


def cells_from(m: ml_collections.ConfigDict, extra_overrides: Mapping[str, Any] | None = None) -> list[Cell]:
    """Every cell of matrix `m`, seed-major (all of seed 0 first), then model, task: base, single_agent,
    then workflows x policies. `extra_overrides` ({"train.steps": 4}) go after the matrix's own."""
    ax = _check_matrix(m)
    shared = {**flatten(m.overrides), **dict(extra_overrides or {})}
    cells: list[Cell] = []
    for seed in ax["seeds"]:
        for model in ax["models"]:
            for task in ax["tasks"]:
                arg = "" if m.preset == "cpu" else f"{model},{task}"
                ov = {**shared, **_reference_paths(m, model, task)}
                common = dict(task=task, model=model, seed=seed, config_arg=arg)
                if m.base:
                    cells.append(Cell(f"base-{task}-{model}-s{seed}", "single_agent", "shared", kind="base",
                                      overrides={**ov, "train.steps": 0}, **common))
                runs = [("single_agent", "shared")] if m.single_agent else []
                runs += [(wf, p) for wf in ax["workflows"] for p in ax["policies"]
                         if wf != "single_agent" or p == "shared"]  # one role: isolated == shared
                variants = m.get("variants") or {"": None}
                variants = {k: variants[k] for k in sorted(variants, key=lambda k: k != "baseline")}  # baseline first
                for wf, p in dict.fromkeys(runs):
                    for vname, v in variants.items():
                        if v is not None and (p not in _axis(v, "policies") or wf == "single_agent"):
                            continue
                        vov = {**ov, **flatten(v.overrides)} if v is not None else ov
                        vpart = f"-{vname}" if vname else ""
                        cells.append(Cell(f"{wf}-{p}{vpart}-{task}-{model}-s{seed}", wf, p, kind="train",
                                          overrides=vov, variant=vname, **common))
    names = [c.name for c in cells]
    if len(set(names)) != len(names):  # cannot happen with checked axes; guards later edits
        raise ValueError(f"duplicate cell names: {sorted({n for n in names if names.count(n) > 1})}")
    if not cells:
        raise ValueError("the matrix has no cells: set --matrix.workflows, or --matrix.single_agent / --matrix.base")
    return cells


def select(cells: Iterable[Cell], only: str) -> list[Cell]:
    """Cells whose name contains any of the comma-separated substrings in `only` ("" = all)."""
    keys = [k for k in only.split(",") if k]
    return [c for c in cells if not keys or any(k in c.name for k in keys)]


# ---------------------------------------------------------------------------------------------- commands


def _flag_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)):
        return repr(tuple(v))
    return str(v)


def cell_command(cell: Cell, root: str, python: str = sys.executable, *, repo: str = "") -> list[str]:
    """argv of the cell's `launch/run.py` run; paths are relative to the repository root unless `repo` is given."""
    config = os.path.join(repo, "configs", f"{cell.workflow}.py") + (f":{cell.config_arg}" if cell.config_arg else "")
    return [python, os.path.join(repo, RUN_SCRIPT), f"--config={config}",
            f"--workdir={os.path.join(root, cell.name)}", f"--config.policy={cell.policy}",
            f"--config.train.seed={cell.seed}",
            *(f"--config.{k}={_flag_value(v)}" for k, v in cell.overrides.items()), "--progress=false"]


def cell_config(cell: Cell, root: str = "/tmp/unused") -> ml_collections.ConfigDict:
    """The config `launch/run.py` builds from the cell's command (same flag parser, then `validate`).

    Raises ValueError naming the cell for unknown keys or bad values, so a sweep fails before launching.
    """
    from absl import flags
    from ml_collections import config_flags

    from marl_jax.config import validate

    argv = cell_command(cell, root, "python", repo=REPO)[1:]
    fv = flags.FlagValues()  # run.py's flags, on a private registry
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    flags.DEFINE_string("workdir", None, "", flag_values=fv)
    flags.DEFINE_bool("multihost", False, "", flag_values=fv)
    flags.DEFINE_bool("progress", True, "", flag_values=fv)
    try:
        fv(argv)
        return validate(fv.config)
    except (flags.Error, KeyError, AttributeError, TypeError, ValueError) as e:
        from marl_jax.cli import flag_error  # the message run.py itself would print for this command

        plain = isinstance(e, ValueError) and not isinstance(e, flags.Error)  # validate()'s
        text = str(e) if plain else flag_error(e, argv, fv)
        raise ValueError(f"cell {cell.name}: {text}\n  command: {shlex.join(argv)}") from None


def error_text(e: BaseException) -> str:
    """A flag / ConfigDict error as one readable message (no nested reprs, no embedded traceback)."""
    while isinstance(e, (KeyError, AttributeError)) and e.args and isinstance(e.args[0], BaseException):
        e = e.args[0]
    s = e.args[0] if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str) else str(e)
    if "Traceback (most recent call last)" in s:  # config_flags quotes the config file's traceback
        s = [line for line in s.strip().splitlines() if line.strip()][-1]
    return s.strip()


# ------------------------------------------------------------------------------------------------ status


def _records(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a killed run
                    continue
    except FileNotFoundError:
        pass
    return out


def last_step(workdir: str) -> int:
    """Largest "step" in the workdir's metrics.jsonl (-1 when there is none)."""
    return max((int(r.get("step", -1)) for r in _records(os.path.join(workdir, "metrics.jsonl"))), default=-1)


def cell_status(workdir: str, steps: int) -> str:
    """"done": metrics.jsonl holds the validation record of step `steps` and summary.md exists;
    "partial": run.py left files there; "new": nothing (or only the sweep's own cell.json / run.log)."""
    if not os.path.isdir(workdir) or not set(os.listdir(workdir)) - set(_SWEEP_FILES):
        return "new"
    final_val = any(r.get("step") == steps and any(k.startswith("val/") for k in r)
                    for r in _records(os.path.join(workdir, "metrics.jsonl")))
    return "done" if final_val and os.path.isfile(os.path.join(workdir, "summary.md")) else "partial"


def write_cell_json(cell: Cell, workdir: str, command: Sequence[str]) -> str:
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CELL_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**cell.to_json(), "command": list(command)}, f, indent=1)
    return path


def _previous_command(workdir: str) -> list[str] | None:
    try:
        with open(os.path.join(workdir, CELL_FILE), encoding="utf-8") as f:
            return json.load(f).get("command")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# ------------------------------------------------------------------------------------------------- sweep


@dataclasses.dataclass
class CellResult:
    cell: str
    status_before: str  # new | partial | done
    action: str  # run | resume | skip
    returncode: int | None = None  # None: skipped or interrupted
    wall_s: float = 0.0
    status_after: str = ""
    log: str = ""

    @property
    def failed(self) -> bool:
        return self.action != "skip" and self.returncode != 0


Runner = Callable[[Cell, list, str, str], int]  # (cell, argv, workdir, log_path) -> exit code


def subprocess_runner(echo: Callable[[str], None] = print, tick: Callable[[Cell, str], None] | None = None,
                      cwd: str = REPO, poll_s: float = 2.0) -> Runner:
    """Run argv from `cwd`, appending its stdout+stderr to log_path and echoing each line; `tick(cell, workdir)`
    is called every `poll_s` while it runs (progress display). Ctrl-C stops the child too."""

    def run(cell: Cell, argv: list, workdir: str, log_path: str) -> int:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"=== {datetime.datetime.now().isoformat(timespec='seconds')} {shlex.join(argv)}\n")
            log.flush()
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", bufsize=1)
            lines: queue.Queue = queue.Queue()

            def pump():  # a thread, so the main loop can tick while the child is quiet
                for line in proc.stdout:
                    lines.put(line)
                lines.put(None)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                while True:
                    try:
                        line = lines.get(timeout=poll_s)
                    except queue.Empty:
                        if tick:
                            tick(cell, workdir)
                        continue
                    if line is None:
                        break
                    log.write(line)
                    log.flush()
                    echo(line.rstrip("\n"))
                return proc.wait()
            finally:
                if proc.poll() is None:  # interrupted: do not leave the run behind
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()

    return run


def run_sweep(cells: Sequence[Cell], root: str, *, runner: Runner | None = None, python: str = sys.executable,
              steps: Mapping[str, int] | None = None, echo: Callable[[str], None] | None = None,
              progress: bool = True) -> list[CellResult]:
    """Run `cells` one after another under `root`: skip done cells, relaunch partial ones in place (run.py
    resumes), write `<cell>/cell.json` before each launch and append one record per cell to `<root>/sweep.jsonl`.
    A failed cell does not stop the sweep. `steps` maps cell name -> train.steps (default: from each cell's config).
    """
    from tqdm.auto import tqdm

    if steps is None:
        steps = {c.name: int(cell_config(c, root).train.steps) for c in cells}
    os.makedirs(root, exist_ok=True)
    bar = tqdm(total=len(cells), desc="sweep", unit="cell", disable=not progress, dynamic_ncols=True,
               file=sys.stderr)
    say = echo or (lambda s: tqdm.write(s, file=sys.stdout))

    def tick(cell: Cell, workdir: str) -> None:
        bar.set_postfix_str(f"{cell.name} step {max(last_step(workdir), 0)}/{steps[cell.name]}")

    run = runner or subprocess_runner(echo=say, tick=tick if progress else None)
    results: list[CellResult] = []
    log_file = os.path.join(root, SWEEP_FILE)
    try:
        for cell in cells:
            workdir = os.path.join(root, cell.name)
            command = cell_command(cell, root, python)
            before = cell_status(workdir, steps[cell.name])
            action = {"done": "skip", "partial": "resume", "new": "run"}[before]
            res = CellResult(cell.name, before, action, log=os.path.join(workdir, LOG_FILE))
            prev = _previous_command(workdir)
            if prev is not None and prev[1:] != command[1:]:
                say(f"warning: {cell.name} was launched before with another command (see {workdir}/{CELL_FILE}); "
                    f"{'its results are kept' if action == 'skip' else 'it resumes'} - delete {workdir} to start over")
            if action == "skip":
                say(f"[{cell.name}] done, skipped")
                results.append(res)
                _append(log_file, res, command)
            else:
                bar.set_postfix_str(cell.name)
                say(f"[{cell.name}] {'resuming' if action == 'resume' else 'starting'}: {shlex.join(command)}")
                write_cell_json(cell, workdir, command)
                t0 = time.monotonic()
                try:
                    res.returncode = run(cell, command, workdir, res.log)
                finally:  # recorded even when interrupted (returncode None)
                    res.wall_s = round(time.monotonic() - t0, 2)
                    res.status_after = cell_status(workdir, steps[cell.name])
                    results.append(res)
                    _append(log_file, res, command)
                say(f"[{cell.name}] exit {res.returncode} after {res.wall_s:.0f}s ({res.status_after})")
            bar.update(1)
    finally:
        bar.close()
    return results


def _append(path: str, res: CellResult, command: Sequence[str]) -> None:
    record = {**dataclasses.asdict(res), "command": list(command),
              "time": datetime.datetime.now().isoformat(timespec="seconds")}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def failure_report(results: Sequence[CellResult]) -> str:
    """"" when every launched cell exited 0, else one line per failed cell with its log file."""
    failed = [r for r in results if r.failed]
    if not failed:
        return ""
    return (f"{len(failed)} of {len(results)} cells failed:\n"
            + "\n".join(f"  {r.cell}: exit {r.returncode}, log {r.log}" for r in failed))
