"""Sweep report: numbers against hand-worked values from a synthetic sweep, figures read back, CLI."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from marl_jax.experiments.report import (curves_figures, grad_figures, heatmap_figure, heatmap_grids, ip_sp_figure,
                                         load_cells, match_ip_sp, model_scale, summarize, write_report)
from marl_jax.train.metrics import MetricsWriter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = {"single_agent": ["generator"], "voting": ["generator", "aggregator"], "eval_opt": ["generator", "evaluator"]}
MODEL_NAMES = {"smollm2-135m": "smollm2-135m-instruct", "qwen3-1.7b": "Qwen/Qwen3-1.7B"}

# name: (workflow, policy, task, model, seed, planned steps, {val step: val/success}, extra)
SWEEP = {
    "sa-sp-135m-s0": ("single_agent", "shared", "math", "smollm2-135m", 0, 20, {0: 0.30, 10: 0.50, 20: 0.45}, {}),
    "sa-ip-135m-s0": ("single_agent", "isolated", "math", "smollm2-135m", 0, 20, {0: 0.30, 10: 0.40, 20: 0.55}, {}),
    "sa-sp-135m-s1": ("single_agent", "shared", "math", "smollm2-135m", 1, 20, {0: 0.20, 10: 0.40, 20: 0.30}, {}),
    # a cliff at step 20: 0.70 -> 0.30 and never back above 0.70 - 0.075
    "vote-sp-1.7b-s0": ("voting", "shared", "math", "qwen3-1.7b", 0, 40,
                        {0: 0.40, 10: 0.70, 20: 0.30, 30: 0.25, 40: 0.20}, {}),
    "vote-ip-1.7b-s0": ("voting", "isolated", "math", "qwen3-1.7b", 0, 40,
                        {0: 0.40, 10: 0.60, 20: 0.65, 30: 0.62, 40: 0.66}, {}),
    # the sweep's base cell: untrained model, single_agent, step 0 only; it replaces the 1.7b runs' own
    # step 0 (0.40) whatever their workflow
    "base-math-qwen3-1.7b-s0": ("single_agent", "shared", "math", "qwen3-1.7b", 0, 0, {0: 0.35}, {"kind": "base"}),
    "sa-sp-135m-code": ("single_agent", "shared", "code", "smollm2-135m", 0, 20, {0: 0.10, 10: 0.20, 20: 0.30},
                        {"no_cell_json": True}),
    # metrics stop at step 10 of 20 (still running or killed)
    "sa-sp-1.7b-partial": ("single_agent", "shared", "math", "qwen3-1.7b", 0, 20, {0: 0.50, 10: 0.60}, {}),
    # just started: only the base validation so far
    "vote-ip-135m-running": ("voting", "isolated", "math", "smollm2-135m", 0, 20, {0: 0.30}, {}),
    "eo-sp-135m-nometrics": ("eval_opt", "shared", "math", "smollm2-135m", 0, 20, None, {}),
    # sweep.jsonl: its last launch exited 1
    "eo-ip-135m-failed": ("eval_opt", "isolated", "math", "smollm2-135m", 0, 20, {0: 0.3, 10: 0.4}, {}),
}
# <root>/sweep.jsonl as marl_jax.experiments.matrix.run_sweep appends it: (cell, action, returncode)
LAUNCHES = [("sa-ip-135m-s0", "run", 1), ("eo-ip-135m-failed", "run", 0), ("sa-ip-135m-s0", "resume", 0),
            ("eo-ip-135m-failed", "resume", 1), ("sa-sp-135m-s0", "run", 0), ("sa-sp-135m-s0", "skip", None)]


def _train_values(name: str, step: int) -> dict[str, float]:
    """Deterministic per-step train numbers (vary by cell and step)."""
    h = sum(map(ord, name)) % 7
    share = 0.5 + 0.4 * math.sin(0.3 * step + h)
    return {"success": (step * 7 + h) % 10 / 10, "norm": 0.5 + 0.1 * ((step + h) % 5), "share": share}


def _write_cell(root, name, spec) -> None:
    workflow, policy, task, model, seed, steps, val, extra = spec
    wd = os.path.join(root, name)
    os.makedirs(wd)
    config = {"workflow": workflow, "policy": policy, "preset": f"{model},{task}",
              "model": {"name": MODEL_NAMES[model], "dtype": "float32"},
              "task": {"kind": task, "source": "file"}, "train": {"seed": seed, "steps": steps, "val_every": 10}}
    with open(os.path.join(wd, "config.json"), "w") as f:
        json.dump(config, f)
    if not extra.get("no_cell_json"):
        cell = {"name": name, "workflow": workflow, "policy": policy, "task": task, "model": model, "seed": seed,
                "kind": extra.get("kind", "train"), "overrides": {"optim.lr": 0.001, "train.steps": steps},
                "config_arg": f"{model},{task}", "command": ["python", "launch/run.py"]}
        with open(os.path.join(wd, "cell.json"), "w") as f:
            json.dump(cell, f)
    if val is None:
        return
    roles = ROLES[workflow]
    last = max(val)
    with MetricsWriter(wd, tensorboard=False) as w:
        for step in range(0, last + 1):
            if step > 0:
                t = _train_values(name, step)
                rec = {"step": step, "success": t["success"], "reward_mean": t["success"], "loss": 0.1}
                for i, r in enumerate(roles):
                    share = t["share"] if i == 0 else 1 - t["share"]
                    rec.update({f"{r}/accuracy": t["success"], f"grad/{r}/norm": t["norm"] * (i + 1),
                                f"grad/{r}/share": share, f"grad/{r}/norm_share": share})
                w.write(rec)
            if step in val:
                rec = {"step": step, "val/success": val[step]}
                rec.update({f"val/{r}/accuracy": val[step] + 0.01 * (i + 1) for i, r in enumerate(roles)})
                w.write(rec)
    if steps > 0 and last >= steps:  # the trainer's finish() writes summary.md
        open(os.path.join(wd, "summary.md"), "w").close()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sweep"))
    for name, spec in SWEEP.items():
        _write_cell(root, name, spec)
    os.makedirs(os.path.join(root, "not-a-cell"))  # no run files: ignored
    with open(os.path.join(root, "sweep.jsonl"), "w") as f:
        for cell, action, rc in LAUNCHES:
            f.write(json.dumps({"cell": cell, "status_before": "new", "action": action, "returncode": rc,
                                "wall_s": 1.0, "status_after": "partial", "log": "", "command": []}) + "\n")
    with open(os.path.join(root, "eo-ip-135m-failed", "run.log"), "w") as f:
        f.write("step 10\nTraceback (most recent call last):\nRuntimeError: out of memory\n\n")
    return root


@pytest.fixture(scope="module")
def summaries(sweep):
    return {s["name"]: s for s in summarize(load_cells(sweep))}


def _expected(name, base=None):
    """Hand-worked base/peak/final from SWEEP: peak over steps > 0, first on ties."""
    val = SWEEP[name][6]
    base = val[0] if base is None else base
    trained = {s: v for s, v in val.items() if s > 0}
    peak_step = min(s for s, v in trained.items() if v == max(trained.values()))
    final = val[max(val)]
    return {"base": base, "peak": trained[peak_step], "peak_step": peak_step, "final": final,
            "delta_peak": trained[peak_step] - base, "delta_final": final - base}


DELTA_CASES = [  # (cell, base): signs worked out by hand in the comments
    ("sa-sp-135m-s0", None),  # +0.20 peak, +0.15 final
    ("sa-ip-135m-s0", None),  # +0.25, +0.25
    ("sa-sp-135m-s1", None),  # +0.20, +0.10
    ("vote-sp-1.7b-s0", 0.35),  # +0.35, -0.15 (base cell, not step 0)
    ("vote-ip-1.7b-s0", 0.35),  # +0.31, +0.31
    ("sa-sp-135m-code", None),  # +0.20, +0.20
]


def test_scale_parsing():
    assert model_scale("smollm2-135m") == pytest.approx(0.135)
    assert model_scale("qwen3-1.7b") == pytest.approx(1.7)
    assert model_scale("Qwen3-4B") == pytest.approx(4.0)
    assert model_scale("mystery-model") is None


@pytest.mark.parametrize("name,base", DELTA_CASES)
def test_deltas(summaries, name, base):
    s, e = summaries[name], _expected(name, base)
    assert s["status"] == "ok"
    for k in ("base", "peak", "final", "delta_peak", "delta_final"):
        assert s[k] == pytest.approx(e[k], abs=1e-12), k
    assert s["peak_step"] == e["peak_step"]
    assert s["final_step"] == max(SWEEP[name][6])


def test_signs_and_base_source(sweep, summaries):
    vote = summaries["vote-sp-1.7b-s0"]
    assert vote["delta_peak"] == pytest.approx(0.35) and vote["delta_final"] == pytest.approx(-0.15)
    assert vote["base_source"] == "base cell base-math-qwen3-1.7b-s0"
    assert summaries["sa-sp-135m-s0"]["base_source"] == "step 0"
    assert summaries["sa-sp-135m-s0"]["delta_final"] == pytest.approx(0.15)
    # without base cells every run is measured against its own step 0
    step0 = {s["name"]: s for s in summarize(load_cells(sweep), base_from="step0")}
    assert step0["vote-sp-1.7b-s0"]["delta_final"] == pytest.approx(0.20 - 0.40)


def test_metadata_fallback_and_roles(summaries):
    code = summaries["sa-sp-135m-code"]  # config.json only
    assert (code["workflow"], code["policy"], code["task"], code["model"], code["seed"]) == (
        "single_agent", "shared", "code", "smollm2-135m", 0)
    vote = summaries["vote-ip-1.7b-s0"]
    assert vote["role_acc"] == pytest.approx({"generator": 0.66 + 0.01, "aggregator": 0.66 + 0.02})
    shares = [_train_values("vote-ip-1.7b-s0", s)["share"] for s in range(1, 41)]
    assert vote["role_share"]["generator"] == pytest.approx(np.mean(shares))
    assert vote["role_share"]["aggregator"] == pytest.approx(1 - np.mean(shares))


def test_cliffs(summaries):
    assert summaries["vote-sp-1.7b-s0"]["cliff_step"] == 20
    assert summaries["vote-sp-1.7b-s0"]["cliff_peak_step"] == 10
    for name in ("sa-sp-135m-s0", "sa-ip-135m-s0", "sa-sp-135m-s1", "vote-ip-1.7b-s0", "sa-sp-135m-code"):
        assert summaries[name]["cliff_step"] is None, name


def test_missing_and_incomplete(summaries):
    assert summaries["eo-sp-135m-nometrics"]["status"] == "missing"
    assert "metrics" in summaries["eo-sp-135m-nometrics"]["problem"]
    assert summaries["eo-ip-135m-failed"]["status"] == "missing"
    assert summaries["eo-ip-135m-failed"]["problem"] == "run failed (exit 1): RuntimeError: out of memory"
    assert summaries["sa-ip-135m-s0"]["status"] == "ok"  # failed once, then a launch that finished
    assert summaries["sa-sp-1.7b-partial"]["status"] == "incomplete"
    assert summaries["vote-ip-135m-running"]["status"] == "incomplete"
    assert summaries["vote-ip-135m-running"]["peak"] is None
    assert "not-a-cell" not in summaries
    assert len(summaries) == len(SWEEP)


def test_ip_sp_pairing_and_scatter(summaries):
    pairs, unmatched = match_ip_sp(list(summaries.values()))
    got = {(p["workflow"], p["model"], p["seed"]): (p["shared"], p["isolated"]) for p in pairs}
    assert got == {("single_agent", "smollm2-135m", 0): ("sa-sp-135m-s0", "sa-ip-135m-s0"),
                   ("voting", "qwen3-1.7b", 0): ("vote-sp-1.7b-s0", "vote-ip-1.7b-s0")}
    # seed 1 has no isolated run; code has no isolated run; partial/failed cells are not usable
    assert unmatched == ["sa-sp-135m-code", "sa-sp-135m-s1"]
    fig, drawn = ip_sp_figure(pairs)
    ax = fig.axes[0]
    offsets = [np.asarray(c.get_offsets()) for c in ax.collections]
    offsets = [o for o in offsets if len(o)]
    want_peak = np.array([[0.50, 0.55], [0.70, 0.66]])
    want_final = np.array([[0.45, 0.55], [0.20, 0.66]])
    assert len(offsets) == 2
    np.testing.assert_allclose(offsets[0], want_peak)
    np.testing.assert_allclose(offsets[1], want_final)
    np.testing.assert_allclose(drawn["peak"], want_peak)
    np.testing.assert_allclose(drawn["final"], want_final)
    diag = ax.lines[0].get_xydata()
    assert np.allclose(diag[:, 0], diag[:, 1])  # the diagonal


def test_heatmap_values_at_row_col(summaries):
    rows_ = list(summaries.values())
    grids = {(g.task, g.policy): g for g in heatmap_grids(rows_, "delta_final")}
    g = grids[("math", "shared")]
    assert g.rows == ("single_agent", "eval_opt", "voting") and g.cols == ("smollm2-135m", "qwen3-1.7b")
    want = np.full((3, 2), np.nan)
    want[0, 0] = ((0.45 - 0.30) + (0.30 - 0.20)) / 2  # two seeds averaged
    want[2, 1] = 0.20 - 0.35
    # (single_agent, 1.7b) is incomplete, eval_opt has no metrics: n/a
    np.testing.assert_allclose(g.values, want)
    assert g.counts[0, 0] == 2
    np.testing.assert_allclose(grids[("math", "isolated")].values[2, 1], 0.66 - 0.35)
    np.testing.assert_allclose(grids[("code", "shared")].values[0, 0], 0.30 - 0.10)
    assert np.isnan(grids[("code", "isolated")].values).all()

    fig = heatmap_figure(list(grids.values()), "t")
    ax = next(a for a in fig.axes if a.get_title() == "math / shared")
    img = ax.images[0].get_array()
    assert img.mask.tolist() == np.isnan(want).tolist()
    np.testing.assert_allclose(img.filled(np.nan), want)
    texts = {(round(t.get_position()[0]), round(t.get_position()[1])): t.get_text() for t in ax.texts}
    assert texts[(0, 0)].startswith("+0.125") and texts[(1, 0)] == "n/a" and texts[(1, 2)] == "-0.150"
    # with incomplete runs: the partial 1.7b single_agent run against its base cell (0.35, not its step 0)
    part = {(g.task, g.policy): g for g in heatmap_grids(rows_, "delta_final", include_incomplete=True)}
    np.testing.assert_allclose(part[("math", "shared")].values[0, 1], 0.60 - 0.35)
    assert np.isnan(part[("math", "isolated")].values[2, 0])  # the running cell has nothing after step 0
    peak = {(g.task, g.policy): g for g in heatmap_grids(rows_, "delta_peak")}
    np.testing.assert_allclose(peak[("math", "shared")].values[2, 1], 0.70 - 0.35)


def test_curves_and_grads_figures(sweep, summaries):
    cells = load_cells(sweep)
    rows_ = sorted(summaries.values(), key=lambda s: s["name"])
    (fig, drawn), = curves_figures(cells, rows_)
    assert drawn["vote-sp-1.7b-s0"]["cliff"] == (20, pytest.approx(0.30))
    assert drawn["vote-ip-1.7b-s0"]["cliff"] is None
    s, v = drawn["sa-sp-135m-s0"]["val"]
    assert s.tolist() == [0, 10, 20] and v.tolist() == [0.30, 0.50, 0.45]
    ts, smooth = drawn["sa-sp-135m-s0"]["train"]
    raw = [_train_values("sa-sp-135m-s0", k)["success"] for k in range(1, 21)]
    assert smooth[-1] == pytest.approx(np.mean(raw[-10:])) and smooth[0] == pytest.approx(raw[0])
    assert "eo-sp-135m-nometrics" not in drawn and "base-math-qwen3-1.7b-s0" not in drawn
    (_, norms), = grad_figures(cells, rows_, "norm")
    assert set(norms["vote-sp-1.7b-s0"]) == {"grad/generator/norm", "grad/aggregator/norm"}
    (_, shares), = grad_figures(cells, rows_, "share")
    gs, gv = shares["sa-sp-135m-s0"]["grad/generator/share"]
    raw = [_train_values("sa-sp-135m-s0", k)["share"] for k in range(1, 21)]
    assert gs.tolist() == list(range(1, 21)) and gv[-1] == pytest.approx(np.mean(raw[-10:]))


def test_cli_end_to_end(sweep, tmp_path):
    out = tmp_path / "report"
    r = subprocess.run([sys.executable, os.path.join(REPO, "launch", "report.py"), f"--root={sweep}",
                        f"--out={out}"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    for f in ("README.md", "cells.csv", "delta_final.png", "delta_peak.png", "ip_vs_sp.png", "curves.png",
              "grad_norms.png", "grad_shares.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    assert (out / "delta_final.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = (out / "README.md").read_text()
    for name in SWEEP:
        assert name in readme, name
    missing = readme.split("## Missing, failed or incomplete cells")[1]
    for name in ("eo-sp-135m-nometrics", "eo-ip-135m-failed", "sa-sp-1.7b-partial", "vote-ip-135m-running"):
        assert name in missing
    assert "sa-sp-135m-s0" not in missing
    with open(out / "cells.csv") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(SWEEP)
    for name, base in DELTA_CASES:
        e = _expected(name, base)
        assert float(rows[name]["delta_peak"]) == pytest.approx(e["delta_peak"])
        assert float(rows[name]["delta_final"]) == pytest.approx(e["delta_final"])
    assert float(rows["vote-sp-1.7b-s0"]["delta_final"]) < 0 < float(rows["vote-sp-1.7b-s0"]["delta_peak"])
    assert rows["vote-sp-1.7b-s0"]["cliff_step"] == "20" and rows["sa-sp-135m-s0"]["cliff_step"] == ""
    assert rows["eo-sp-135m-nometrics"]["status"] == "missing" and rows["eo-sp-135m-nometrics"]["final"] == ""
    assert float(rows["vote-ip-1.7b-s0"]["acc/aggregator"]) == pytest.approx(0.68)
    assert "20" in r.stdout and "missing" in r.stdout


def test_bad_root(tmp_path):
    with pytest.raises(FileNotFoundError, match="sweep root"):
        load_cells(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no run folders"):
        write_report(tmp_path, tmp_path / "out")


def test_unmatched_only_among_workflows_run_under_both_policies():
    def row(name, wf, policy, seed):
        return {"name": name, "kind": "train", "status": "ok", "workflow": wf, "policy": policy, "task": "math",
                "model": "qwen3-0.6b", "seed": seed, "peak": 0.5, "final": 0.4}
    rows_ = [row("a", "single_agent", "shared", 0), row("b", "voting", "shared", 0), row("c", "voting", "isolated", 0),
             row("d", "voting", "shared", 1)]
    pairs, unmatched = match_ip_sp(rows_)
    assert [(p["shared"], p["isolated"]) for p in pairs] == [("b", "c")]
    assert unmatched == ["d"]  # single_agent runs shared only: not a missing counterpart


def test_pages_of_small_multiples(sweep, summaries, monkeypatch):
    import marl_jax.experiments.report as report

    monkeypatch.setattr(report, "PANELS_PER_PAGE", 5)
    cells, rows_ = load_cells(sweep), list(summaries.values())
    # 8 train cells have metrics (single_agent x5 incl. partial, voting x3 incl. running); the failed and
    # no-metrics cells have none, the base cell is not a training run
    for pages in (curves_figures(cells, rows_), grad_figures(cells, rows_, "norm"),
                  grad_figures(cells, rows_, "share")):
        assert [len(drawn) for _, drawn in pages] == [5, 3]
        assert [len(fig.axes) for fig, _ in pages][1] == 3


# -- levers report: bootstrap intervals and paired differences ---------------------------------------------

def test_bootstrap_mean_matches_the_normal_interval_and_degenerates_on_constants():
    from marl_jax.experiments.report import bootstrap_mean

    x = np.tile([0.0, 1.0], 200)[None]  # one seed, 400 tasks, p = 0.5: standard error 0.025
    m, lo, hi = bootstrap_mean(x, n_boot=4000)
    assert m == 0.5
    np.testing.assert_allclose([lo, hi], [0.5 - 1.96 * 0.025, 0.5 + 1.96 * 0.025], atol=0.006)
    assert bootstrap_mean(np.full((3, 10), 0.25)) == (0.25, 0.25, 0.25)
    # two seeds that disagree entirely: resampling seeds spreads the interval over [0, 1]
    m, lo, hi = bootstrap_mean(np.stack([np.zeros(50), np.ones(50)]), n_boot=2000)
    assert m == 0.5 and lo == 0.0 and hi == 1.0
    with pytest.raises(ValueError, match="seeds, tasks"):
        bootstrap_mean(np.zeros(5))


def _lever_cell(root, name, variant, seed, val, finished=True, shares=None, policy="shared"):
    wd = os.path.join(root, name)
    os.makedirs(wd)
    with open(os.path.join(wd, "cell.json"), "w") as f:
        json.dump({"name": name, "workflow": "voting", "policy": policy, "task": "math", "model": "smollm2-135m",
                   "seed": seed, "kind": "train", "overrides": {"train.steps": 2}, "variant": variant}, f)
    with open(os.path.join(wd, "config.json"), "w") as f:
        json.dump({"workflow": "voting", "policy": policy, "train": {"steps": 2, "seed": seed}}, f)
    recs = []
    for step in (1, 2):
        r = {"step": step, "loss": 0.1, "success": 0.5 * step / 2, "grad/slot0/norm": 0.1 * step,
             "grad/generator/share": 0.8, "grad/aggregator/share": 0.2, "skipped_updates": 0}
        r.update(shares or {})
        recs.append(r)
    with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    with open(os.path.join(wd, "val_tasks.jsonl"), "w") as f:
        for step, succ in val.items():
            f.write(json.dumps({"step": step, "samples": 2, "temperature": 0.7, "success": succ}) + "\n")
    if finished:
        open(os.path.join(wd, "summary.md"), "w").close()


def test_levers_report_pairs_variants_with_the_baseline_on_the_same_seeds_and_tasks(tmp_path):
    from marl_jax.experiments.report import write_levers_report

    root = tmp_path / "levers"
    tasks = [f"t{i}" for i in range(4)]
    base = {0: [0.5, 0.5, 0.0, 1.0], 1: [0.0, 0.5, 0.5, 1.0]}
    bal = {0: [1.0, 0.5, 0.5, 1.0], 1: [0.5, 0.5, 0.5, 1.0]}  # +0.25 and +0.125 per task on average
    for s in (0, 1):
        _lever_cell(root, f"base-s{s}", "baseline", s, {0: dict(zip(tasks, [0.5] * 4)), 2: dict(zip(tasks, base[s]))})
        _lever_cell(root, f"bal-s{s}", "balance", s, {0: dict(zip(tasks, [0.5] * 4)), 2: dict(zip(tasks, bal[s]))},
                    shares={"lever/generator/share_before": 0.8, "lever/generator/share_after": 0.5,
                            "lever/aggregator/share_before": 0.2, "lever/aggregator/share_after": 0.5})
    _lever_cell(root, "bal-s2", "balance", 2, {0: dict(zip(tasks, [0.5] * 4))}, finished=False)
    # Isolated-Policy baseline on seed 1 only (and an extra task): SP - IP is paired on seed 1's 4 tasks
    ip = [0.0, 0.0, 0.5, 0.5]
    _lever_cell(root, "ip-s1", "baseline", 1, {0: dict(zip(tasks + ["t9"], [0.25] * 5)),
                                               2: dict(zip(tasks + ["t9"], ip + [1.0]))}, policy="isolated")
    res = write_levers_report(root, tmp_path / "out", n_boot=500)
    rows = {r["variant"]: r for r in res["rows"] if r["policy"] == "shared"}
    assert [(r["policy"], r["variant"]) for r in res["rows"]] == [("shared", "baseline"), ("shared", "balance"),
                                                                  ("isolated", "baseline")]
    assert rows["balance"]["final_by_seed"] == {0: np.mean(bal[0]), 1: np.mean(bal[1])}
    (pair,) = res["policy_pairs"]
    assert (pair["variant"], pair["seeds"], pair["tasks"]) == ("baseline", [1], 4)
    np.testing.assert_allclose(pair["shared_minus_isolated"][0], np.mean(base[1]) - np.mean(ip))
    # gains: SP from 0.5, IP from 0.25 at step 0
    np.testing.assert_allclose(pair["gain_shared_minus_isolated"][0],
                               (np.mean(base[1]) - 0.5) - (np.mean(ip) - 0.25))
    assert os.path.getsize(tmp_path / "out" / "levers.png") > 10_000
    np.testing.assert_allclose(rows["baseline"]["final"][0], np.mean(base[0] + base[1]))
    np.testing.assert_allclose(rows["balance"]["vs_baseline"][0], (0.25 + 0.125) / 2)
    np.testing.assert_allclose(rows["balance"]["delta_step0"][0], np.mean(bal[0] + bal[1]) - 0.5)
    lo, hi = rows["balance"]["vs_baseline"][1:]
    assert lo <= 0.1875 <= hi and lo >= 0.0  # every paired difference is >= 0
    assert rows["balance"]["seeds"] == [0, 1] and res["unfinished"] == ["bal-s2"]
    gen = [e for e in res["roles"] if e["variant"] == "balance" and e["role"] == "generator"][0]
    assert (gen["share_before"], gen["share_after"]) == (0.8, 0.5)
    text = open(res["readme"]).read()
    assert "| voting | shared | balance | 0,1 | 4 |" in text and "`bal-s2`" in text
    assert "| voting | baseline | 1 | 4 | +0.250 [" in text and "![levers](levers.png)" in text
    only0 = write_levers_report(root, tmp_path / "only0", n_boot=200, seeds=[0])
    assert {tuple(r["seeds"]) for r in only0["rows"]} == {(0,)} and only0["policy_pairs"] == []
    # the module's command line writes the same report
    out = tmp_path / "cli"
    subprocess.run([sys.executable, "-m", "marl_jax.experiments.report", "levers", f"--root={root}", f"--out={out}"],
                   check=True, cwd=REPO, capture_output=True)
    assert json.load(open(out / "levers.json"))["unfinished"] == ["bal-s2"]
