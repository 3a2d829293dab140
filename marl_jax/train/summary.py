"""Run summary from metric records: a Markdown table and matplotlib plots (Agg canvas, no pyplot state).

Records follow :mod:`marl_jax.train.metrics`: flat dicts with ``"step"``; train keys ``success``,
``reward_mean``, ``<role>/accuracy``, ``grad/<role>/norm``, ``grad/<role>/share``,
``grad/<role>/copy_alignment``, ``grad/cos/<a>~<b>``, ``logp_gap/<role>/mean_abs`` and ``logp_gap/<role>/k3``
(the sampler's log-probs against the trainer's); validation keys ``val/success`` and
``val/<role>/accuracy`` (step 0 = base model). Records of the same step are merged, a later value of a
key replacing an earlier one (so a resumed run that was not truncated still counts each step once).
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from marl_jax.train.cliff import detect_cliff, trailing_mean
from marl_jax.train.metrics import read_metrics

__all__ = ["summary_table", "write_plots", "write_summary", "curve", "merge_by_step", "infer_roles",
           "PLOT_FILES", "TRAIN_WINDOW"]

PLOT_FILES = ("training.png", "validation.png", "grad_norms.png", "grad_shares.png")
TRAIN_WINDOW = 10  # steps in the first/last train means and in the smoothed training curves
_TOTAL_COLORS = {"success": "black", "reward_mean": "tab:gray", "val/success": "black"}


def _role_color(i: int) -> str:
    return f"C{i % 10}"  # role i has the same color in every plot


def merge_by_step(records: Iterable[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """``{step: merged record}``; later records win on a shared key."""
    merged: dict[int, dict[str, Any]] = {}
    for r in records:
        if "step" not in r:
            raise ValueError(f"metric record without 'step': {sorted(r)[:8]}")
        merged.setdefault(int(r["step"]), {}).update(r)
    return dict(sorted(merged.items()))


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool) and math.isfinite(x)


def curve(merged: Mapping[int, Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values of one key, where it is a finite number, ascending by step."""
    pts = [(s, float(r[key])) for s, r in merged.items() if key in r and _finite(r[key])]
    if not pts:
        return np.zeros(0, np.int64), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s, np.int64), np.asarray(v, np.float64)


