"""Checkpoint paths that are not local (gs://...) go through etils.epath, not os.path.

A fake gs:// filesystem (an epath backend that maps gs://bucket/... into a temporary folder) stands
in for Cloud Storage: the Checkpointer keeps the URI as given (no os.path.abspath mangling into
"<cwd>/gs:/bucket"), finds committed steps and drops uncommitted ones through it."""
from __future__ import annotations

import os

import pytest
from etils import epath
from etils.epath import backend as backend_lib
from etils.epath import gpath

from marl_jax.train.checkpoint import COMMIT_FILE, Checkpointer


class FakeGCS(backend_lib._OsPathBackend):
    """gs://<bucket>/<path> -> <root>/<bucket>/<path>; records every path it was asked about."""

    def __init__(self, root):
        self.root, self.seen = str(root), []

    def _m(self, path):
        path = os.fspath(path)
        assert path.startswith("gs://"), f"a local path reached the gs:// backend: {path}"
        self.seen.append(path)
        return os.path.join(self.root, path[len("gs://"):])

    def open(self, path, mode):
        return super().open(self._m(path), mode)

    def exists(self, path):
        return super().exists(self._m(path))

    def isdir(self, path):
        return super().isdir(self._m(path))

    def listdir(self, path):
        return super().listdir(self._m(path))

    def glob(self, path):
        return ["gs://" + os.path.relpath(p, self.root) for p in super().glob(self._m(path))]

    def makedirs(self, path, *, exist_ok=False, mode=None):
        return super().makedirs(self._m(path), exist_ok=exist_ok)

    def mkdir(self, path, *, exist_ok=False, mode=None):
        return super().mkdir(self._m(path), exist_ok=exist_ok)

    def rmtree(self, path):
        return super().rmtree(self._m(path))

    def remove(self, path):
        return super().remove(self._m(path))

    def rename(self, path, dst):
        return super().rename(self._m(path), self._m(dst))

    def replace(self, path, dst):
        return super().replace(self._m(path), self._m(dst))

    def stat(self, path):
        return super().stat(self._m(path))


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
    fake = FakeGCS(tmp_path / "gcs")
    monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", fake)
    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
    # orbax asks the Cloud Storage API whether a bucket has hierarchical namespaces; the fake has none.
    from orbax.checkpoint._src.path import gcs_utils
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    return fake


def test_checkpointer_keeps_a_gs_workdir_and_reads_it_through_epath(fake_gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = "gs://bucket/runs/vote"
    ckdir = epath.Path(run) / "checkpoints"
    (ckdir / "3").mkdir(parents=True)
    (ckdir / "3" / COMMIT_FILE).write_text("ok")
    (ckdir / "4").mkdir()  # a save killed before its commit marker
    ck = Checkpointer(run, read_only=True)
    assert ck.workdir == run and ck.directory == run + "/checkpoints"
    assert ck._committed(3) and not ck._committed(4)
    ck._drop_uncommitted()  # what a writable Checkpointer does when it opens the folder
    assert sorted(p.name for p in ckdir.iterdir()) == ["3"]
    assert (tmp_path / "gcs" / "bucket" / "runs" / "vote" / "checkpoints" / "3" / COMMIT_FILE).is_file()
    assert not os.path.exists(tmp_path / "gs:")  # nothing was written to a local "gs:" folder
    assert any(p.startswith("gs://bucket/runs/vote/checkpoints") for p in fake_gcs.seen)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint for it"):
        ck.restore(4)
