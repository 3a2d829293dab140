"""Metrics JSONL + TensorBoard writer, resume truncation, summary table and plots."""
from __future__ import annotations

import glob
import json
import math
import os
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.train.metrics import MetricsWriter, read_metrics, truncate_after
from marl_jax.train.summary import PLOT_FILES, summary_table, write_plots, write_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = ["generator", "aggregator"]


# -- TensorBoard event files, read with tensorboardX's protobufs and CRC ------------------------------

def _masked_crc(data: bytes) -> int:
    from tensorboardX.crc32c import crc32c
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_events(logdir: str) -> list[tuple[str, int, float]]:
    """(tag, step, scalar) of every summary value in the event files."""
    return [(v.tag, ev.step, v.simple_value) for ev in _read_raw_events(logdir) for v in ev.summary.value]


def _read_raw_events(logdir: str) -> list:
    """Every Event of the TFRecord-framed event files, CRCs checked."""
    from tensorboardX.proto import event_pb2
    out = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        i = 0
        while i < len(data):
            header = data[i:i + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[i + 8:i + 12])[0] == _masked_crc(header)
            body = data[i + 12:i + 12 + n]
            assert struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] == _masked_crc(body)
            i += 16 + n
            ev = event_pb2.Event()
            ev.ParseFromString(body)
            out.append(ev)
    return out


