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


def test_gs_workdir_run_writes_records_to_the_uri_and_resumes_from_them(fake_gcs, tmp_path, monkeypatch, prompt_dir):
    """A whole run with --workdir=gs://...: metrics, validation records, config and TensorBoard events reach
    the bucket (copied from a local mirror at each checkpoint and at the end), nothing lands in a local
    "gs:" folder, and a resumed run on a fresh machine (no mirror) continues the bucket's records."""
    import json
    import sys

    from marl_jax.models.tiny import tiny_model
    from marl_jax.train import loop

    sys.path.insert(0, os.path.dirname(__file__))
    from test_learning import digit_tasks, learning_config, tiny_tokenizer

    root = tmp_path / "gcs"

    class BucketCheckpointer(Checkpointer):
        """Array data goes through tensorstore's own gcs driver, which needs the network: here the
        checkpoints go to the folder the fake gs:// backend maps the URI to."""

        def __init__(self, workdir, *args, **kw):
            assert str(workdir).startswith("gs://"), workdir
            super().__init__(str(root / str(workdir)[len("gs://"):]), *args, **kw)

    monkeypatch.setattr(loop, "Checkpointer", BucketCheckpointer)
    monkeypatch.chdir(tmp_path)
    uri = "gs://bucket/runs/vote"

    def run(steps, mirror):
        monkeypatch.setenv("MARL_JAX_MIRROR", str(tmp_path / mirror))
        c = learning_config("shared", prompt_dir)
        c.num_tasks, c.rollout.group_size = 4, 4
        c.task.update(size=40, val_size=4)
        c.grpo.update(micro_batch=32)
        c.train.update(steps=steps, val_every=1, ckpt_every=1, tensorboard=True, plots=False, warmup=False)
        t = loop.Trainer(c, uri, model=tiny_model(tiny_tokenizer(), seed=1), tasks=digit_tasks(44), progress=False)
        assert t.workdir.startswith(str(tmp_path / mirror)) and t.run_dir.uri == uri
        return t, t.run()

    t, out = run(2, "mirror-a")
    assert out["workdir"] == uri
    bucket = root / "bucket" / "runs" / "vote"
    steps = lambda: [json.loads(l).get("step") for l in (bucket / "metrics.jsonl").read_text().splitlines()]
    assert steps() == [0, 1, 1, 2, 2]  # validation at 0, then each step's record and its validation
    assert json.loads((bucket / "config.json").read_text())["workflow"] == "voting"
    assert (bucket / "val_tasks.jsonl").read_text().count("\n") == 3
    assert any(p.name.startswith("events.out.tfevents") for p in (bucket / "tb").iterdir())
    assert not os.path.exists(tmp_path / "gs:")
    assert any(p.startswith(uri + "/metrics.jsonl") for p in fake_gcs.seen)

    # A fresh machine: another (empty) mirror; the run resumes at step 2 from the bucket's checkpoint.
    t, _ = run(3, "mirror-b")
    assert t.start_step == 2
    assert steps() == [0, 1, 1, 2, 2, 3, 3]


def test_task_files_are_read_from_a_gs_uri(fake_gcs, tmp_path, monkeypatch):
    """--config.task.path=gs://... : math (.jsonl, .json, .parquet) and code task files are read through epath."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from marl_jax.tasks.code import load_code_jsonl
    from marl_jax.tasks.math import load_math_file

    monkeypatch.chdir(tmp_path)
    d = epath.Path("gs://bucket/data")
    d.mkdir(parents=True)
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+3?", "answer": "5"}]
    (d / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "m.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "gcs" / "bucket" / "data" / "m.parquet"))
    for name in ("m.jsonl", "m.json", "m.parquet"):
        tasks = load_math_file(f"gs://bucket/data/{name}")
        assert [(t.question, t.answer) for t in tasks] == [("1+1?", "2"), ("2+3?", "5")], name
    (d / "c.jsonl").write_text(json.dumps({"problem": "echo", "tests": [{"input": "1\n", "output": "1\n"}]}) + "\n")
    assert len(load_code_jsonl("gs://bucket/data/c.jsonl")) == 1
    with pytest.raises(FileNotFoundError, match="gs://bucket/data/missing.jsonl"):
        load_math_file("gs://bucket/data/missing.jsonl")
    assert not os.path.exists(tmp_path / "gs:")
    assert any(p.endswith("m.parquet") for p in fake_gcs.seen)
