"""The experiment-matrix sweep: cells of the presets, their run.py commands, status detection, skip/resume,
the command line (print_commands, errors, a stand-in interpreter that fails some cells), and one real cell."""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from marl_jax.config import MODELS, validate
from marl_jax.experiments import matrix as mx

REPO = pathlib.Path(__file__).resolve().parents[1]
SWEEP = str(REPO / "launch" / "sweep.py")
MULTI = ("eval_opt", "voting", "orch_workers")


def _presets_module():
    spec = importlib.util.spec_from_file_location("matrix_presets", REPO / "configs" / "matrix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _preset(arg: str):
    return _presets_module().get_config(arg)


CPU_STEPS = _presets_module().CPU_SMALL["train.steps"]
CPU_VAL_EVERY = _presets_module().CPU_SMALL["train.val_every"]


def _sweep(*args, timeout=120):
    return subprocess.run([sys.executable, SWEEP, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _run_py_config(argv: list[str]):
    """What launch/run.py's flags make of a cell's argv (its own flag definitions, parsed by absl here)."""
    fv = flags.FlagValues()
    args = [a.replace("--config=configs/", f"--config={REPO}/configs/") for a in argv[1:]]
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=args)
    flags.DEFINE_string("workdir", None, "", flag_values=fv)
    flags.DEFINE_bool("multihost", False, "", flag_values=fv)
    flags.DEFINE_bool("progress", True, "", flag_values=fv)
    fv(args)
    return fv


def _keys(cells):
    return {(c.workflow, c.policy, c.task, c.model, c.seed, c.kind) for c in cells}


# ---------------------------------------------------------------------------------------------- the presets


def test_paper_preset_cells():
    cells = mx.cells_from(_preset("paper"))
    tasks, models, seeds = ("math", "code"), ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"), (0,)
    trained = set(itertools.product(MULTI, ("shared", "isolated"), tasks, models, seeds, ("train",)))
    controls = {("single_agent", "shared", t, m, s, "train") for t, m, s in itertools.product(tasks, models, seeds)}
    base = {("single_agent", "shared", t, m, s, "base") for t, m, s in itertools.product(tasks, models, seeds)}
    assert len(cells) == 3 * 2 * 2 * 3 * 1 + 2 * 3 + 2 * 3 == 48
    assert _keys(cells) == trained | controls | base
    assert len({c.name for c in cells}) == len(cells)
    assert "voting-isolated-math-qwen3-1.7b-s0" in {c.name for c in cells}
    assert "base-code-qwen3-4b-s0" in {c.name for c in cells}
    for c in cells:
        assert c.config_arg == f"{c.model},{c.task}"
        assert c.overrides == ({"train.steps": 0} if c.kind == "base" else {})


def test_cpu_small_preset_cells():
    m = _preset("cpu-small")
    cells = mx.cells_from(m)
    assert len(cells) == 3 * 2 + 1 + 1
    assert _keys(cells) == (set(itertools.product(MULTI, ("shared", "isolated"), ("math",), ("smollm2-135m",), (0,),
                                                  ("train",)))
                            | {("single_agent", "shared", "math", "smollm2-135m", 0, "train"),
                               ("single_agent", "shared", "math", "smollm2-135m", 0, "base")})
    assert len({c.name for c in cells}) == len(cells)
    for c in cells:
        assert c.config_arg == ""  # the bare config file: the embedded CPU run
        assert c.overrides["train.steps"] == (0 if c.kind == "base" else CPU_STEPS)
        assert c.overrides["train.val_every"] == CPU_VAL_EVERY
    assert mx.flatten(m.overrides)["train.steps"] == CPU_STEPS  # one flat dict, nested for --matrix.overrides.<key>


def test_every_command_builds_the_config_run_py_builds(tmp_path):
    for preset, cells in (("paper", mx.cells_from(_preset("paper"))), ("cpu", mx.cells_from(_preset("cpu-small")))):
        for cell in cells:
            argv = mx.cell_command(cell, str(tmp_path), python="python")
            assert argv[:2] == ["python", "launch/run.py"]
            assert argv[2] == f"--config=configs/{cell.workflow}.py" + (f":{cell.model},{cell.task}"
                                                                          if preset == "paper" else "")
            fv = _run_py_config(argv)
            c = validate(fv.config)
            assert fv.workdir == str(tmp_path / cell.name) and fv.progress is False
            assert (c.workflow, c.policy, c.train.seed, c.task.kind) == (cell.workflow, cell.policy, cell.seed,
                                                                           cell.task)
            assert c.model.name == (MODELS[cell.model] if preset == "paper" else "smollm2-135m-instruct")
            if cell.kind == "base":
                assert c.train.steps == 0
            else:
                assert c.train.steps == (300 if preset == "paper" else CPU_STEPS)
            assert mx.cell_config(cell).to_dict() == c.to_dict()


def test_local_model_and_data_folders():
    m = _preset("paper")
    m.model_dir, m.data_dir = "/ckpts", "/data"
    cells = {c.name: c for c in mx.cells_from(m)}
    c = mx.cell_config(cells["voting-shared-math-qwen3-1.7b-s0"])
    assert (c.model.name, c.task.path) == ("/ckpts/Qwen3-1.7B", "/data/dapo_math_17k.parquet")
    c = mx.cell_config(cells["base-code-qwen3-4b-s0"])
    assert (c.model.name, c.task.path, c.train.steps) == ("/ckpts/Qwen3-4B", "/data/deepcoder_train.jsonl", 0)


def test_bad_matrices_name_the_fix():
    m = _preset("paper")
    m.workflows = ("votin",)
    with pytest.raises(ValueError, match="votin"):
        mx.cells_from(m)
    m = _preset("cpu-small")
    m.models = ("qwen3-4b",)
    with pytest.raises(ValueError, match="preset=reference"):
        mx.cells_from(m)
    cell = mx.cells_from(_preset("cpu-small"), {"train.stepz": 3})[0]
    with pytest.raises(ValueError, match=f"{cell.name}.*stepz"):
        mx.cell_config(cell)


# ------------------------------------------------------------------------------------------------ the CLI


def test_print_commands_with_matrix_overrides(tmp_path):
    proc = _sweep("--matrix=configs/matrix.py:cpu-small", f"--root={tmp_path / 'r'}", "--print_commands",
                  "--matrix.seeds=0,1", "--matrix.workflows=voting", "--matrix.overrides.train.steps=3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 * (1 + 1 + 2)  # seeds x (base + single_agent + voting x {shared, isolated})
    workdirs = set()
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == sys.executable and argv[1] == "launch/run.py"
        fv = _run_py_config(argv)
        workdirs.add(fv.workdir)
        assert fv.workdir.startswith(str(tmp_path / "r") + os.sep)
        base = os.path.basename(fv.workdir).startswith("base-")
        assert fv.config.train.steps == (0 if base else 3)
        assert fv.config.workflow in (("single_agent",) if base else ("single_agent", "voting"))
    assert len(workdirs) == len(lines)
    assert sorted(fv_seed for fv_seed in (int(line.split("--config.train.seed=")[1].split()[0]) for line in lines)) \
        == [0] * 4 + [1] * 4
    assert not (tmp_path / "r").exists()  # printed, nothing run


@pytest.mark.parametrize("args, expected", [
    (["--matrix.bogus=1"], "bogus"),
    (["--matrix.overrides.train.stepz=1"], "stepz"),
    (["--matrix.workflows=votin"], "votin"),
    (["--set=optim.lrr=1e-3"], "lrr"),
    (["--set=optim.lr=abc"], "optim.lr=abc"),
])
def test_bad_keys_fail_with_a_message(tmp_path, args, expected):
    proc = _sweep("--matrix=configs/matrix.py:cpu-small", f"--root={tmp_path}", "--print_commands", *args)
    assert proc.returncode != 0 and proc.stdout == ""
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------------ status and resume


def _write(workdir: pathlib.Path, records=(), summary=False, extra=""):
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(extra)
    if summary:
        (workdir / "summary.md").write_text("# summary\n")


def _finished(steps: int, val_every: int):
    recs = [{"step": 0, "val/success": 0.25}]
    for s in range(1, steps + 1):
        recs.append({"step": s, "reward_mean": 0.5})
        if s % val_every == 0 or s == steps:
            recs.append({"step": s, "val/success": 0.5})
    return recs


def test_cell_status(tmp_path):
    assert mx.cell_status(str(tmp_path / "missing"), 8) == "new"
    (tmp_path / "only_cell").mkdir()
    (tmp_path / "only_cell" / "cell.json").write_text("{}")  # the sweep's own file: run.py never started
    assert mx.cell_status(str(tmp_path / "only_cell"), 8) == "new"
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{}")
    assert mx.cell_status(str(tmp_path / "cfg"), 8) == "partial"
    _write(tmp_path / "half", _finished(8, 4)[:8])  # killed after step 4's validation
    assert mx.cell_status(str(tmp_path / "half"), 8) == "partial"
    _write(tmp_path / "nosummary", _finished(8, 4))  # killed while writing the summary
    assert mx.cell_status(str(tmp_path / "nosummary"), 8) == "partial"
    _write(tmp_path / "trainonly", _finished(8, 4)[:-1], summary=True)  # step 8's train record, no validation
    assert mx.cell_status(str(tmp_path / "trainonly"), 8) == "partial"
    _write(tmp_path / "done", _finished(8, 4), summary=True, extra='{"step": 9, "val/suc')  # cut last line
    assert mx.cell_status(str(tmp_path / "done"), 8) == "done"
    assert mx.cell_status(str(tmp_path / "done"), 12) == "partial"  # more steps asked: resume to 12
    _write(tmp_path / "base", [{"step": 0, "val/success": 0.0}], summary=True)
    assert mx.cell_status(str(tmp_path / "base"), 0) == "done"


def test_run_sweep_skips_done_cells_and_resumes_partial_ones(tmp_path):
    cells = mx.cells_from(_preset("cpu-small"))[:4]  # base, single_agent, eval_opt shared / isolated
    root = tmp_path / "root"
    steps = {c.name: (0 if c.kind == "base" else 8) for c in cells}
    done, partial, new, failing = cells
    _write(root / done.name, _finished(0, 4), summary=True)
    _write(root / partial.name, _finished(8, 4)[:8])
    (root / partial.name / "checkpoints" / "4").mkdir(parents=True)
    calls = []

    def fake_runner(cell, argv, workdir, log_path):
        info = json.loads(pathlib.Path(workdir, "cell.json").read_text())  # written before the launch
        assert info["command"] == argv and info["name"] == cell.name and info["kind"] == cell.kind
        calls.append((cell.name, os.listdir(workdir)))
        if cell is failing:
            return 2
        _write(pathlib.Path(workdir), _finished(steps[cell.name], 4), summary=True)
        return 0

    results = mx.run_sweep(cells, str(root), runner=fake_runner, steps=steps, echo=lambda s: None, progress=False)
    assert [name for name, _ in calls] == [partial.name, new.name, failing.name]
    assert "checkpoints" in calls[0][1]  # relaunched in place: the checkpoint is there to resume from
    assert [(r.cell, r.status_before, r.action, r.returncode, r.status_after) for r in results] == [
        (done.name, "done", "skip", None, ""),
        (partial.name, "partial", "resume", 0, "done"),
        (new.name, "new", "run", 0, "done"),
        (failing.name, "new", "run", 2, "new"),
    ]
    records = [json.loads(line) for line in (root / "sweep.jsonl").read_text().splitlines()]
    assert [(r["cell"], r["returncode"]) for r in records] == [(r.cell, r.returncode) for r in results]
    assert all(r["wall_s"] >= 0 and r["command"][1] == "launch/run.py" for r in records)
    report = mx.failure_report(results)
    assert failing.name in report and str(root / failing.name / "run.log") in report
    assert done.name not in report and partial.name not in report

    calls.clear()  # a second pass only relaunches the failed cell
    results = mx.run_sweep(cells, str(root), runner=fake_runner, steps=steps, echo=lambda s: None, progress=False)
    assert [name for name, _ in calls] == [failing.name]
    assert [r.action for r in results] == ["skip", "skip", "skip", "run"]


FAKE_PYTHON = """#!{python}
# Stands in for `python launch/run.py ...`: writes a finished run, except isolated cells, which fail half-way.
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[2:] if "=" in a)
assert sys.argv[1] == "launch/run.py" and os.path.isfile(sys.argv[1]), sys.argv
workdir, steps = args["workdir"], int(args.get("config.train.steps", 300))
os.makedirs(workdir, exist_ok=True)
print("fake run of", os.path.basename(workdir), "resuming" if os.path.exists(os.path.join(workdir, "metrics.jsonl")) else "fresh")
print("to stderr", file=sys.stderr)
with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({{"step": 0, "val/success": 0.0}}) + "\\n")
    if "isolated" in workdir:
        sys.exit(3)
    f.write(json.dumps({{"step": steps, "val/success": 1.0}}) + "\\n")
open(os.path.join(workdir, "summary.md"), "w").write("done")
"""


def test_sweep_cli_runs_cells_logs_them_and_reports_failures(tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    root = tmp_path / "root"
    args = ("--matrix=configs/matrix.py:cpu-small", f"--root={root}", f"--python={fake}", "--only=voting,base",
            "--progress=false")
    proc = _sweep(*args, "--dry_run")
    assert proc.returncode == 0 and len(proc.stdout.strip().splitlines()) == 3 and not root.exists()
    assert all(line.startswith("run ") for line in proc.stdout.strip().splitlines())

    proc = _sweep(*args)
    assert proc.returncode == 1, proc.stderr
    failed = "voting-isolated-math-smollm2-135m-s0"
    assert f"{failed}: exit 3, log {root / failed / 'run.log'}" in proc.stderr
    assert "voting-shared" not in proc.stderr.split("failed:")[-1]
    assert "fake run of voting-shared-math-smollm2-135m-s0 fresh" in proc.stdout  # streamed
    log = (root / "voting-shared-math-smollm2-135m-s0" / "run.log").read_text()
    assert "fake run of voting-shared" in log and "to stderr" in log
    records = [json.loads(line) for line in (root / "sweep.jsonl").read_text().splitlines()]
    assert {r["cell"]: r["returncode"] for r in records} == {
        "base-math-smollm2-135m-s0": 0, "voting-shared-math-smollm2-135m-s0": 0, failed: 3}

    proc = _sweep(*args, "--dry_run")
    status = {line.split()[-2]: line.split()[0] for line in proc.stdout.strip().splitlines()}
    assert status == {"base-math-smollm2-135m-s0": "skip", "voting-shared-math-smollm2-135m-s0": "skip",
                      failed: "resume"}
    proc = _sweep(*args)  # the failed cell is relaunched in its workdir, the others are left alone
    assert proc.returncode == 1
    assert f"fake run of {failed} resuming" in proc.stdout and "fake run of voting-shared" not in proc.stdout
    assert (root / failed / "run.log").read_text().count("fake run of") == 2  # appended, not overwritten


def test_real_base_cell_end_to_end(tmp_path):
    """The base-model cell of cpu-small (train.steps=0) through launch/sweep.py and launch/run.py."""
    root = tmp_path / "root"
    args = ("--matrix=configs/matrix.py:cpu-small", f"--root={root}", "--only=base", "--set=task.val_size=2",
            "--progress=false")
    proc = _sweep(*args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wd = root / "base-math-smollm2-135m-s0"
    recs = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0] and recs[0]["val/success"] in (0.0, 0.5, 1.0)  # 2 tasks
    config = json.loads((wd / "config.json").read_text())
    assert (config["train"]["steps"], config["task"]["val_size"], config["workflow"]) == (0, 2, "single_agent")
    cell = json.loads((wd / "cell.json").read_text())
    assert cell["kind"] == "base" and cell["command"][1] == "launch/run.py"
    assert (wd / "summary.md").exists() and mx.cell_status(str(wd), 0) == "done"
    proc = _sweep(*args)
    assert proc.returncode == 0 and "done, skipped" in proc.stdout