def infer_roles(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Roles named by ``val/<role>/accuracy`` or ``<role>/accuracy`` keys, in first-seen order."""
    roles: list[str] = []
    for r in records:
        for k in r:
            parts = k.split("/")
            role = None
            if len(parts) == 3 and parts[0] == "val" and parts[2] == "accuracy":
                role = parts[1]
            elif len(parts) == 2 and parts[1] == "accuracy" and parts[0] not in ("val", "grad"):
                role = parts[0]
            if role and role not in roles:
                roles.append(role)
    return roles


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    if 0 < abs(x) < 5e-4:  # small but not zero (a log-prob gap): significant digits, not 0.000
        return f"{x:+.2e}" if signed else f"{x:.2e}"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def _val_rows(merged, roles) -> list[tuple[str, str]]:
    return [("val/success", "val/success")] + [(f"val/{r}/accuracy", f"val/{r}/accuracy") for r in roles]


def summary_table(records: Sequence[Mapping[str, Any]], roles: Sequence[str] | None = None,
                  **cliff_kwargs: Any) -> str:
    """Markdown tables: validation (base, peak and its step, final, final - base, cliff) per metric,
    then train means over the first and last ``TRAIN_WINDOW`` train steps (half the steps when fewer
    than ``2 * TRAIN_WINDOW`` were trained).

    ``base`` is the step-0 validation value ("-" if step 0 was not evaluated); ``peak`` is the maximum
    (earliest step on ties); ``final`` is the value at the last validated step. ``cliff_kwargs`` go to
    :func:`marl_jax.train.cliff.detect_cliff`.
    """
    merged = merge_by_step(records)
    roles = list(roles) if roles is not None else infer_roles(records)
    lines = ["| validation metric | base (step 0) | peak | peak step | final | final - base | cliff |",
             "|---|---|---|---|---|---|---|"]
    for name, key in _val_rows(merged, roles):
        s, v = curve(merged, key)
        if len(v) == 0:
            lines.append(f"| {name} | - | - | - | - | - | - |")
            continue
        base = float(v[0]) if s[0] == 0 else None
        pi = int(np.argmax(v))
        final = float(v[-1])
        rep = detect_cliff(s, v, **cliff_kwargs)
        cliff = f"at step {rep.step} (from {_fmt(rep.peak_value)} at {rep.peak_step})" if rep.detected else "no"
        lines.append(f"| {name} | {_fmt(base)} | {_fmt(float(v[pi]))} | {int(s[pi])} | {_fmt(final)} | "
                     f"{_fmt(None if base is None else final - base, signed=True)} | {cliff} |")
    train_keys = [("success", "success"), ("reward_mean", "reward_mean")] + [
        (f"{r}/accuracy", f"{r}/accuracy") for r in roles] + [
        (f"logp_gap/{r}/{k}", f"logp_gap/{r}/{k}") for r in roles for k in ("mean_abs", "k3")]
    # Short runs: halves, so that the first and last windows never overlap.
    w = min(TRAIN_WINDOW, max(1, len(curve(merged, "success")[1]) // 2))
    lines += ["", f"| train metric | first {w} steps mean | last {w} steps mean | steps |",
              "|---|---|---|---|"]
    for name, key in train_keys:
        s, v = curve(merged, key)
        if len(v) == 0:
            continue
        first, last = v[:w].mean(), v[-w:].mean()
        lines.append(f"| {name} | {_fmt(float(first))} | {_fmt(float(last))} | {int(s[0])}-{int(s[-1])} |")
    return "\n".join(lines + compile_lines(merged)) + "\n"


def compile_lines(merged) -> list[str]:
    """XLA's compile seconds (marl_jax.train.compiles): the first train step, the later ones (0 when a run's
    shapes are all compiled by its first step), the update's part of each, and validation's."""
    s, v = curve(merged, "compile_s")
    if not len(v):
        return []
    _, u = curve(merged, "update_compile_s")
    _, val = curve(merged, "val/compile_s")
    _, hits = curve(merged, "compile_cache_hits")
    first = int(s[0])
    later = f"{v[1:].sum():.1f} ({int(np.count_nonzero(v[1:]))} of {len(v) - 1} steps compiled)" if len(v) > 1 else "-"
    return ["", "| XLA compiling, s | first step (" + str(first) + ") | later steps | validation | "
            "programs from the persistent cache |", "|---|---|---|---|---|",
            f"| all | {v[0]:.1f} | {later} | {val.sum():.1f} | {int(hits.sum())} |",
            f"| update | {u[0]:.1f} | {u[1:].sum():.1f} | - | - |" if len(u) == len(v) else "| update | - | - | - | - |"]


# -- plots ---------------------------------------------------------------------------------------

def _new_figure(ncols: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(6.4 * ncols, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, axes


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def _save(fig: Figure, path: str) -> str:
    fig.savefig(path)
    return path


def _plot_training(merged, roles, path) -> str:
    fig, (ax, ax2) = _new_figure(2)
    any_data = False
    for key in ["success", "reward_mean"]:
        s, v = curve(merged, key)
        if len(v):
            any_data = True
            color = _TOTAL_COLORS[key]
            ax.plot(s, v, color=color, alpha=0.3, lw=0.8, label=f"{key} (per step)")
            ax.plot(s, trailing_mean(v, TRAIN_WINDOW), color=color, lw=2,
                    label=f"{key} (mean of last {TRAIN_WINDOW})")
    if not any_data:
        _no_data(ax, "train success or reward")
    ax.set(title="Training reward and success", xlabel="step", ylabel="value")
    if any_data:
        ax.legend(fontsize=8)
    role_data = False
    for i, r in enumerate(roles):
        s, v = curve(merged, f"{r}/accuracy")
        if len(v):
            role_data = True
            ax2.plot(s, trailing_mean(v, TRAIN_WINDOW), color=_role_color(i), lw=1.6, label=r)
    if role_data:
        ax2.legend(fontsize=8)
    else:
        _no_data(ax2, "per-role train accuracy")
    ax2.set(title=f"Per-role train accuracy (mean of last {TRAIN_WINDOW})", xlabel="step", ylabel="accuracy")
    return _save(fig, path)


def _plot_validation(merged, roles, path, cliff_kwargs) -> str:
    fig, (ax,) = _new_figure(1)
    any_data = False
    for i, (name, key) in enumerate(_val_rows(merged, roles)):
        s, v = curve(merged, key)
        if not len(v):
            continue
        any_data = True
        color = _TOTAL_COLORS[key] if i == 0 else _role_color(i - 1)
        ax.plot(s, v, "o-", color=color, lw=1.6, ms=3, label=name)
        if s[0] == 0:
            ax.axhline(v[0], color=color, ls=":", lw=1.2)
        rep = detect_cliff(s, v, **cliff_kwargs)
        if rep.detected:
            ax.axvline(rep.step, color=color, ls="--", lw=1)
            y = float(v[list(s).index(rep.step)])
            ax.plot([rep.step], [y], "X", color="red", ms=10, zorder=5)
            ax.annotate(f"cliff ({name})", (rep.step, y), textcoords="offset points", xytext=(5, 8),
                        fontsize=8, color="red")
    if any_data:
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "validation")
    ax.set(title="Validation accuracy (dotted: base model; X: terminal cliff)", xlabel="step",
           ylabel="accuracy (pass@1)")
    return _save(fig, path)


def _plot_grad_norms(merged, roles, path) -> str:
    fig, (ax,) = _new_figure(1)
    any_data = False
    for i, r in enumerate(roles):
        s, v = curve(merged, f"grad/{r}/norm")
        keep = v > 0  # log axis
        if keep.any():
            any_data = True
            ax.plot(s[keep], v[keep], color=_role_color(i), alpha=0.3, lw=0.8)
            ax.plot(s[keep], trailing_mean(v[keep], TRAIN_WINDOW), color=_role_color(i), lw=1.8, label=r)
    if any_data:
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "per-role gradient norm")
    ax.set(title=f"Per-role gradient norm (thin: per step; thick: mean of last {TRAIN_WINDOW})", xlabel="step",
           ylabel="gradient norm")
    return _save(fig, path)


def _cos_keys(merged) -> list[str]:
    keys: list[str] = []
    for r in merged.values():
        keys += [k for k in r if k.startswith("grad/cos/") and k not in keys]
    return keys


def _plot_grad_shares(merged, roles, path) -> str:
    cos_keys = _cos_keys(merged)
    fig, axes = _new_figure(2 if cos_keys else 1)
    ax = axes[0]
    any_data = False
    for i, r in enumerate(roles):
        s, v = curve(merged, f"grad/{r}/share")
        if len(v):
            any_data = True
            ax.plot(s, trailing_mean(v, TRAIN_WINDOW), color=_role_color(i), lw=1.8, label=f"{r} share")
        s, v = curve(merged, f"grad/{r}/norm_share")
        if len(v):
            any_data = True
            ax.plot(s, trailing_mean(v, TRAIN_WINDOW), color=_role_color(i), lw=1.0, ls="--",
                    label=f"{r} norm share")
    if any_data:
        ax.axhline(0, color="black", lw=0.6)
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "gradient share")
    ax.set(title=f"Per-role share of the slot gradient (mean of last {TRAIN_WINDOW})", xlabel="step", ylabel="share")
    if cos_keys:
        ax2 = axes[1]
        for i, k in enumerate(cos_keys):
            s, v = curve(merged, k)
            ax2.plot(s, trailing_mean(v, TRAIN_WINDOW), color=f"C{i}", lw=1.6, label=k[len("grad/cos/"):])
        ax2.axhline(0, color="black", lw=0.6)
        ax2.set(title=f"Cosine between role gradients (mean of last {TRAIN_WINDOW})", xlabel="step", ylabel="cosine",
                ylim=(-1.05, 1.05))
        ax2.legend(fontsize=8)
    return _save(fig, path)


def _plot_copy_alignment(merged, roles, path) -> str | None:
    series = [(i, r, *curve(merged, f"grad/{r}/copy_alignment")) for i, r in enumerate(roles)]
    series = [x for x in series if len(x[3])]
    if not series:
        return None
    fig, (ax,) = _new_figure(1)
    for i, r, s, v in series:
        ax.plot(s, v, color=_role_color(i), alpha=0.3, lw=0.8)
        ax.plot(s, trailing_mean(v, TRAIN_WINDOW), color=_role_color(i), lw=1.8, label=r)
    ax.axhline(0, color="black", lw=0.6)
    ax.set(title="Alignment of parallel same-role copies' gradients", xlabel="step", ylabel="alignment")
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_plots(records: Sequence[Mapping[str, Any]], out_dir: str | os.PathLike,
                roles: Sequence[str] | None = None, **cliff_kwargs: Any) -> list[str]:
    """Writes training.png, validation.png, grad_norms.png, grad_shares.png (always; a panel without
    data says so) and copy_alignment.png (only when logged) into ``out_dir``; returns their paths."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    merged = merge_by_step(records)
    roles = list(roles) if roles is not None else infer_roles(records)
    paths = [
        _plot_training(merged, roles, os.path.join(out_dir, PLOT_FILES[0])),
        _plot_validation(merged, roles, os.path.join(out_dir, PLOT_FILES[1]), cliff_kwargs),
        _plot_grad_norms(merged, roles, os.path.join(out_dir, PLOT_FILES[2])),
        _plot_grad_shares(merged, roles, os.path.join(out_dir, PLOT_FILES[3])),
    ]
    extra = _plot_copy_alignment(merged, roles, os.path.join(out_dir, "copy_alignment.png"))
    return paths + ([extra] if extra else [])


def write_summary(workdir: str | os.PathLike, roles: Sequence[str] | None = None, **cliff_kwargs: Any) -> str:
    """Reads ``<workdir>/metrics.jsonl``, writes the plots and ``summary.md`` (table + image links) into
    ``workdir``, and returns the table."""
    workdir = os.fspath(workdir)
    records = read_metrics(workdir)
    table = summary_table(records, roles, **cliff_kwargs)
    paths = write_plots(records, workdir, roles, **cliff_kwargs)
    body = ["# Run summary", "", table]
    for p in paths:
        name = os.path.basename(p)
        body.append(f"![{os.path.splitext(name)[0]}]({name})")
        body.append("")
    with open(os.path.join(workdir, "summary.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(body))
    return table
