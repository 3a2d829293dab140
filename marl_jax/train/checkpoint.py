"""Checkpoints on orbax: the training state (arrays) plus a small JSON side record, keep-last-N plus best.

Layout: ``<workdir>/checkpoints/<step>/{state, meta, metrics}``. ``state`` is a pytree of arrays saved
with ``StandardSave`` (trainable parameters, optimizer state, PRNG key data); ``meta`` is a JSON dict
(data-iterator state, config, validation numbers); ``metrics`` holds ``{"best_metric": x}`` when the
caller gave one, and is what orbax ranks checkpoints by.

Retention: the newest ``keep`` checkpoints, plus (with ``keep_best``) the one with the highest
``best_metric`` ever saved, however old. Ties go to the later step, as orbax sorts them.

Atomicity: orbax writes each step into ``<step>.orbax-checkpoint-tmp-*`` and renames it into place after
writing ``commit_success.txt`` inside it. ``latest_step`` and ``best_step`` additionally count only step
directories that contain that commit file, so a save killed at any point (a leftover temporary
directory, or a step directory without its commit marker) is never picked for restore.

Saves are asynchronous: ``save`` returns once the arrays are copied to host memory, so the caller may
donate or delete its buffers right after; ``wait`` blocks until the files are committed.

PRNG keys: typed key arrays (``jax.random.key``) are stored as their ``key_data`` (uint32) and rebuilt
with the template's key implementation on restore; raw uint32 key data round-trips as is.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.checkpoint_managers import preservation_policy as _pp

from marl_jax.train.rundir import is_uri  # gs://, s3://, ... (epath URIs): never made absolute

__all__ = ["Checkpointer", "COMMIT_FILE", "CheckpointWriteError", "ConfigChangedError", "config_changes",
           "RESUMABLE_KEYS", "LAYOUT_KEYS"]

COMMIT_FILE = "commit_success.txt"  # orbax writes it last, before the atomic rename
_BEST_KEY = "best_metric"




def _isdir(path) -> bool:
    return epath.Path(path).is_dir()


class _NoMetricWarning(logging.Filter):
    # orbax warns on every save without metrics; here that is normal (a checkpoint between validations)
    def filter(self, record: logging.LogRecord) -> bool:
        return "did not provide metrics" not in record.getMessage()


logging.getLogger("absl").addFilter(_NoMetricWarning())


def _is_typed_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _path_str(path: tuple) -> str:
    return jax.tree_util.keystr(path)


def _to_savable(state: Any) -> Any:
    """Typed PRNG keys -> key data, numpy scalars -> 0-d arrays; rejects leaves orbax cannot write."""

    def conv(path, x):
        if _is_typed_key(x):
            x = jax.random.key_data(x)
        elif isinstance(x, np.generic):
            x = np.asarray(x)
        elif isinstance(x, (bool, int, float)) and not isinstance(x, np.ndarray):
            pass  # orbax stores python scalars and gives them back as python scalars
        elif not isinstance(x, (np.ndarray, jax.Array)):
            raise TypeError(
                f"checkpoint state leaf {_path_str(path)} has type {type(x).__name__}; state must hold only "
                "jax/numpy arrays or python scalars (put other values in `meta`)")
        if np.size(x) == 0:
            raise ValueError(
                f"checkpoint state leaf {_path_str(path)} is an empty array of shape {np.shape(x)}; orbax "
                "cannot save zero-size arrays, so drop it from the state")
        return x

    return jax.tree_util.tree_map_with_path(conv, state)


def _to_restore_template(template: Any) -> Any:
    def conv(x):
        if _is_typed_key(x):
            return jax.random.key_data(x)
        if isinstance(x, np.generic):
            return np.asarray(x)
        return x

    return jax.tree.map(conv, template)


def _match_template(restored: Any, template: Any) -> Any:
    """Give back typed keys and numpy scalars where the template had them."""

    def conv(r, t):
        if _is_typed_key(t):
            return jax.random.wrap_key_data(r, impl=jax.random.key_impl(t))
        if isinstance(t, np.generic):
            return np.asarray(r, dtype=t.dtype)[()]
        return r

    return jax.tree.map(conv, restored, template)


def _check_json(meta: Mapping[str, Any]) -> dict:
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a JSON-able dict, got {type(meta).__name__}")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(f"meta is not JSON-serialisable ({e}); convert arrays with .tolist() / int()") from e
    return dict(meta)


# Config keys a resumed run may change freely: how long it runs and what it logs, never what it learns, and
# the keys that lay out the same computation another way (speed and memory only; tests check that each gives
# the same completions or the same step).
LAYOUT_KEYS = ("model.attention", "grpo.packing", "grpo.share_prefix", "grpo.remat", "grpo.remat_budget_gb", "grpo.unroll",
               "grpo.length_grid", "rollout.max_batch", "rollout.paged_kv", "rollout.kv_block", "rollout.compaction_buckets",
               "rollout.compaction_patience", "rollout.prefill_chunk", "grpo.max_tokens_per_micro_batch",
               "rollout.kv_budget_gb", "rollout.max_batched_tokens", "rollout.prompt_tokens", "train.warmup")
RESUMABLE_KEYS = ("train.steps", "train.val_every", "train.ckpt_every", "train.keep_ckpts", "train.tensorboard",
                  "train.plots", "grpo.diagnostics_every") + LAYOUT_KEYS


class ConfigChangedError(ValueError):
    """A resumed run's config differs from its checkpoint's in keys that change what is trained."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, say); the checkpoints before it are intact."""