def _strict_json(line: str) -> dict:
    def bad(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(line, parse_constant=bad)


def test_jsonl_and_tensorboard(tmp_path):
    recs = [
        {"step": 0, "val/success": 0.25, "val/generator/accuracy": np.float32(0.5)},
        {"step": 1, "success": 0.5, "reward_mean": jnp.asarray(0.375), "loss": float("nan"),
         "grad/generator/norm": np.float64(float("inf")), "skipped_updates": np.int32(2), "note": "warmup",
         "solve_all": np.bool_(False), "tokens_per_s": -math.inf, "extra": None},
    ]
    with MetricsWriter(tmp_path) as w:
        for r in recs:
            w.write(r)
        # flushed per line: readable before close
        assert len(read_metrics(tmp_path)) == 2
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    parsed = [_strict_json(line) for line in lines]  # strict JSON, no bare NaN
    assert parsed[1]["loss"] == "NaN" and parsed[1]["grad/generator/norm"] == "Infinity"
    assert parsed[1]["tokens_per_s"] == "-Infinity"
    got = read_metrics(tmp_path)
    assert got[0] == {"step": 0, "val/success": 0.25, "val/generator/accuracy": 0.5}
    r1 = got[1]
    assert math.isnan(r1["loss"]) and r1["grad/generator/norm"] == math.inf and r1["tokens_per_s"] == -math.inf
    assert r1["reward_mean"] == 0.375 and r1["skipped_updates"] == 2 and type(r1["skipped_updates"]) is int
    assert r1["solve_all"] is False and r1["note"] == "warmup" and r1["extra"] is None

    events = _read_events(str(tmp_path / "tb"))
    by_tag = {(t, s): v for t, s, v in events}
    assert by_tag[("val/success", 0)] == pytest.approx(0.25)
    assert by_tag[("val/generator/accuracy", 0)] == pytest.approx(0.5)
    assert by_tag[("success", 1)] == pytest.approx(0.5) and by_tag[("reward_mean", 1)] == pytest.approx(0.375)
    assert by_tag[("skipped_updates", 1)] == 2 and by_tag[("solve_all", 1)] == 0
    assert math.isnan(by_tag[("loss", 1)]) and by_tag[("grad/generator/norm", 1)] == math.inf
    assert ("note", 1) not in by_tag and ("extra", 1) not in by_tag and ("step", 1) not in by_tag


def test_tensorboard_off(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write({"step": 3, "success": 1.0})
    assert not (tmp_path / "tb").exists()
    assert read_metrics(tmp_path) == [{"step": 3, "success": 1.0}]


def test_writer_does_not_load_torch(tmp_path):
    code = ("import sys\n"
            "from marl_jax.train.metrics import MetricsWriter\n"
            f"w = MetricsWriter({str(tmp_path)!r}); w.write({{'step': 0, 'a': 1.0}}); w.close()\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert 'tensorboardX' in sys.modules\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))


def _run_records(step: int) -> list[dict]:
    """What one step of a deterministic fake run logs (val every 5 steps, base at 0)."""
    out = []
    if step > 0:
        out.append({"step": step, "success": (step % 7) / 7, "loss": 1.0 / step, "generator/accuracy": step / 100})
    if step % 5 == 0:
        out.append({"step": step, "val/success": 0.1 + step / 100})
    return out


def test_truncate_after_and_resume_equals_uninterrupted(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    with MetricsWriter(full, tensorboard=False) as w:
        for s in range(21):
            w.write_many(_run_records(s))
    # interrupted after step 14; last checkpoint at step 10
    with MetricsWriter(resumed, tensorboard=False) as w:
        for s in range(15):
            w.write_many(_run_records(s))
    with MetricsWriter(resumed, resume_step=10) as w:
        for s in range(11, 21):
            w.write_many(_run_records(s))
    assert (resumed / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()
    steps = [r["step"] for r in read_metrics(resumed)]
    assert len(steps) == len(set((r["step"], "val/success" in r) for r in read_metrics(resumed)))
    # truncate_after directly: counts what went, keeps steps <= 12 (val at 0, 5, 10)
    dropped = truncate_after(full, 12)
    kept = read_metrics(full)
    assert max(r["step"] for r in kept) == 12
    assert dropped == sum(len(_run_records(s)) for s in range(13, 21))
    assert kept == [r for s in range(13) for r in _run_records(s)]
    assert truncate_after(tmp_path / "nothing", 3) == 0
    # a resumed TensorBoard writer tells TensorBoard to hide old events from step 11 on (SessionLog START)
    from tensorboardX.proto import event_pb2
    starts = [ev.step for ev in _read_raw_events(str(resumed / "tb"))
              if ev.HasField("session_log") and ev.session_log.status == event_pb2.SessionLog.START]
    assert starts == [11]


def test_torn_last_line(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write({"step": 1, "success": 0.5})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "succ')  # killed mid-write
    assert read_metrics(tmp_path) == [{"step": 1, "success": 0.5}]
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write({"step": 2, "success": 1.0})
    assert read_metrics(tmp_path) == [{"step": 1, "success": 0.5}, {"step": 2, "success": 1.0}]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("garbage\n")
        f.write('{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:3"):
        read_metrics(tmp_path)


def test_writer_errors(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(ValueError, match="step"):
            w.write({"success": 1.0})
        with pytest.raises(TypeError, match="flat"):
            w.write({"step": 1, "grad": {"generator": 1.0}})
        with pytest.raises(ValueError, match="shape"):
            w.write({"step": 1, "x": np.ones(3)})
        with pytest.raises(ValueError, match="step"):
            w.write({"step": -1})
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(tmp_path / "nope")


# -- summary ----------------------------------------------------------------------------------------

def _synthetic_run() -> list[dict]:
    rng = np.random.default_rng(0)
    recs = []
    val = {0: (0.20, 0.30, 0.25), 10: (0.35, 0.50, 0.30), 20: (0.55, 0.60, 0.45), 30: (0.30, 0.62, 0.20),
           40: (0.28, 0.58, 0.22)}
    for step in range(0, 41):
        if step > 0:
            recs.append({
                "step": step, "success": float(rng.uniform()), "reward_mean": float(rng.uniform()),
                "loss": float(rng.normal()), "generator/accuracy": float(rng.uniform()),
                "aggregator/accuracy": float(rng.uniform()),
                "grad/generator/norm": float(rng.uniform(0.1, 1.0)), "grad/aggregator/norm": float(rng.uniform(1, 8)),
                "grad/generator/share": 0.3, "grad/aggregator/share": 0.7,
                "grad/generator/norm_share": 0.2, "grad/aggregator/norm_share": 0.8,
                "grad/generator/copy_alignment": float(rng.uniform(0.5, 1.0)),
                "grad/cos/generator~aggregator": float(rng.uniform(-0.2, 0.6)),
            })
        if step in val:
            s, g, a = val[step]
            recs.append({"step": step, "val/success": s, "val/generator/accuracy": g, "val/aggregator/accuracy": a})
    return recs


def _table_rows(md: str) -> dict[str, list[str]]:
    rows = {}
    for line in md.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_summary_table_numbers(tmp_path):
    recs = _synthetic_run()
    rows = _table_rows(summary_table(recs, ROLES))
    # validation: base, peak, peak step, final, final - base, cliff
    # success: 0.20 -> peak 0.55 at 20 -> 0.30 at 30 (0.25 below: cliff), stays <= 0.475 -> final 0.28
    assert rows["val/success"][:5] == ["0.200", "0.550", "20", "0.280", "+0.080"]
    assert rows["val/success"][5].startswith("at step 30")
    # generator: peak 0.62 at 30, final 0.58, no fall
    assert rows["val/generator/accuracy"] == ["0.300", "0.620", "30", "0.580", "+0.280", "no"]
    # aggregator: 0.45 at 20 -> 0.20 at 30 (drop 0.25) -> 0.22: cliff at 30
    assert rows["val/aggregator/accuracy"][:5] == ["0.250", "0.450", "20", "0.220", "-0.030"]
    assert rows["val/aggregator/accuracy"][5].startswith("at step 30")
    # train means over steps 1-10 and 31-40, computed here from the records
    train = {r["step"]: r for r in recs if "success" in r}
    for name, key in [("success", "success"), ("reward_mean", "reward_mean"),
                      ("generator/accuracy", "generator/accuracy")]:
        first = sum(train[s][key] for s in range(1, 11)) / 10
        last = sum(train[s][key] for s in range(31, 41)) / 10
        assert rows[name] == [f"{first:.3f}", f"{last:.3f}", "1-40"], name
    # a stricter threshold finds no cliff in the aggregator curve
    assert _table_rows(summary_table(recs, ROLES, drop=0.3))["val/aggregator/accuracy"][5] == "no"


def test_summary_later_record_wins_and_missing_base():
    recs = [{"step": 10, "val/success": 0.4}, {"step": 20, "val/success": 0.1},
            {"step": 20, "val/success": 0.5},  # rewritten by a resumed run
            {"step": 1, "success": 1.0}, {"step": 2, "success": 0.0}]
    rows = _table_rows(summary_table(recs, []))
    assert rows["val/success"][:5] == ["-", "0.500", "20", "0.500", "-"]
    assert rows["val/success"][5] == "no"
    assert rows["success"] == ["1.000", "0.000", "1-2"]  # fewer than 20 train steps: first and last halves


PNG_SIG = b"\x89PNG\r\n\x1a\n"


def _check_png(path: str) -> tuple[int, int]:
    data = open(path, "rb").read()
    assert data[:8] == PNG_SIG, path
    assert len(data) > 10_000, (path, len(data))
    # IHDR: width and height, big-endian, right after the signature and chunk header
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_and_summary_file(tmp_path):
    recs = _synthetic_run()
    paths = write_plots(recs, tmp_path / "plots", ROLES)
    names = [os.path.basename(p) for p in paths]
    assert names == list(PLOT_FILES) + ["copy_alignment.png"]
    for p in paths:
        w, h = _check_png(p)
        assert w >= 500 and h >= 300
    import matplotlib.image
    img = matplotlib.image.imread(paths[1])
    assert img.ndim == 3 and img.shape[2] in (3, 4) and img[..., :3].std() > 0.01  # not a blank image

    with MetricsWriter(tmp_path / "run", tensorboard=False) as mw:
        mw.write_many(recs)
    table = write_summary(tmp_path / "run", ROLES)
    md = (tmp_path / "run" / "summary.md").read_text()
    assert table in md and table == summary_table(recs, ROLES)
    for name in PLOT_FILES:
        assert f"]({name})" in md
        _check_png(str(tmp_path / "run" / name))


def test_plots_without_gradient_keys(tmp_path):
    recs = [{"step": 0, "val/success": 0.2}, {"step": 1, "success": 0.5}, {"step": 2, "success": 0.7},
            {"step": 2, "val/success": 0.3}]
    paths = write_plots(recs, tmp_path, ["generator"])
    assert [os.path.basename(p) for p in paths] == list(PLOT_FILES)
    for p in paths:
        _check_png(p)
