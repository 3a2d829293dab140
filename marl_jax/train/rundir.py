"""A run folder that is not local (gs://, s3://, ...): a local mirror of its small files, synced to it.

Checkpoints go to the URI itself (orbax writes object stores directly). Everything else a run writes
(metrics.jsonl, val_tasks.jsonl, config.json, TensorBoard events, the summary and its plots) is appended
to or rewritten many times per run, and object stores have no append: those files are written in a
local mirror and copied to the URI after every checkpoint and when the run ends (so a run killed between
checkpoints loses at most the records since the last one, as its state). A resumed run first copies them
back down, so its records continue the same files.

The mirror is <root>/<name>-<hash of the URI>, root = $MARL_JAX_MIRROR or <tmp>/marl_jax_mirror.
For a local path the folder is used as it is and nothing is copied.
"""
from __future__ import annotations

import hashlib
import os
import tempfile

from etils import epath

MIRROR_ENV = "MARL_JAX_MIRROR"
CHECKPOINTS = "checkpoints"  # written to the URI by the Checkpointer, never mirrored


def is_uri(path) -> bool:
    """gs://, s3://, ... paths (etils.epath): not local."""
    return "://" in str(path)


def _remote_files(root: epath.Path, rel: str = ""):
    """Relative paths of the files under root (through epath: listdir / isdir), checkpoints left out."""
    for p in (root / rel).iterdir() if rel else root.iterdir():
        r = f"{rel}/{p.name}" if rel else p.name
        if r == CHECKPOINTS:
            continue
        if p.is_dir():
            yield from _remote_files(root, r)
        else:
            yield r


class RunDir:
    """`local`: where the run writes its records; `uri`: where it lives (checkpoints go there)."""

    def __init__(self, path: str | os.PathLike, mirror_root: str | None = None):
        self.uri = os.fspath(path)
        self.remote = is_uri(self.uri)
        if self.remote:
            root = mirror_root or os.environ.get(MIRROR_ENV) or os.path.join(tempfile.gettempdir(), "marl_jax_mirror")
            tag = hashlib.sha1(self.uri.encode()).hexdigest()[:10]
            self.local = os.path.join(root, f"{epath.Path(self.uri).name or 'run'}-{tag}")
        else:
            self.local = self.uri
        os.makedirs(self.local, exist_ok=True)
        self._pushed: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) last copied up

    def pull(self) -> int:
        """Copy the URI's files (checkpoints aside) into the mirror, replacing what is there; returns the
        number copied. A no-op for a local folder or a URI that does not exist yet."""
        root = epath.Path(self.uri)
        if not self.remote or not root.exists():
            return 0
        n = 0
        for rel in _remote_files(root):
            dst = os.path.join(self.local, *rel.split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "wb") as f:
                f.write((root / rel).read_bytes())
            st = os.stat(dst)
            self._pushed[rel] = (st.st_size, st.st_mtime_ns)
            n += 1
        return n

    def push(self) -> int:
        """Copy the mirror's new or changed files to the URI; returns the number copied."""
        if not self.remote:
            return 0
        root = epath.Path(self.uri)
        n = 0
        for dirpath, _, files in os.walk(self.local):
            for name in files:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, self.local).replace(os.sep, "/")
                st = os.stat(path)
                if self._pushed.get(rel) == (st.st_size, st.st_mtime_ns):
                    continue
                dst = root / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "rb") as f:
                    dst.write_bytes(f.read())
                self._pushed[rel] = (st.st_size, st.st_mtime_ns)
                n += 1
        return n
