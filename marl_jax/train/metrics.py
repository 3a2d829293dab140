"""Metric records: one JSON line per record in ``<workdir>/metrics.jsonl``, mirrored to TensorBoard.

A record is a flat dict with an int ``"step"`` and scalar values (numbers, bools, strings, None).
Train records (every step) and validation records (keys ``"val/..."``; step 0 is the base model)
share the file. Non-finite floats are written as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` so every line is strict JSON; :func:`read_metrics` turns them back into floats.

Resume: a run restored from a checkpoint at step ``s`` calls ``truncate_after(workdir, s)`` (or opens
``MetricsWriter(workdir, resume_step=s)``, which does that and tells TensorBoard to hide its old
events after ``s``), then rewrites steps ``s+1, ...``, so the final file equals an uninterrupted
run's. A checkpoint at step ``s`` must therefore be saved after all records of step ``s``.

Only one process should write (process 0 in a multi-host run).
"""
from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
from typing import Any, Iterable, Mapping

import numpy as np

__all__ = ["MetricsWriter", "read_metrics", "truncate_after", "metrics_path", "to_json_value", "NONFINITE"]

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
# How non-finite floats appear in the file (JavaScript / Python json spelling, quoted).
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def metrics_path(workdir: str | os.PathLike) -> str:
    return os.path.join(os.fspath(workdir), METRICS_FILE)


def to_json_value(key: str, v: Any) -> Any:
    """One record value as a strict-JSON scalar (numpy/jax scalars unwrapped, non-finite as strings)."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, np.bool_):
        return bool(v)
    if hasattr(v, "shape") and hasattr(v, "dtype"):  # numpy / jax arrays and scalars
        if int(np.prod(v.shape)) != 1:
            raise ValueError(f"metric {key!r} has shape {tuple(v.shape)}; records take scalars "
                             "(reduce it, or log one key per element)")
        v = np.asarray(v).reshape(()).item()
        if isinstance(v, bool):
            return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        v = float(v)
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "Infinity" if v > 0 else "-Infinity"
        return v
    raise TypeError(f"metric {key!r} has type {type(v).__name__}; records take numbers, bools, strings or None "
                    "(records are flat: use keys like 'grad/generator/norm' instead of nesting)")


def _from_json_value(v: Any) -> Any:
    return NONFINITE[v] if isinstance(v, str) and v in NONFINITE else v


def _encode(record: Mapping[str, Any]) -> dict:
    if not isinstance(record, Mapping):
        raise TypeError(f"a metric record is a dict, got {type(record).__name__}")
    if "step" not in record:
        raise ValueError(f"metric record has no 'step' key: {sorted(record)[:8]}")
    out = {}
    for k, v in record.items():
        if not isinstance(k, str):
            raise TypeError(f"metric keys are strings, got {k!r}")
        out[k] = to_json_value(k, v)
    step = out["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"record step must be an int >= 0, got {record['step']!r}")
    return out


def _load_line(line: str, lineno: int, path: str) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not a JSON line ({e})") from e
    if not isinstance(rec, dict) or "step" not in rec:
        raise ValueError(f"{path}:{lineno}: a metric record must be a JSON object with a 'step'")
    return {k: _from_json_value(v) for k, v in rec.items()}


def _complete_lines(path: str) -> tuple[list[str], int]:
    """The newline-terminated lines of the file and the byte length they span (a torn tail is left out)."""
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    return data[:end].decode("utf-8").splitlines(), end


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """All records of ``<workdir>/metrics.jsonl`` in file order, non-finite floats restored.

    A last line without its newline (a write cut off by a kill) is ignored; any other malformed
    line is an error naming the line.
    """
    path = metrics_path(workdir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics file at {path!r}; is {os.fspath(workdir)!r} a run directory?")
    lines, _ = _complete_lines(path)
    return [_load_line(line, i + 1, path) for i, line in enumerate(lines) if line.strip()]


def truncate_after(workdir: str | os.PathLike, step: int) -> int:
    """Drops every record with ``record["step"] > step`` (and a torn last line); returns how many went.

    The file is rewritten atomically (temporary file + rename). A missing file is a no-op.
    """
    path = metrics_path(workdir)
    if not os.path.isfile(path):
        return 0
    lines, _ = _complete_lines(path)
    keep, dropped = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if _load_line(line, i + 1, path)["step"] > step:
            dropped += 1
        else:
            keep.append(line)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return dropped


class _NoNanWarning(logging.Filter):
    # tensorboardX warns on every non-finite scalar; the record itself already says NaN.
    def filter(self, record: logging.LogRecord) -> bool:
        return "NaN or Inf found" not in record.getMessage()


def _summary_writer_cls():
    """tensorboardX's SummaryWriter, imported without letting it pull in torch.

    tensorboardX tries ``import torch`` at import time only to widen a type hint; this library must
    not load torch, so while importing it (if torch is not already loaded) ``torch`` is made
    unimportable for that one import.
    """
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` raise ImportError
        try:
            import tensorboardX  # noqa: F401
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter

    logging.getLogger("tensorboardX.x2num").addFilter(_NoNanWarning())
    return SummaryWriter


class MetricsWriter:
    """Appends records to ``<workdir>/metrics.jsonl`` (flushed per line) and, optionally, TensorBoard.

    Args:
      workdir: run directory (created if missing).
      tensorboard: also write every numeric value as a scalar under ``<workdir>/tb``, tag = key.
      resume_step: when resuming from a checkpoint at this step, drop records after it first and
        have TensorBoard hide older events after it.
    """

    def __init__(self, workdir: str | os.PathLike, tensorboard: bool = True, resume_step: int | None = None):
        self.workdir = os.fspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.path = metrics_path(self.workdir)
        if resume_step is not None:
            truncate_after(self.workdir, int(resume_step))
        elif os.path.isfile(self.path):
            # cut a torn last line so the next record starts on a line of its own
            _, end = _complete_lines(self.path)
            if end != os.path.getsize(self.path):
                with open(self.path, "r+b") as f:
                    f.truncate(end)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            writer_cls = _summary_writer_cls()
            purge = None if resume_step is None else int(resume_step) + 1
            self._tb = writer_cls(logdir=os.path.join(self.workdir, TB_DIR), purge_step=purge, flush_secs=10)

    def write(self, record: Mapping[str, Any]) -> None:
        """Appends one record (a flat dict with an int "step")."""
        if self._file is None:
            raise RuntimeError("MetricsWriter is closed")
        rec = _encode(record)
        self._file.write(json.dumps(rec, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = rec["step"]
            for k, v in record.items():
                if k == "step":
                    continue
                ev = _from_json_value(rec[k])
                if isinstance(ev, (int, float)):  # bools count as 0/1; strings and None are skipped
                    self._tb.add_scalar(k, float(ev), global_step=step)
            self._tb.flush()

    def write_many(self, records: Iterable[Mapping[str, Any]]) -> None:
        for r in records:
            self.write(r)

    def flush(self) -> None:
        """Everything written so far on disk (before a gs:// workdir's mirror is copied up)."""
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