def flat_config(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, Mapping):
        out = {}
        for k, v in d.items():
            out.update(flat_config(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: list(d) if isinstance(d, tuple) else d}


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any],
                   ignore: tuple[str, ...] = RESUMABLE_KEYS) -> list[tuple[str, Any, Any]]:
    """[(dotted key, saved value, current value)] for every key that differs, `ignore` aside.

    Both are plain dicts (config.to_dict()); tuples and lists compare equal, as JSON cannot tell them apart.
    """
    a, b = flat_config(json.loads(json.dumps(saved))), flat_config(json.loads(json.dumps(now)))
    absent = "<absent>"
    return [(k, a.get(k, absent), b.get(k, absent)) for k in sorted(set(a) | set(b))
            if k not in ignore and (k not in a or k not in b or a[k] != b[k])]


def _out_of_space(e: BaseException) -> bool:
    """True for a write that failed on a full disk or quota (tensorstore reports it inside a ValueError)."""
    import errno

    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "os_error_code='28'" in text or "Disk quota exceeded" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def _leaf_name(path: tuple) -> tuple[str, ...]:
    """A key path as plain names, so a saved dict and a template namedtuple/tuple line up."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


class Checkpointer:
    """Saves and restores ``(state, meta)`` pairs under ``<workdir>/checkpoints``.

    Args:
      workdir: the run directory (created on the first save).
      keep: number of most recent checkpoints to keep (>= 1).
      keep_best: also keep the checkpoint with the highest ``best_metric``, even when older than the
        last ``keep``.
      async_save: write in a background thread (``wait()`` joins it).
      read_only: for readers of a run that may still be training (evaluation, reports): never saves
        and never cleans up, so a save in flight in the training process is left alone.

    One writer per workdir: a writable Checkpointer removes leftovers of interrupted saves when it
    opens the directory.
    """

    def __init__(self, workdir: str | os.PathLike, keep: int = 3, keep_best: bool = True,
                 async_save: bool = True, read_only: bool = False):
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        # orbax needs absolute paths; gs:// (and other epath URIs) stay as they are
        self.workdir = str(workdir) if is_uri(workdir) else os.path.abspath(os.fspath(workdir))
        self.directory = os.path.join(self.workdir, "checkpoints")
        self.keep = int(keep)
        self.keep_best = bool(keep_best)
        self._async = bool(async_save)
        self.read_only = bool(read_only)
        self._mgr: ocp.CheckpointManager | None = None
        self._pending: int | None = None  # the step of a save still being written
        if _isdir(self.directory):
            self._open()

    # -- manager ---------------------------------------------------------------------------------
    def _open(self) -> ocp.CheckpointManager:
        if self._mgr is None:
            if not self.read_only:
                self._drop_uncommitted()
            policies: list[Any] = [_pp.LatestN(n=self.keep)]
            if self.keep_best:
                policies.append(_pp.BestN(get_metric_fn=lambda m: m[_BEST_KEY], reverse=False, n=1,
                                          keep_checkpoints_without_metrics=False))
            options = ocp.CheckpointManagerOptions(
                best_fn=lambda m: m[_BEST_KEY], best_mode="max",
                preservation_policy=_pp.AnyPreservationPolicy(policies),
                cleanup_tmp_directories=not self.read_only,  # drop leftovers of interrupted saves on open
                enable_async_checkpointing=self._async,
                create=not self.read_only,
                read_only=self.read_only,
            )
            self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        return self._mgr

    def _committed(self, step: int) -> bool:
        return epath.Path(self.directory, str(step), COMMIT_FILE).is_file()

    def _drop_uncommitted(self) -> None:
        """Removes step directories without a commit marker (left by a save killed mid-write)."""
        if jax.process_index() != 0 or not _isdir(self.directory):
            return
        for path in epath.Path(self.directory).iterdir():
            if path.name.isdigit() and path.is_dir() and not self._committed(int(path.name)):
                try:
                    path.rmtree()
                except OSError:
                    pass

    def _manager(self) -> ocp.CheckpointManager | None:
        """The orbax manager if the checkpoints directory exists (another process may have made it)."""
        if self._mgr is None and _isdir(self.directory):
            self._open()
        return self._mgr

    def all_steps(self) -> list[int]:
        """Committed checkpoint steps, ascending (waits for pending saves)."""
        mgr = self._manager()
        if mgr is None:
            return []
        self.wait()
        return sorted(s for s in mgr.all_steps() if self._committed(s))

    # -- API -------------------------------------------------------------------------------------
    def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None,
             best_metric: float | None = None) -> None:
        """Saves ``state`` (pytree of arrays) and ``meta`` (JSON dict) as checkpoint ``step``.

        ``best_metric`` (e.g. validation success) ranks checkpoints for ``best_step``; None means this
        checkpoint takes no part in the ranking. ``state`` is not modified. Steps must increase.
        """
        if self.read_only:
            raise PermissionError(f"this Checkpointer of {self.directory!r} is read_only; open it with "
                                  "read_only=False to save")
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        meta = _check_json(meta or {})
        metrics = None
        if best_metric is not None:
            best_metric = float(best_metric)
            if not math.isfinite(best_metric):
                raise ValueError(f"best_metric must be finite or None, got {best_metric}")
            metrics = {_BEST_KEY: best_metric}
        savable = _to_savable(state)
        mgr = self._open()
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"checkpoint step {step} is not after the latest saved step {latest} in {self.directory}; "
                "save increasing steps (a resumed run continues after its restored step)")
        with self._write_errors(step):
            saved = mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(savable),
                                                           meta=ocp.args.JsonSave(meta)),
                             metrics=metrics, force=True)
        self._pending = step if self._async else None
        if not saved:
            raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")

    def wait(self) -> None:
        """Blocks until every pending save is committed to disk.

        Raises CheckpointWriteError when a save failed for lack of space; the steps committed before it
        stay usable (orbax renames a step into place only once it is fully written).
        """
        if self._mgr is not None:
            with self._write_errors(self._pending):
                self._mgr.wait_until_finished()
            self._pending = None

    @contextlib.contextmanager
    def _write_errors(self, step: int | None):
        try:
            yield
        except Exception as e:
            if not _out_of_space(e):
                raise
            self._pending = None
            kept = sorted(s for s in (self._mgr.all_steps() if self._mgr else []) if self._committed(s))
            have = (f"the last complete checkpoint, step {kept[-1]}, is intact and a rerun of the same command "
                    "resumes from it" if kept else "no earlier checkpoint exists, so a rerun starts over")
            raise CheckpointWriteError(
                28, f"checkpoint{'' if step is None else f' step {step}'} could not be written to "
                    f"{self.directory}: no space left on device. {have}; free space there (or lower "
                    f"--config.train.keep_ckpts) and rerun") from e

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The committed step with the highest ``best_metric`` (later step on ties), or None."""
        best, best_val = None, -math.inf
        for s in self.all_steps():
            m = self._mgr.metrics(s)
            if m is not None and _BEST_KEY in m and float(m[_BEST_KEY]) >= best_val:
                best, best_val = s, float(m[_BEST_KEY])
        return best

    def best_metric(self, step: int) -> float | None:
        """The ``best_metric`` saved with ``step`` (None if it had none)."""
        mgr = self._manager()
        if mgr is None:
            return None
        m = mgr.metrics(int(step))
        return None if m is None or _BEST_KEY not in m else float(m[_BEST_KEY])

    def restore(self, step: int | None = None, template: Any = None) -> tuple[Any, dict]:
        """Returns ``(state, meta)`` of ``step`` (default: the latest committed step).

        ``template`` is a state-like pytree (arrays or ``jax.ShapeDtypeStruct``) giving the structure,
        dtypes, shapes and shardings to restore into; typed PRNG keys in it come back as typed keys.
        Without a template the saved structure and dtypes are used.
        """
        if not _isdir(self.workdir):
            raise FileNotFoundError(f"cannot restore: workdir {self.workdir!r} does not exist")
        if not _isdir(self.directory):
            raise FileNotFoundError(
                f"cannot restore: no checkpoints directory in {self.workdir!r} (nothing was saved there)")
        mgr = self._open()
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"cannot restore: no committed checkpoint in {self.directory!r}")
        step = int(step)
        if not self._committed(step):
            raise FileNotFoundError(
                f"cannot restore step {step}: no committed checkpoint for it in {self.directory!r}; "
                f"available steps: {self.all_steps()}")
        if template is not None:
            self._check_shapes(mgr, step, _to_restore_template(template))
        state_arg = (ocp.args.StandardRestore() if template is None
                     else ocp.args.StandardRestore(_to_restore_template(template)))
        restored = mgr.restore(step, args=ocp.args.Composite(state=state_arg, meta=ocp.args.JsonRestore()))
        state = restored.state if template is None else _match_template(restored.state, template)
        return state, dict(restored.meta or {})

    def _check_shapes(self, mgr: ocp.CheckpointManager, step: int, template: Any) -> None:
        """orbax restores a saved array into a template of another shape without a word: refuse instead."""
        from etils import epath

        # Read with a handler of our own: a manager opened on an existing directory has none registered yet.
        saved_md = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / "state")
        saved = {_leaf_name(p): tuple(getattr(m, "shape", ()) or ()) for p, m in
                 jax.tree_util.tree_leaves_with_path(saved_md)}
        bad = []
        for p, x in jax.tree_util.tree_leaves_with_path(template):
            name = _leaf_name(p)
            if name not in saved:
                bad.append(f"{jax.tree_util.keystr(p)} is not in the checkpoint")
            elif tuple(np.shape(x)) != saved[name]:
                bad.append(f"{jax.tree_util.keystr(p)} has shape {saved[name]} in the checkpoint, {tuple(np.shape(x))} "
                           "here")
        if bad:
            shown = "; ".join(bad[:3]) + (f"; ... ({len(bad)} leaves differ)" if len(bad) > 3 else "")
            raise ValueError(
                f"checkpoint step {step} in {self.directory} does not fit this model: {shown}. It was saved by a "
                "run of another model shape or trainable setup (model.name, trainable.rank/targets/mode, policy); "
                "resume with the config the run was trained with (its config.json), or use a new --workdir")

    def restore_meta(self, step: int | None = None) -> dict:
        """The JSON side record of `step` (default: the latest committed step), without reading the arrays."""
        mgr = self._manager()
        step = self.latest_step() if step is None else int(step)
        if mgr is None or step is None or not self._committed(step):
            raise FileNotFoundError(f"no committed checkpoint {'' if step is None else step} in {self.directory!r}")
        restored = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored.meta or {})

    def close(self) -> None:
        """Waits for pending saves and releases orbax's background resources."""
        if self._mgr is not None:
            try:
                self.wait()
            finally:
                self._mgr.close()
                self._mgr = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
