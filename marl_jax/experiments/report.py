"""Sweep report: per-cell numbers, base-relative heatmaps, Isolated-vs-Shared comparison, curves, cliffs.

A sweep root holds one run folder per cell, ``<root>/<cell>/``, with ``config.json`` (written by the
trainer), ``cell.json`` (written by the sweep; preferred where both say something), ``metrics.jsonl``
(:mod:`marl_jax.train.metrics`) and ``run.log``; ``<root>/sweep.jsonl`` holds the sweep's record of
each launch (:mod:`marl_jax.experiments.matrix`), whose last exit code per cell says whether it failed.
Everything here is a pure function of those files:
:func:`load_cells` -> :func:`summarize` (one flat dict per cell) -> figures and tables;
:func:`write_report` puts them in a folder with a ``README.md``.

Numbers, all from the ``val/success`` curve:

- ``base``: the matching base cell's value (kind ``"base"``: the untrained model, ``train.steps=0``;
  same task and model; of the same workflow when there is one, else of any workflow (the
  sweep's base cells run single_agent); of the same seed when there is one, else the mean over
  seeds), else the run's own step-0 validation (``base_from="step0"`` always uses step 0).
- ``peak``: the maximum over trained checkpoints (step > 0; earliest on ties) and its step.
- ``final``: the value at the last validated step.
- ``delta_peak`` / ``delta_final``: ``peak - base`` / ``final - base``.
- ``cliff_step``: :func:`marl_jax.train.cliff.detect_cliff` on the whole curve (step 0 included).

Per role: the final ``val/<role>/accuracy`` and the mean of ``grad/<role>/share`` over train steps.

A cell's ``status`` is ``"ok"``, ``"incomplete"`` (metrics stop before ``train.steps`` and the run
did not finish: still running, or killed) or ``"missing"`` (no metrics, unreadable metrics, no
validation after step 0, or the sweep's last launch of it exited non-zero); ``problem`` says why. Aggregate
figures use ``"ok"`` cells (and ``"incomplete"`` ones with ``include_incomplete``); every cell is
listed in the tables, the others flagged.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from marl_jax.config import MODELS
from marl_jax.train.cliff import DEFAULTS as CLIFF_DEFAULTS
from marl_jax.train.cliff import detect_cliff, trailing_mean
from marl_jax.train.metrics import read_metrics
from marl_jax.train.summary import TRAIN_WINDOW, curve, infer_roles, merge_by_step

__all__ = ["Cell", "Grid", "all_roles", "load_cells", "load_cell", "sweep_exit_codes", "summarize", "model_label",
           "model_scale", "heatmap_grids",
           "heatmap_figure", "match_ip_sp", "ip_sp_figure", "curves_figures", "grad_figures", "cells_csv",
           "cells_table", "cliff_table", "ip_sp_table", "write_report", "WORKFLOW_ORDER", "FIELDS"]

WORKFLOW_ORDER = ("single_agent", "eval_opt", "voting", "orch_workers")
SWEEP_FILE, LOG_FILE = "sweep.jsonl", "run.log"  # written by marl_jax.experiments.matrix.run_sweep
# Override keys that name what a cell already records (its coordinates, where its files are, how long
# it ran: base cells have train.steps=0), not a change of method.
_COORD_KEYS = {"policy", "workflow", "seed", "train.seed", "model", "model.name", "model.dtype", "task",
               "task.kind", "task.path", "preset", "workdir", "train.steps"}
PANELS_PER_PAGE = 20
_PAGE_COLS = 5
# Fixed columns of the per-cell table and cells.csv; per-role columns follow.
FIELDS = ("name", "kind", "status", "problem", "workflow", "policy", "task", "model", "scale_b", "seed",
          "overrides", "base", "base_source", "peak", "peak_step", "final", "final_step", "delta_peak",
          "delta_final", "cliff_step", "last_step", "planned_steps")


# -- loading -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cell:
    """One run folder of a sweep. ``records`` is empty and ``problem`` set when it has no usable metrics."""

    name: str
    workdir: str
    kind: str  # "train" | "base"
    workflow: str
    policy: str
    task: str
    model: str  # short label (a preset key where the name is one, else the folder's basename)
    seed: int | None
    overrides: str  # the sweep's overrides other than coordinates, as text ("" when none)
    planned_steps: int | None
    finished: bool  # the trainer wrote its summary (a run stopped on a cliff also counts)
    records: tuple[dict, ...]
    problem: str | None


def _read_json(path: str) -> tuple[dict | None, str | None]:
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return None, f"unreadable {os.path.basename(path)} ({e})"
    if not isinstance(data, dict):
        return None, f"{os.path.basename(path)} is not a JSON object"
    return data, None


def model_label(name: Any) -> str:
    """Short model label: the preset key for a preset's model name, else the path's last component."""
    name = str(name or "?")
    for key, full in MODELS.items():
        if name in (key, full):
            return key
    return os.path.basename(name.rstrip("/\\")) or name


def model_scale(label: str) -> float | None:
    """Parameters in billions read from a model label ("qwen3-1.7b" -> 1.7, "smollm2-135m" -> 0.135)."""
    m = re.search(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)([mb])(?![a-z])", label.lower().replace("_", "-"))
    if not m:
        return None
    return float(m.group(1)) * (1e-3 if m.group(2) == "m" else 1.0)


def _overrides_text(overrides: Any) -> str:
    """Canonical text of the overrides that are not cell coordinates (policy, seed, model, ...)."""
    if not overrides:
        return ""
    if isinstance(overrides, Mapping):
        items = [(str(k), overrides[k]) for k in overrides]
    elif isinstance(overrides, (list, tuple)):
        items = []
        for o in overrides:
            k, _, v = str(o).partition("=")
            items.append((k, v))
    else:
        items = [(str(overrides), "")]
    keep = []
    for k, v in items:
        bare = k.lstrip("-")
        bare = bare[len("config."):] if bare.startswith("config.") else bare
        if bare not in _COORD_KEYS:
            keep.append(f"{bare}={json.dumps(v) if not isinstance(v, str) else v}")
    return ",".join(sorted(keep))


def sweep_exit_codes(root: str | os.PathLike) -> dict[str, int | None]:
    """``{cell name: exit code of its last record}`` from ``<root>/sweep.jsonl`` (None: interrupted, or
    skipped because the sweep found it done; {} without the file). Unreadable lines (a cut write) are
    skipped."""
    path = os.path.join(os.fspath(root), SWEEP_FILE)
    out: dict[str, int | None] = {}
    if not os.path.isfile(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("cell"), str):
                rc = rec.get("returncode")
                out[rec["cell"]] = rc if isinstance(rc, int) and not isinstance(rc, bool) else None
    return out


def _log_tail(workdir: str, chars: int = 200) -> str:
    """The last non-empty line of the run's log (usually the error), shortened."""
    try:
        with open(os.path.join(workdir, LOG_FILE), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = [x.strip() for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][-chars:] if lines else ""


def load_cell(workdir: str | os.PathLike, exit_codes: Mapping[str, int | None] | None = None) -> Cell:
    """Reads one run folder; problems (no metrics, unreadable files, a non-zero exit code in
    ``exit_codes`` (:func:`sweep_exit_codes`): the sweep's last launch of it failed) go in ``problem``."""
    workdir = os.fspath(workdir)
    cj, cerr = _read_json(os.path.join(workdir, "cell.json"))
    cfg, ferr = _read_json(os.path.join(workdir, "config.json"))
    cj, cfg = cj or {}, cfg or {}
    name = str(cj.get("name") or os.path.basename(workdir.rstrip("/\\")))
    exit_code = (exit_codes or {}).get(name)
    problem = cerr or ferr
    if problem is None and exit_code not in (None, 0):
        tail = _log_tail(workdir)
        problem = f"run failed (exit {exit_code})" + (f": {tail}" if tail else "")
    train = cfg.get("train") if isinstance(cfg.get("train"), Mapping) else {}
    task_cfg = cfg.get("task") if isinstance(cfg.get("task"), Mapping) else {}
    model_cfg = cfg.get("model") if isinstance(cfg.get("model"), Mapping) else {}
    task = cj.get("task", task_cfg.get("kind", "?"))
    if isinstance(task, Mapping):
        task = task.get("kind", "?")
    steps = train.get("steps")
    planned = int(steps) if isinstance(steps, (int, float)) and not isinstance(steps, bool) else None
    seed = cj.get("seed", train.get("seed"))
    kind = cj.get("kind") or ("base" if planned == 0 else "train")
    records: list[dict] = []
    if problem is None:
        try:
            records = read_metrics(workdir)
        except FileNotFoundError:
            problem = "no metrics.jsonl"
        except (ValueError, OSError) as e:
            problem = f"unreadable metrics ({e})"
    if problem is None and not records:
        problem = "metrics.jsonl is empty"
    return Cell(
        name=name, workdir=workdir, kind=str(kind),
        workflow=str(cj.get("workflow", cfg.get("workflow", "?"))),
        policy=str(cj.get("policy", cfg.get("policy", "?"))), task=str(task),
        model=model_label(cj.get("model", model_cfg.get("name"))),
        seed=int(seed) if isinstance(seed, (int, float)) and not isinstance(seed, bool) else None,
        overrides=_overrides_text(cj.get("overrides")), planned_steps=planned,
        finished=os.path.isfile(os.path.join(workdir, "summary.md")),
        records=tuple(records) if problem is None else (), problem=problem)


def load_cells(root: str | os.PathLike) -> list[Cell]:
    """Every run folder directly under ``root`` (one holding cell.json, config.json or metrics.jsonl),
    with the exit codes of ``<root>/sweep.jsonl``."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"sweep root {root!r} is not a folder; pass the folder holding one run folder per cell")
    codes = sweep_exit_codes(root)
    cells = []
    for entry in sorted(os.listdir(root)):
        d = os.path.join(root, entry)
        if os.path.isdir(d) and any(os.path.isfile(os.path.join(d, f))
                                    for f in ("cell.json", "config.json", "metrics.jsonl")):
            cells.append(load_cell(d, codes))
    if not cells:
        raise FileNotFoundError(f"no run folders under {root!r} (expected <root>/<cell>/cell.json or config.json)")
    return cells


# -- per-cell numbers ----------------------------------------------------------------------------

def _workflow_rank(w: str) -> tuple[int, str]:
    return (WORKFLOW_ORDER.index(w) if w in WORKFLOW_ORDER else len(WORKFLOW_ORDER), w)


def _scale_rank(model: str) -> tuple[float, str]:
    s = model_scale(model)
    return (s if s is not None else math.inf, model)


def _sort_key(s: Mapping[str, Any]) -> tuple:
    return (s["kind"] != "train", s["task"], _workflow_rank(s["workflow"]), _scale_rank(s["model"]), s["policy"],
            s["seed"] if s["seed"] is not None else -1, s["name"])


def _own_numbers(cell: Cell, cliff_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: None for k in ("step0", "peak", "peak_step", "final", "final_step", "cliff_step",
                                             "cliff_peak_step", "cliff_peak_value", "last_step")}
    out.update(role_acc={}, role_share={}, roles=[])
    if not cell.records:
        return out
    merged = merge_by_step(cell.records)
    out["last_step"] = max(merged)
    roles = infer_roles(cell.records)
    out["roles"] = roles
    s, v = curve(merged, "val/success")
    if len(v):
        out["step0"] = float(v[0]) if s[0] == 0 else None
        trained = s > 0
        if trained.any():
            i = int(np.argmax(v[trained]))
            out["peak"], out["peak_step"] = float(v[trained][i]), int(s[trained][i])
        out["final"], out["final_step"] = float(v[-1]), int(s[-1])
        rep = detect_cliff(s, v, **cliff_kwargs)
        if rep.detected:
            out.update(cliff_step=rep.step, cliff_peak_step=rep.peak_step, cliff_peak_value=rep.peak_value)
    for r in roles:
        rs, rv = curve(merged, f"val/{r}/accuracy")
        if len(rv):
            out["role_acc"][r] = float(rv[-1])
        gs, gv = curve(merged, f"grad/{r}/share")
        if len(gv):
            out["role_share"][r] = float(gv.mean())
    return out


def _status(cell: Cell, own: Mapping[str, Any]) -> tuple[str, str | None]:
    if cell.problem:
        return "missing", cell.problem
    if own["final"] is None:
        return "missing", "no val/success record"
    if cell.planned_steps is not None and own["last_step"] < cell.planned_steps and not cell.finished:
        return "incomplete", f"metrics stop at step {own['last_step']} of {cell.planned_steps}"
    if cell.kind == "train" and own["peak"] is None:
        return "missing", "no validation after step 0"
    return "ok", None


def _base_cell_value(own: Mapping[str, Any]) -> float | None:
    return own["step0"] if own["step0"] is not None else own["final"]


def summarize(cells: Sequence[Cell], *, base_from: str = "cell", **cliff_kwargs: Any) -> list[dict[str, Any]]:
    """One flat dict per cell (keys :data:`FIELDS` plus ``role_acc`` / ``role_share`` dicts and
    ``cliff_peak_step`` / ``cliff_peak_value``), sorted by task, workflow, model scale, policy, seed.

    ``base_from``: ``"cell"`` (a matching base cell when there is one, else step 0) or ``"step0"``.
    ``cliff_kwargs`` go to :func:`marl_jax.train.cliff.detect_cliff`.
    """
    if base_from not in ("cell", "step0"):
        raise ValueError(f"base_from must be 'cell' or 'step0', got {base_from!r}")
    owns = [_own_numbers(c, cliff_kwargs) for c in cells]
    # base cells with a value, by (task, model) -> [(workflow, seed, value, name)]
    bases: dict[tuple, list[tuple[str, Any, float, str]]] = {}
    for c, own in zip(cells, owns):
        if c.kind == "base" and not c.problem and _base_cell_value(own) is not None:
            bases.setdefault((c.task, c.model), []).append((c.workflow, c.seed, _base_cell_value(own), c.name))
    out = []
    for c, own in zip(cells, owns):
        status, problem = _status(c, own)
        base, source = None, None
        if c.kind == "base":
            base, source = _base_cell_value(own), "this cell"
        else:
            found = bases.get((c.task, c.model), []) if base_from == "cell" else []
            found = [b for b in found if b[0] == c.workflow] or found  # same workflow first
            found = [b for b in found if b[1] == c.seed] or found  # then same seed, else mean over seeds
            if len(found) == 1:
                base, source = found[0][2], f"base cell {found[0][3]}"
            elif found:
                base = float(np.mean([b[2] for b in found]))
                source = f"mean of base cells {', '.join(sorted(b[3] for b in found))}"
            elif own["step0"] is not None:
                base, source = own["step0"], "step 0"
        train = c.kind == "train"
        row = {
            "name": c.name, "kind": c.kind, "status": status, "problem": problem, "workflow": c.workflow,
            "policy": c.policy, "task": c.task, "model": c.model, "scale_b": model_scale(c.model), "seed": c.seed,
            "overrides": c.overrides, "base": base, "base_source": source,
            "peak": own["peak"] if train else None, "peak_step": own["peak_step"] if train else None,
            "final": own["final"] if train else None, "final_step": own["final_step"] if train else None,
            "delta_peak": None, "delta_final": None, "cliff_step": own["cliff_step"],
            "cliff_peak_step": own["cliff_peak_step"], "cliff_peak_value": own["cliff_peak_value"],
            "last_step": own["last_step"], "planned_steps": c.planned_steps,
            "roles": own["roles"], "role_acc": own["role_acc"], "role_share": own["role_share"],
        }
        if base is not None and row["peak"] is not None:
            row["delta_peak"] = row["peak"] - base
        if base is not None and row["final"] is not None:
            row["delta_final"] = row["final"] - base
        out.append(row)
    return sorted(out, key=_sort_key)


def _usable(s: Mapping[str, Any], include_incomplete: bool) -> bool:
    return (s["kind"] == "train" and s["peak"] is not None and s["final"] is not None
            and (s["status"] == "ok" or (include_incomplete and s["status"] == "incomplete")))


def all_roles(summaries: Iterable[Mapping[str, Any]]) -> list[str]:
    """Roles of every cell in first-seen order (fixes each role's color across figures)."""
    roles: list[str] = []
    for s in summaries:
        roles += [r for r in s["roles"] if r not in roles]
    return roles


# -- heatmaps ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Grid:
    """One heatmap panel: ``values[i, j]`` is the mean over seeds for workflow ``rows[i]`` and model
    ``cols[j]`` (NaN where no usable cell), ``counts[i, j]`` how many cells it averages."""

    task: str
    policy: str
    rows: tuple[str, ...]
    cols: tuple[str, ...]
    values: np.ndarray
    counts: np.ndarray


def heatmap_grids(summaries: Sequence[Mapping[str, Any]], metric: str, *,
                  include_incomplete: bool = False) -> list[Grid]:
    """Panels (task x policy, over every train cell listed, usable or not) of ``metric``
    (e.g. ``"delta_final"``) on workflow rows x model-scale columns; a missing combination stays NaN."""
    train = [s for s in summaries if s["kind"] == "train"]
    rows = tuple(sorted({s["workflow"] for s in train}, key=_workflow_rank))
    cols = tuple(sorted({s["model"] for s in train}, key=_scale_rank))
    tasks = sorted({s["task"] for s in train})
    policies = sorted({s["policy"] for s in train}, key=lambda p: (p != "shared", p))
    grids = []
    for task in tasks:
        for policy in policies:
            acc = np.zeros((len(rows), len(cols)))
            n = np.zeros((len(rows), len(cols)), np.int64)
            for s in train:
                if ((s["task"], s["policy"]) == (task, policy) and _usable(s, include_incomplete)
                        and s[metric] is not None):
                    i, j = rows.index(s["workflow"]), cols.index(s["model"])
                    acc[i, j] += s[metric]
                    n[i, j] += 1
            vals = np.where(n > 0, acc / np.maximum(n, 1), np.nan)
            grids.append(Grid(task, policy, rows, cols, vals, n))
    return grids


def _new_figure(w: float, h: float) -> Figure:
    fig = Figure(figsize=(w, h), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def heatmap_figure(grids: Sequence[Grid], title: str) -> Figure:
    """One panel per grid (rows: task, columns: policy), a diverging color scale centred
    on 0 shared by all panels, each square annotated with its value ("n/a" when empty)."""
    if not grids:
        raise ValueError("no heatmap panels: the sweep has no train cells")
    prow = sorted({g.task for g in grids})
    pcol = list(dict.fromkeys(g.policy for g in grids))
    nr, nc = len(grids[0].rows), len(grids[0].cols)
    fig = _new_figure(max(4.0, 1.1 * nc + 2.2) * len(pcol) + 0.8, max(2.6, 0.55 * nr + 1.6) * len(prow))
    finite = np.concatenate([g.values[np.isfinite(g.values)] for g in grids])
    lim = max(float(np.abs(finite).max()) if finite.size else 0.0, 0.05)
    import matplotlib

    cmap = matplotlib.colormaps["RdBu"].with_extremes(bad="white")
    im = None
    for g in grids:
        ax = fig.add_subplot(len(prow), len(pcol), prow.index(g.task) * len(pcol) + pcol.index(g.policy) + 1)
        im = ax.imshow(np.ma.masked_invalid(g.values), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto")
        ax.set_xticks(range(nc), g.cols, fontsize=8, rotation=20)
        ax.set_yticks(range(nr), g.rows, fontsize=8)
        ax.set_xticks(np.arange(nc + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(nr + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="lightgray", lw=0.8)
        ax.tick_params(which="minor", length=0)
        for i in range(nr):
            for j in range(nc):
                v = g.values[i, j]
                if math.isfinite(v):
                    txt = f"{v:+.3f}" + (f"\n(n={g.counts[i, j]})" if g.counts[i, j] > 1 else "")
                    color = "white" if abs(v) > 0.6 * lim else "black"
                else:
                    txt, color = "n/a", "gray"
                ax.text(j, i, txt, ha="center", va="center", fontsize=8, color=color)
        ax.set_title(f"{g.task} / {g.policy}", fontsize=9)
    fig.colorbar(im, ax=fig.axes, shrink=0.8, label="val/success change vs base")
    fig.suptitle(title, fontsize=10)
    return fig


# -- Isolated vs Shared --------------------------------------------------------------------------

def match_ip_sp(summaries: Sequence[Mapping[str, Any]], *, include_incomplete: bool = False
                ) -> tuple[list[dict[str, Any]], list[str]]:
    """Pairs of usable train cells equal in workflow, task, model and seed, one shared and
    one isolated. Returns ``(pairs, unmatched)``: a pair holds both names and their ``peak`` /
    ``final`` (``sp_*``, ``ip_*``); ``unmatched`` names the usable cells without a counterpart, among
    workflows the sweep runs under both policies (a one-role workflow runs shared only)."""
    groups: dict[tuple, dict[str, list]] = {}
    for s in summaries:
        if _usable(s, include_incomplete) and s["policy"] in ("shared", "isolated"):
            key = (s["workflow"], s["task"], s["model"], s["seed"])
            groups.setdefault(key, {"shared": [], "isolated": []})[s["policy"]].append(s)
    pairs, unmatched = [], []
    for key, g in groups.items():
        sp, ip = sorted(g["shared"], key=lambda s: s["name"]), sorted(g["isolated"], key=lambda s: s["name"])
        for a, b in zip(sp, ip):
            pairs.append({"workflow": key[0], "task": key[1], "model": key[2], "seed": key[3],
                          "shared": a["name"], "isolated": b["name"], "sp_peak": a["peak"], "ip_peak": b["peak"],
                          "sp_final": a["final"], "ip_final": b["final"]})
        unmatched += [(key[0], s["name"]) for s in (sp[len(ip):] + ip[len(sp):])]
    policies: dict[str, set] = {}
    for s in summaries:
        if s["kind"] == "train":
            policies.setdefault(s["workflow"], set()).add(s["policy"])
    both = {w for w, ps in policies.items() if ps >= {"shared", "isolated"}}
    pairs.sort(key=lambda p: (p["task"], _workflow_rank(p["workflow"]), _scale_rank(p["model"]),
                              p["seed"] if p["seed"] is not None else -1))
    return pairs, sorted(n for w, n in unmatched if w in both)


def ip_sp_figure(pairs: Sequence[Mapping[str, Any]]) -> tuple[Figure, dict[str, np.ndarray]]:
    """Scatter of Isolated (y) against Shared (x) val/success, peak (circles) and final (squares),
    colored by workflow, with the diagonal. Returns the figure and the drawn points,
    ``{"peak": (n, 2) array of (sp, ip), "final": ...}`` in ``pairs`` order."""
    fig = _new_figure(5.6, 5.0)
    ax = fig.add_subplot(1, 1, 1)
    ax.grid(True, alpha=0.3)
    drawn = {m: np.array([[p[f"sp_{m}"], p[f"ip_{m}"]] for p in pairs], np.float64).reshape(-1, 2)
             for m in ("peak", "final")}
    workflows = sorted({p["workflow"] for p in pairs}, key=_workflow_rank)
    colors = [f"C{workflows.index(p['workflow']) % 10}" for p in pairs]
    for m, marker, fill in (("peak", "o", True), ("final", "s", False)):
        if len(drawn[m]):
            ax.scatter(drawn[m][:, 0], drawn[m][:, 1], marker=marker, s=36, linewidths=1.3,
                       c=colors if fill else "none", edgecolors=colors, label=m, zorder=3)
    pts = np.concatenate([drawn["peak"], drawn["final"]]) if pairs else np.zeros((0, 2))
    lo = min(0.0, float(pts.min())) if len(pts) else 0.0
    hi = max(1.0, float(pts.max())) if len(pts) else 1.0
    ax.plot([lo, hi], [lo, hi], color="gray", ls="--", lw=1, zorder=1)
    ax.set(xlim=(lo - 0.02, hi + 0.02), ylim=(lo - 0.02, hi + 0.02), xlabel="Shared policy val/success",
           ylabel="Isolated policy val/success",
           title="Isolated vs Shared, matched cells\n(above the diagonal: Isolated better)")
    handles = [ax.scatter([], [], marker="o", color="black", label="peak"),
               ax.scatter([], [], marker="s", facecolors="none", edgecolors="black", label="final")]
    handles += [ax.scatter([], [], marker="o", color=f"C{i % 10}", label=w) for i, w in enumerate(workflows)]
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    if not pairs:
        ax.text(0.5, 0.5, "no matched shared/isolated cells", ha="center", va="center", transform=ax.transAxes,
                color="gray")
    return fig, drawn


# -- small multiples -----------------------------------------------------------------------------

def _pages(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[i:i + PANELS_PER_PAGE] for i in range(0, len(items), PANELS_PER_PAGE)] or [[]]


def _grid_figure(n: int) -> tuple[Figure, list]:
    cols = min(max(n, 1), _PAGE_COLS)
    rows = max(1, math.ceil(n / cols))
    fig = _new_figure(3.3 * cols, 2.5 * rows + 0.4)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(which="both", labelsize=7)
    return fig, axes


def _cells_with_records(cells: Sequence[Cell], summaries: Sequence[Mapping[str, Any]]) -> list[tuple]:
    by_name = {c.name: c for c in cells}
    return [(s, by_name[s["name"]]) for s in summaries
            if s["kind"] == "train" and s["name"] in by_name and by_name[s["name"]].records]


def curves_figures(cells: Sequence[Cell], summaries: Sequence[Mapping[str, Any]]
                   ) -> list[tuple[Figure, dict[str, dict[str, Any]]]]:
    """Pages of panels, one per train cell with metrics: val/success (black dots), train success
    smoothed over ``TRAIN_WINDOW`` steps (gray), the base (dotted) and a detected cliff (red X).
    Each page comes with what it drew per cell: ``{"val": (steps, values), "train": (steps, smoothed),
    "base": float|None, "cliff": (step, value)|None}``."""
    pages = []
    for page in _pages(_cells_with_records(cells, summaries)):
        fig, axes = _grid_figure(len(page))
        drawn: dict[str, dict[str, Any]] = {}
        for ax, (s, c) in zip(axes, page):
            merged = merge_by_step(c.records)
            vs, vv = curve(merged, "val/success")
            ts, tv = curve(merged, "success")
            smooth = trailing_mean(tv, TRAIN_WINDOW) if len(tv) else tv
            d: dict[str, Any] = {"val": (vs, vv), "train": (ts, smooth), "base": s["base"], "cliff": None}
            if len(ts):
                ax.plot(ts, smooth, color="tab:gray", lw=1.2, label=f"train success (mean of {TRAIN_WINDOW})")
            if len(vs):
                ax.plot(vs, vv, "o-", color="black", ms=3, lw=1.2, label="val/success")
            if s["base"] is not None:
                ax.axhline(s["base"], color="tab:blue", ls=":", lw=1.2, label="base")
            if s["cliff_step"] is not None:
                y = float(vv[list(vs).index(s["cliff_step"])])
                ax.axvline(s["cliff_step"], color="red", ls="--", lw=0.9)
                ax.plot([s["cliff_step"]], [y], "X", color="red", ms=9, zorder=5, label="cliff")
                d["cliff"] = (s["cliff_step"], y)
            ax.set_title(s["name"] + ("" if s["status"] == "ok" else f" [{s['status']}]"), fontsize=8)
            ax.set_ylim(-0.03, 1.03)
            drawn[s["name"]] = d
        if axes:
            axes[0].legend(fontsize=6, loc="best")
        fig.suptitle("Validation and smoothed train success per cell (dotted: base; X: terminal cliff)", fontsize=10)
        pages.append((fig, drawn))
    return pages


def grad_figures(cells: Sequence[Cell], summaries: Sequence[Mapping[str, Any]], which: str
                 ) -> list[tuple[Figure, dict[str, dict[str, tuple]]]]:
    """Pages of per-cell panels of per-role gradient traces, smoothed over ``TRAIN_WINDOW`` steps.
    ``which="norm"``: ``grad/<role>/norm`` on a log axis; ``which="share"``: ``grad/<role>/share``
    (solid) and ``grad/<role>/norm_share`` (dashed). A role has one color in every panel. Each page
    comes with ``{cell: {key: (steps, smoothed)}}``."""
    if which not in ("norm", "share"):
        raise ValueError(f"which must be 'norm' or 'share', got {which!r}")
    color = {r: f"C{i % 10}" for i, r in enumerate(all_roles(summaries))}
    pages = []
    for page in _pages(_cells_with_records(cells, summaries)):
        fig, axes = _grid_figure(len(page))
        drawn: dict[str, dict[str, tuple]] = {}
        for ax, (s, c) in zip(axes, page):
            merged = merge_by_step(c.records)
            d: dict[str, tuple] = {}
            for r in s["roles"]:
                keys = [(f"grad/{r}/norm", "-")] if which == "norm" else [(f"grad/{r}/share", "-"),
                                                                          (f"grad/{r}/norm_share", "--")]
                for key, ls in keys:
                    gs, gv = curve(merged, key)
                    if which == "norm":
                        gs, gv = gs[gv > 0], gv[gv > 0]  # log axis
                    if len(gv):
                        sm = trailing_mean(gv, TRAIN_WINDOW)
                        ax.plot(gs, sm, color=color[r], ls=ls, lw=1.3, label=key.split("/", 1)[1])
                        d[key] = (gs, sm)
            if not d:
                ax.text(0.5, 0.5, "no gradient diagnostics", ha="center", va="center", transform=ax.transAxes,
                        color="gray", fontsize=8)
            elif which == "norm":
                ax.set_yscale("log")
            else:
                ax.axhline(0, color="black", lw=0.5)
            ax.set_title(s["name"], fontsize=8)
            drawn[s["name"]] = d
        from matplotlib.lines import Line2D

        shown = [r for r in color if any(k.startswith(f"grad/{r}/") for d in drawn.values() for k in d)]
        if shown:  # one legend per page: a role has the same color in every panel
            fig.legend(handles=[Line2D([], [], color=color[r], lw=1.5, label=r) for r in shown],
                       loc="outside lower center", ncols=min(len(shown), 6), fontsize=8)
        title = ("Per-role gradient norm" if which == "norm" else
                 "Per-role gradient share (solid: share; dashed: norm share)")
        fig.suptitle(f"{title}, mean of last {TRAIN_WINDOW} steps", fontsize=10)
        pages.append((fig, drawn))
    return pages


# -- tables --------------------------------------------------------------------------------------

def _fmt(x: Any, signed: bool = False) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "-"
        return f"{x:+.3f}" if signed else f"{x:.3f}"
    return str(x)


def _md(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    esc = lambda x: str(x).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def cells_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table, one row per cell: base, peak (step), final, deltas, cliff step, per-role final
    accuracy and mean gradient share."""
    roles = all_roles(summaries)
    header = ["cell", "workflow", "policy", "task", "model", "seed", "status", "base", "peak", "peak step", "final",
              "Δ peak", "Δ final", "cliff step"]
    header += [f"acc {r}" for r in roles] + [f"share {r}" for r in roles]
    rows = []
    for s in summaries:
        rows.append([s["name"] + (" (base)" if s["kind"] == "base" else ""), s["workflow"],
                     "-" if s["kind"] == "base" else s["policy"], s["task"], s["model"], _fmt(s["seed"]),
                     s["status"] + (f": {s['problem']}" if s["problem"] else ""), _fmt(s["base"]), _fmt(s["peak"]),
                     _fmt(s["peak_step"]), _fmt(s["final"]), _fmt(s["delta_peak"], True),
                     _fmt(s["delta_final"], True), _fmt(s["cliff_step"])]
                    + [_fmt(s["role_acc"].get(r)) for r in roles] + [_fmt(s["role_share"].get(r)) for r in roles])
    return _md(header, rows)


def cells_csv(summaries: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> list[str]:
    """Writes every number of :func:`cells_table` (full precision, blank when absent) to ``path``;
    returns the header (:data:`FIELDS`, then ``acc/<role>`` and ``share/<role>``)."""
    roles = all_roles(summaries)
    header = list(FIELDS) + [f"acc/{r}" for r in roles] + [f"share/{r}" for r in roles]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        for s in summaries:
            vals = [s[k] for k in FIELDS] + [s["role_acc"].get(r) for r in roles] + [
                s["role_share"].get(r) for r in roles]
            w.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in vals])
    return header


def cliff_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    rows = [[s["name"], s["cliff_step"], _fmt(s["cliff_peak_value"]), s["cliff_peak_step"], _fmt(s["final"])]
            for s in summaries if s["cliff_step"] is not None]
    if not rows:
        return "No cell has a terminal cliff.\n"
    return _md(["cell", "cliff step", "peak before (smoothed)", "at step", "final"], rows)


def ip_sp_table(pairs: Sequence[Mapping[str, Any]]) -> str:
    rows = [[p["workflow"], p["task"], p["model"], _fmt(p["seed"]), _fmt(p["sp_peak"]), _fmt(p["ip_peak"]),
             _fmt(p["ip_peak"] - p["sp_peak"], True), _fmt(p["sp_final"]), _fmt(p["ip_final"]),
             _fmt(p["ip_final"] - p["sp_final"], True)] for p in pairs]
    if pairs:
        dp = float(np.mean([p["ip_peak"] - p["sp_peak"] for p in pairs]))
        df = float(np.mean([p["ip_final"] - p["sp_final"] for p in pairs]))
        rows.append(["**mean**", "", "", "", "", "", _fmt(dp, True), "", "", _fmt(df, True)])
    return _md(["workflow", "task", "model", "seed", "SP peak", "IP peak", "IP - SP peak", "SP final", "IP final",
                "IP - SP final"], rows)


# -- the report folder ---------------------------------------------------------------------------

def _save_pages(pages: Sequence[tuple[Figure, Any]], out: str, stem: str) -> list[str]:
    names = [f"{stem}.png"] if len(pages) == 1 else [f"{stem}_{i + 1}.png" for i in range(len(pages))]
    for (fig, _), name in zip(pages, names):
        fig.savefig(os.path.join(out, name))
    return names


def write_report(root: str | os.PathLike, out: str | os.PathLike, *, base_from: str = "cell",
                 include_incomplete: bool = False, cliff_drop: float = float(CLIFF_DEFAULTS["drop"])
                 ) -> dict[str, Any]:
    """Reads the sweep under ``root`` and writes ``README.md``, ``cells.csv`` and the PNGs into ``out``.
    Returns ``{"readme", "files", "summaries", "pairs", "missing"}``."""
    root, out = os.fspath(root), os.fspath(out)
    cells = load_cells(root)
    os.makedirs(out, exist_ok=True)
    summaries = summarize(cells, base_from=base_from, drop=cliff_drop)
    pairs, unmatched = match_ip_sp(summaries, include_incomplete=include_incomplete)
    files: list[str] = []
    heat = {}
    for metric, label in (("delta_final", "final"), ("delta_peak", "peak")):
        grids = heatmap_grids(summaries, metric, include_incomplete=include_incomplete)
        if grids:
            name = f"{metric}.png"
            heatmap_figure(grids, f"val/success {label} minus base (mean over seeds)").savefig(os.path.join(out, name))
            heat[metric] = name
            files.append(name)
    fig, _ = ip_sp_figure(pairs)
    fig.savefig(os.path.join(out, "ip_vs_sp.png"))
    files.append("ip_vs_sp.png")
    curves = _save_pages(curves_figures(cells, summaries), out, "curves")
    norms = _save_pages(grad_figures(cells, summaries, "norm"), out, "grad_norms")
    shares = _save_pages(grad_figures(cells, summaries, "share"), out, "grad_shares")
    files += curves + norms + shares
    cells_csv(summaries, os.path.join(out, "cells.csv"))
    files.append("cells.csv")

    missing = [s for s in summaries if s["status"] != "ok"]
    n_train = sum(s["kind"] == "train" for s in summaries)
    used = "ok and incomplete" if include_incomplete else "ok"
    md = [f"# Sweep report: `{root}`", "",
          f"{len(summaries)} cells ({n_train} train, {len(summaries) - n_train} base); "
          f"{sum(s['status'] == 'ok' for s in summaries)} ok, "
          f"{sum(s['status'] == 'incomplete' for s in summaries)} incomplete, "
          f"{sum(s['status'] == 'missing' for s in summaries)} missing or failed. "
          f"Figures use {used} train cells; the tables list every cell.", "",
          "All numbers are validation pass@1 (`val/success`, a fraction). *base*: "
          + ("the untrained model's base cell of the same task and model (same workflow when there is one, "
             "else of another workflow: the sweep's base cells run single_agent; same seed, else the mean over "
             "seeds), else the run's step-0 "
             "validation. " if base_from == "cell" else "the run's own step-0 validation. ") +
          "*peak*: best validation after step 0; *final*: last validation; Δ = value - base. "
          f"*cliff*: terminal collapse by at least {cliff_drop:g} from the running peak that never recovers "
          "(`marl_jax.train.cliff.detect_cliff`).", ""]
    variants = sorted({s["overrides"] for s in summaries if s["kind"] == "train"})
    if len(variants) > 1:  # the figures pool cells by coordinates only
        md += ["**Warning**: train cells differ in their overrides and the figures pool them: "
               + "; ".join(f"`{v or '(none)'}`" for v in variants) + ". See the `overrides` column of cells.csv.", ""]
    md += ["## Accuracy change against the base model", "",
           "Rows: workflow; columns: model (by scale); one panel per task and policy; n/a: no usable cell.", ""]
    md += [f"![{m}]({n})\n" for m, n in heat.items()]
    md += ["## Isolated vs Shared on matched cells", "",
           "Same workflow, task, model and seed; circles: peak, squares: final.", "",
           "![ip_vs_sp](ip_vs_sp.png)", "", ip_sp_table(pairs)]
    if unmatched:
        md += [f"Without a counterpart: {', '.join(unmatched)}.", ""]
    md += ["## Terminal cliffs", "", cliff_table(summaries)]
    md += ["## Every cell", "", "All numbers also in [cells.csv](cells.csv).", "", cells_table(summaries)]
    md += ["## Training curves", ""] + [f"![curves]({n})\n" for n in curves]
    md += ["## Per-role gradient norms", ""] + [f"![grad norms]({n})\n" for n in norms]
    md += ["## Per-role gradient shares", ""] + [f"![grad shares]({n})\n" for n in shares]
    md += ["## Missing, failed or incomplete cells", ""]
    md += [f"- `{s['name']}` ({s['status']}): {s['problem']}" for s in missing] or ["None."]
    readme = os.path.join(out, "README.md")
    with open(readme, "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    files.append("README.md")
    return {"readme": readme, "files": files, "summaries": summaries, "pairs": pairs,
            "missing": [s["name"] for s in missing]}


# -- error bars: bootstrap over tasks and seeds, paired differences ----------------------------------

def load_val_tasks(workdir: str | os.PathLike) -> dict[int, dict[str, float]]:
    """``<workdir>/val_tasks.jsonl`` (written by the trainer's validation): step -> {task id: mean success
    over its samples}; the last record of a step wins (a resumed run repeats it)."""
    path = os.path.join(os.fspath(workdir), "val_tasks.jsonl")
    out: dict[int, dict[str, float]] = {}
    if not os.path.isfile(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out[int(r["step"])] = {str(k): float(v) for k, v in r["success"].items()}
    return out


def bootstrap_mean(x: np.ndarray, *, n_boot: int = 4000, level: float = 0.95, seed: int = 0
                   ) -> tuple[float, float, float]:
    """Mean of x [seeds, tasks] and its percentile bootstrap interval, resampling seeds and tasks (the same
    task draw for every seed, as the tasks are shared). With one seed only tasks are resampled."""
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"bootstrap_mean needs a [seeds, tasks] array, got shape {x.shape}")
    rng = np.random.default_rng(seed)
    S, T = x.shape
    si = rng.integers(0, S, (n_boot, S)) if S > 1 else np.zeros((n_boot, 1), int)
    ti = rng.integers(0, T, (n_boot, T))
    means = np.array([x[s][:, t].mean() for s, t in zip(si, ti)])
    a = (1 - level) / 2
    return float(x.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def _variant(cell: Cell) -> str:
    cj, _ = _read_json(os.path.join(cell.workdir, "cell.json"))
    return str((cj or {}).get("variant") or "")


def _matrix(per_seed: Mapping[int, Mapping[str, float]], seeds: Sequence[int], tasks: Sequence[str]) -> np.ndarray:
    return np.array([[per_seed[s][t] for t in tasks] for s in seeds])


def levers_summary(root: str | os.PathLike, *, baseline: str = "baseline", n_boot: int = 4000,
                   seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """Per (workflow, policy, variant): final validation pass@1 with a bootstrap CI over seeds and tasks,
    its change from step 0, and the paired difference to the baseline variant on the same seeds and tasks;
    per role, the mean gradient shares before and after the levers; stability numbers from the metrics.

    Only finished cells count (their last validation is at their last planned step); `seeds`: only these
    (so that every row averages the same seeds while a sweep is part way through one)."""
    cells = [c for c in load_cells(root) if c.kind == "train" and c.problem is None
             and (seeds is None or c.seed in seeds)]
    groups: dict[tuple[str, str, str], dict[int, Cell]] = {}
    unfinished = []
    for c in cells:
        if not c.finished or c.seed is None:
            unfinished.append(c.name)
            continue
        groups.setdefault((c.workflow, c.policy, _variant(c)), {})[c.seed] = c
    rows, roles_out = [], []
    for key in sorted(groups, key=lambda k: (_workflow_rank(k[0]), k[1] != "shared", k[2] != baseline, k[2])):
        wf, pol, var = key
        by_seed = groups[key]
        val = {s: load_val_tasks(c.workdir) for s, c in by_seed.items()}
        seeds = sorted(s for s in val if val[s])
        if not seeds:
            unfinished += [c.name for c in by_seed.values()]
            continue
        final = {s: val[s][max(val[s])] for s in seeds}
        first = {s: val[s][min(val[s])] for s in seeds}
        tasks = sorted(set.intersection(*(set(final[s]) for s in seeds)))
        row = {"workflow": wf, "policy": pol, "variant": var, "seeds": seeds, "tasks": len(tasks),
               "final_step": {s: max(val[s]) for s in seeds}}
        row["final"] = bootstrap_mean(_matrix(final, seeds, tasks), n_boot=n_boot)
        row["final_by_seed"] = {s: float(np.mean([final[s][t] for t in tasks])) for s in seeds}
        row["delta_step0"] = bootstrap_mean(_matrix(final, seeds, tasks) - _matrix(first, seeds, tasks),
                                            n_boot=n_boot)
        base = groups.get((wf, pol, baseline))
        if var != baseline and base:
            bval = {s: load_val_tasks(base[s].workdir) for s in base}
            common = [s for s in seeds if bval.get(s)]
            if common:
                bfin = {s: bval[s][max(bval[s])] for s in common}
                ct = sorted(set(tasks).intersection(*(set(bfin[s]) for s in common)))
                d = _matrix(final, common, ct) - _matrix(bfin, common, ct)
                row["vs_baseline"] = bootstrap_mean(d, n_boot=n_boot)
                row["vs_baseline_seeds"] = common
        # shares, damping and stability from the training metrics
        train = [r for c in by_seed.values() for r in c.records if "loss" in r]
        row["skipped_updates"] = max((int(r.get("skipped_updates", 0)) for r in train), default=0)
        row["train_success_last3"] = float(np.mean([r["success"] for c in by_seed.values()
                                                    for r in [x for x in c.records if "loss" in x][-3:]
                                                    if "success" in r])) if train else None
        norms = [v for r in train for k, v in r.items() if k.startswith("grad/slot") and k.endswith("/norm")]
        row["max_slot_grad_norm"] = float(max(norms)) if norms else None
        rows.append(row)
        roles = sorted({k.split("/")[1] for r in train for k in r if k.startswith("grad/") and k.endswith("/share")
                        and not k.startswith("grad/cos")})
        for role in roles:
            # steps where the role had a gradient (all-equal rewards give it none: its shares read 0)
            pick = lambda name: [r[name] for r in train if name in r and r.get(f"grad/{role}/norm", 1.0) > 0]
            before = pick(f"lever/{role}/share_before") or pick(f"grad/{role}/share")
            entry = {"workflow": wf, "policy": pol, "variant": var, "role": role,
                     "share_before": float(np.mean(before)) if before else None,
                     "share_after": float(np.mean(pick(f"lever/{role}/share_after")))
                     if pick(f"lever/{role}/share_after") else None,
                     "norm_share_before": float(np.mean(pick(f"lever/{role}/norm_share_before") or
                                                        pick(f"grad/{role}/norm_share") or [np.nan])),
                     "norm_share_after": float(np.mean(pick(f"lever/{role}/norm_share_after")))
                     if pick(f"lever/{role}/norm_share_after") else None,
                     "damping_factor": float(np.mean(pick(f"lever/{role}/damping_factor")))
                     if pick(f"lever/{role}/damping_factor") else None}
            roles_out.append(entry)
    return {"rows": rows, "roles": roles_out, "policy_pairs": _policy_pairs(groups, n_boot),
            "unfinished": sorted(set(unfinished))}


def _policy_pairs(groups: Mapping[tuple[str, str, str], Mapping[int, Cell]], n_boot: int) -> list[dict[str, Any]]:
    """Shared minus Isolated for each (workflow, variant) run under both: the paired difference of final
    pass@1 and of the gain from step 0, on the seeds and tasks both have."""
    out = []
    for (wf, pol, var), sp in groups.items():
        ip = groups.get((wf, "isolated", var))
        if pol != "shared" or not ip:
            continue
        val = {p: {s: load_val_tasks(c.workdir) for s, c in g.items()} for p, g in (("shared", sp), ("isolated", ip))}
        seeds = sorted(s for s in val["shared"] if val["shared"][s] and val["isolated"].get(s))
        if not seeds:
            continue
        fin = {p: {s: val[p][s][max(val[p][s])] for s in seeds} for p in val}
        first = {p: {s: val[p][s][min(val[p][s])] for s in seeds} for p in val}
        tasks = sorted(set.intersection(*(set(fin[p][s]) & set(first[p][s]) for p in val for s in seeds)))
        m = {p: (_matrix(fin[p], seeds, tasks), _matrix(first[p], seeds, tasks)) for p in val}
        out.append({"workflow": wf, "variant": var, "seeds": seeds, "tasks": len(tasks),
                    "shared_minus_isolated": bootstrap_mean(m["shared"][0] - m["isolated"][0], n_boot=n_boot),
                    "gain_shared_minus_isolated": bootstrap_mean(
                        (m["shared"][0] - m["shared"][1]) - (m["isolated"][0] - m["isolated"][1]), n_boot=n_boot),
                    "by_seed": {s: float(np.mean(m["shared"][0][i] - m["isolated"][0][i])) for i, s in enumerate(seeds)}})
    return sorted(out, key=lambda r: (_workflow_rank(r["workflow"]), r["variant"] != "baseline", r["variant"]))


def levers_figure(res: Mapping[str, Any]) -> Figure:
    """Left: every paired difference with its interval (levers vs their baseline, Shared minus Isolated),
    a dashed line at 0. Right: the roles' norm shares of the Shared-Policy update before and after each lever."""
    diffs = [(f"{r['workflow']} {'SP' if r['policy'] == 'shared' else 'IP'} {r['variant']} - baseline",
              r["vs_baseline"]) for r in res["rows"] if r.get("vs_baseline")]
    diffs += [(f"{p['workflow']} {p['variant']}: SP - IP", p["shared_minus_isolated"]) for p in res["policy_pairs"]]
    shares = [e for e in res["roles"] if e["policy"] == "shared"]
    fig = _new_figure(13, max(3.0, 0.4 * max(len(diffs), len({(e['workflow'], e['variant']) for e in shares})) + 1.5))
    ax, bx = fig.subplots(1, 2, width_ratios=[1.2, 1])
    y = np.arange(len(diffs))[::-1]
    for yi, (_, (m, lo, hi)) in zip(y, diffs):
        color = "tab:blue" if lo > 0 else "tab:red" if hi < 0 else "0.3"
        ax.errorbar([m], [yi], xerr=[[m - lo], [hi - m]], fmt="o", color=color, capsize=3)
    ax.axvline(0, ls="--", color="0.5", lw=1)
    ax.set_yticks(y, [d[0] for d in diffs], fontsize=8)
    ax.set_xlabel("paired difference in final pass@1 (95% bootstrap interval)")
    ax.set_title("levers vs baseline; Shared vs Isolated")
    cells = list(dict.fromkeys((e["workflow"], e["variant"]) for e in shares))
    roles = list(dict.fromkeys(e["role"] for e in shares))
    cmap = {r: f"C{i}" for i, r in enumerate(roles)}
    yb = np.arange(len(cells))[::-1]
    labelled = set()
    for yi, (wf, var) in zip(yb, cells):
        left = {"before": 0.0, "after": 0.0}
        for e in (e for e in shares if (e["workflow"], e["variant"]) == (wf, var)):
            for off, when in ((0.18, "before"), (-0.18, "after")):
                v = e[f"norm_share_{when}"]
                if when == "after" and v is None:
                    v = e["norm_share_before"]
                if v is None or not np.isfinite(v):
                    continue
                bx.barh(yi + off, v, 0.34, left=left[when], color=cmap[e["role"]], alpha=1.0 if when == "after" else 0.45,
                        label=e["role"] if (e["role"] not in labelled and when == "after") else None)
                labelled.add(e["role"]) if when == "after" else None
                left[when] += v
    bx.set_yticks(yb, [f"{wf} {var}" for wf, var in cells], fontsize=8)
    bx.set_xlim(0, 1)
    bx.set_xlabel("norm share (pale: before the lever, solid: after)")
    bx.set_title("who takes the Shared-Policy step")
    if labelled:
        bx.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def _ci(t: tuple[float, float, float] | None, signed: bool = False) -> str:
    if t is None:
        return "-"
    return f"{_fmt(t[0], signed)} [{_fmt(t[1], signed)}, {_fmt(t[2], signed)}]"


def write_levers_report(root: str | os.PathLike, out: str | os.PathLike, **kw: Any) -> dict[str, Any]:
    """``<out>/README.md`` and ``<out>/levers.json`` from :func:`levers_summary`."""
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    res = levers_summary(root, **kw)
    seeds_all = sorted({s for r in res["rows"] for s in r["seeds"]})
    if res["rows"]:
        levers_figure(res).savefig(os.path.join(out, "levers.png"))
    with open(os.path.join(out, "levers.json"), "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1, default=lambda o: list(o) if isinstance(o, tuple) else str(o))
    md = [f"# Levers: `{os.fspath(root)}`", ""]
    if kw.get("seeds") is not None:
        md += [f"Only seeds {', '.join(map(str, kw['seeds']))} are counted (cells of other seeds are left out).", ""]
    md += [
          "Validation pass@1 = mean success over the samples of each task (temperature and samples per task "
          "as the cells ran them), averaged over tasks and seeds; brackets: 95% percentile bootstrap interval "
          "resampling seeds and tasks together. *vs baseline*: paired difference to the baseline variant of "
          "the same workflow and policy on the same seeds and tasks. *Δ step 0*: final minus the same run's "
          "step-0 validation (paired by task).", "",
          _md(["workflow", "policy", "variant", "seeds", "tasks", "final pass@1", "Δ step 0", "vs baseline",
               "train success (last 3)", "max slot grad norm", "skipped"],
              [(r["workflow"], r["policy"], r["variant"], ",".join(map(str, r["seeds"])), r["tasks"],
                _ci(r["final"]), _ci(r["delta_step0"], True), _ci(r.get("vs_baseline"), True),
                _fmt(r["train_success_last3"]), _fmt(r["max_slot_grad_norm"]), r["skipped_updates"])
               for r in res["rows"]]),
          "## Role shares of the update (mean over steps and seeds)", "",
          "Steps where the role had no gradient are left out. *share*: projection share <g_role, g_slot> / |g_slot|^2 of the role's gradient; *norm share*: "
          "|g_role| / sum of the slot's |g_role|; before / after the levers (after = before without levers).", "",
          _md(["workflow", "policy", "variant", "role", "share before", "share after", "norm share before",
               "norm share after", "damping factor"],
              [(e["workflow"], e["policy"], e["variant"], e["role"], _fmt(e["share_before"]), _fmt(e["share_after"]),
                _fmt(e["norm_share_before"]), _fmt(e["norm_share_after"]), _fmt(e["damping_factor"]))
               for e in res["roles"]]),
          "## Shared minus Isolated (paired: same workflow and variant, same seeds and tasks)", "",
          "*gain*: the difference of the two runs' change from step 0.", "",
          _md(["workflow", "variant", "seeds", "tasks", "SP - IP final pass@1", "SP - IP gain", "per seed"],
              [(p["workflow"], p["variant"], ",".join(map(str, p["seeds"])), p["tasks"],
                _ci(p["shared_minus_isolated"], True), _ci(p["gain_shared_minus_isolated"], True),
                " / ".join(_fmt(v, True) for v in p["by_seed"].values())) for p in res["policy_pairs"]])
          if res["policy_pairs"] else "No workflow ran under both policies.\n",
          "## Final pass@1 per seed", "",
          _md(["workflow", "policy", "variant"] + [f"seed {s}" for s in seeds_all],
              [(r["workflow"], r["policy"], r["variant"], *(_fmt(r["final_by_seed"].get(s)) for s in seeds_all))
               for r in res["rows"]]),
          "![levers](levers.png)", "",
          "## Cells not counted (unfinished or without per-task validation)", ""]
    md += [f"- `{n}`" for n in res["unfinished"]] or ["None."]
    readme = os.path.join(out, "README.md")
    with open(readme, "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    res["readme"] = readme
    return res


if __name__ == "__main__":  # python -m marl_jax.experiments.report levers --root=runs/levers --out=docs/results/levers
    from marl_jax.cli import ArgumentParser  # a mistake: one line, exit status 2

    ap = ArgumentParser(prog="python -m marl_jax.experiments.report",
                        description="Levers report with bootstrap intervals and paired differences.")
    ap.add_argument("what", choices=["levers"])
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="", help="comma-separated seeds to count (default: every finished cell)")
    a = ap.parse_args()
    try:
        seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else None
    except ValueError:
        ap.error(f"--seeds={a.seeds!r}: expected comma-separated integers, e.g. --seeds=0,1,2")
    try:
        r = write_levers_report(a.root, a.out, seeds=seeds)
    except FileNotFoundError as e:  # --root names no sweep
        ap.error(str(e))
    print(f"{len(r['rows'])} groups, {len(r['unfinished'])} cells not counted: {r['readme']}")
