"""Task batching on grain: deterministic shuffled epochs with a checkpointable iterator state.

A pipeline is ``MapDataset.source(tasks) -> shuffle(seed) -> repeat -> batch(list)``. grain reseeds
the shuffle each epoch, so every epoch is a fresh permutation of all tasks, and the iterator's whole
position is one integer, which makes its state a tiny JSON-serialisable dict.

Everything runs in the calling process (no grain worker processes): the tasks are in-memory
records with no per-element work to parallelise. (Should workers ever be added: grain workers need
absl flags marked parsed and a ``__main__`` guard in the launching script.)
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Any, Iterator, Mapping, Sequence

import grain
import numpy as np
from etils import epath

from marl_jax.tasks.base import Task

__all__ = ["TaskBatchIterator", "task_batches", "split_tasks", "TaskFileError", "MissingKeyError", "read_jsonl",
           "decode_utf8"]


class TaskFileError(ValueError):
    """A task file that cannot be read as given; the message names the file, the line and the fix."""


class MissingKeyError(TaskFileError, KeyError):
    """A row without a key the loader was told to read (a KeyError too, for callers that catch that)."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


def decode_utf8(raw: bytes, path: str | os.PathLike, lineno: int) -> str:
    """One line of a task file as text, or an error naming the line, the bad byte and the fix."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskFileError(
            f"{os.fspath(path)}: line {lineno} is not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
            f"re-save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 {os.path.basename(path)} > fixed.jsonl"
        ) from None


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line of a JSONL file.

    Read as bytes and decoded line by line, so a stray non-UTF-8 byte is reported with its line rather
    than as a decoder error from somewhere in the file.
    """
    with epath.Path(path).open("rb") as f:  # a local path or a URI (gs://...)
        for lineno, raw in enumerate(f, 1):
            line = decode_utf8(raw, path, lineno)
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(
                    f"{os.fspath(path)}: line {lineno} is not valid JSON ({e.msg} at column {e.colno}); fix or "
                    "delete that line (the file needs one JSON object per line)") from None

_REPEAT_TASKS = 2**44  # tasks drawn before a repeating stream ends (~1.8e13, i.e. never)


class TaskBatchIterator(Iterator[list[Task]]):
    """Iterator over lists of tasks with get_state() / set_state() for checkpoints.

    The state is ``{"next_index": i, "num_tasks": n, "tasks_crc32": c, "batch_size": b, "seed": s,
    "shuffle": 0|1, "repeat": 0|1, "drop_remainder": 0|1}``: plain ints, so it survives a JSON round
    trip. next_index counts batches. Restoring checks that the state came from an identically
    configured pipeline over the same task ids, since the position alone would otherwise silently
    mean different batches.
    """

    def __init__(self, dataset: grain.MapDataset, config: Mapping[str, int]):
        self._dataset = dataset
        self._config = dict(config)
        self._it = self._new_iterator()

    def _new_iterator(self):
        # num_threads=0: elements are already in memory, threads would only contend for the GIL.
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        return iter(self._dataset.to_iter_dataset(read_options=options))

    def __iter__(self) -> "TaskBatchIterator":
        return self

    def __next__(self) -> list[Task]:
        return next(self._it)

    def get_state(self) -> dict[str, int]:
        """The position in the stream plus the pipeline settings it is valid for."""
        inner = self._it.get_state()
        return {"next_index": int(inner["next_index"]), **self._config}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a state returned by get_state() (possibly after a JSON round trip)."""
        if "next_index" not in state:
            raise ValueError(f"not a task iterator state (no 'next_index'): {dict(state)}")
        mismatched = {k: (state.get(k), v) for k, v in self._config.items() if state.get(k) != v}
        if mismatched:
            raise ValueError(
                "iterator state was saved from a differently configured pipeline "
                f"(key: (saved, current)) {mismatched}; rebuild task_batches with the saved settings"
            )
        # A fresh grain iterator avoids any element it may have buffered ahead of the old position.
        self._it = self._new_iterator()
        self._it.set_state({"next_index": int(state["next_index"])})


def task_batches(
    tasks: Sequence[Task],
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    repeat: bool = True,
    drop_remainder: bool = False,
) -> TaskBatchIterator:
    """An iterator of batches (lists of batch_size tasks).

    shuffle: each epoch is a permutation of all tasks, different per epoch, fixed by seed.
    repeat: run (practically) forever; batches then run straight across epoch boundaries, so the k-th
    len(tasks) tasks of the flattened stream are exactly epoch k. Without repeat, one pass, and the
    last batch is short unless drop_remainder.
    """
    if not tasks:
        raise ValueError("task_batches needs at least one task")
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")
    seed = int(seed)
    ds = grain.MapDataset.source(list(tasks))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if repeat:
        # A finite but practically endless repeat: grain's batch computes its length in floating
        # point, which overflows for repeat(None) (length sys.maxsize) with batch_size=1.
        ds = ds.repeat(max(1, _REPEAT_TASKS // len(tasks)))
    ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
    config = {
        "num_tasks": len(tasks),
        "tasks_crc32": zlib.crc32("\n".join(t.task_id for t in tasks).encode("utf-8")),
        "batch_size": batch_size,
        "seed": seed,
        "shuffle": int(bool(shuffle)),
        "repeat": int(bool(repeat)),
        "drop_remainder": int(bool(drop_remainder)),
    }
    return TaskBatchIterator(ds, config)


def split_tasks(tasks: Sequence[Task], val_fraction: float, seed: int) -> tuple[list[Task], list[Task]]:
    """Deterministic train/validation split; each part keeps the input order.

    The validation set has round(len(tasks) * val_fraction) tasks chosen by a seeded permutation
    (the reference uses a 90/10 split with seed 42).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    n = len(tasks)
    n_val = int(round(n * val_fraction))
    if n_val >= n and n > 0:
        raise ValueError(f"val_fraction={val_fraction} leaves no training tasks out of {n}")
    val_idx = set(np.random.default_rng(seed).permutation(n)[:n_val].tolist())
    train = [t for i, t in enumerate(tasks) if i not in val_idx]
    val = [t for i, t in enumerate(tasks) if i in val_idx]
    return train, val
