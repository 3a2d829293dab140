"""Bad inputs get one clear error naming the fix (never a traceback from deep inside), and lose no work.

One test per row of the "Bad inputs" table in docs/bad-inputs.md: task files (a malformed line, a missing key, an
empty answer, non-UTF-8 bytes), a prompt longer than the model's context, a model folder without
tokenizer files, a checkpoint of another model shape, a resumed run under a changed config, a mesh the
devices cannot form, and a disk that fills while a checkpoint is written.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from marl_jax.tasks.code import load_code_jsonl
from marl_jax.tasks.data import MissingKeyError, TaskFileError
from marl_jax.tasks.math import load_math_file
from marl_jax.train.checkpoint import Checkpointer, CheckpointWriteError, ConfigChangedError, config_changes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = '{"problem": "1+1?", "answer": "2"}\n'


# -- task files -----------------------------------------------------------------------------------

def test_malformed_json_line_names_file_line_and_fix(tmp_path):
    f = tmp_path / "tasks.jsonl"
    f.write_text(GOOD + '{"problem": "2+2?", "answer": "4"\n' + GOOD)
    with pytest.raises(TaskFileError) as e:
        load_math_file(f)
    msg = str(e.value)
    assert str(f) in msg and "line 2 is not valid JSON" in msg and "fix or delete that line" in msg


def test_missing_key_names_the_config_key_to_set(tmp_path):
    f = tmp_path / "tasks.jsonl"
    f.write_text(GOOD + '{"problem": "2+2?", "solution": "4"}\n')
    with pytest.raises(MissingKeyError) as e:
        load_math_file(f)
    msg = str(e.value)
    assert "line 2, row 1 has no answer key 'answer'" in msg and "available: ['problem', 'solution']" in msg
    assert "--config.task.answer_key=" in msg
    assert isinstance(e.value, ValueError) and isinstance(e.value, KeyError)  # caught by run.py; old callers too


def test_empty_answer_names_the_row_and_fix(tmp_path):
    f = tmp_path / "tasks.jsonl"
    f.write_text(GOOD + '\n{"problem": "2+2?", "answer": "  "}\n')  # a blank line in between: line 3, row 1
    with pytest.raises(TaskFileError, match=r"line 3, row 1: empty answer; give the row its reference answer"):
        load_math_file(f)


def test_non_utf8_bytes_name_the_line_byte_and_fix(tmp_path):
    f = tmp_path / "tasks.jsonl"
    f.write_bytes(GOOD.encode() + b'{"problem": "caf\xe9?", "answer": "1"}\n')  # latin-1 e-acute
    with pytest.raises(TaskFileError) as e:
        load_math_file(f)
    msg = str(e.value)
    assert "line 2 is not UTF-8 text (byte 0xe9 at column 17)" in msg and "iconv -f latin1 -t utf-8" in msg
    code = tmp_path / "code.jsonl"
    code.write_bytes(b'{"problem": "x\xff", "tests": []}\n')
    with pytest.raises(TaskFileError, match=r"line 1 is not UTF-8 text \(byte 0xff"):
        load_code_jsonl(code)


def test_code_file_missing_key_and_empty_tests(tmp_path):
    f = tmp_path / "code.jsonl"
    f.write_text('{"problem": "print 1", "test": []}\n')
    with pytest.raises(MissingKeyError, match=r"row 1: missing key 'tests'.*--config.task.tests_key="):
        load_code_jsonl(f)
    f.write_text('{"problem": "print 1", "tests": []}\n')
    with pytest.raises(TaskFileError, match=r"test list is empty \(an empty answer.*delete line 1"):
        load_code_jsonl(f)


def test_run_py_prints_the_message_not_a_traceback(tmp_path):
    """The CLI path: a malformed task file stops launch/run.py with the loader's message and exit code 2."""
    f = tmp_path / "tasks.jsonl"
    f.write_text(GOOD + "{oops\n")
    p = subprocess.run([sys.executable, os.path.join(REPO, "launch", "run.py"), "--config=configs/voting.py",
                        "--config.task.source=file", f"--config.task.path={f}", "--config.task.size=2",
                        "--config.task.val_size=1", f"--workdir={tmp_path / 'run'}", "--noprogress"],
                       capture_output=True, text=True, cwd=REPO, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", MARL_JAX_CACHE="off"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"error: {f}: line 2 is not valid JSON" in p.stderr
    assert "Traceback" not in p.stderr


# -- prompts and models ---------------------------------------------------------------------------

def test_prompt_longer_than_context_names_role_lengths_and_fix():
    from marl_jax.configs import get_config
    from marl_jax.models.tiny import tiny_model
    from marl_jax.policy.sampling import PolicySampler
    from marl_jax.tasks.base import Task
    from marl_jax.train.build import build
    from marl_jax.workflows.rollout import run_episodes

    m = tiny_model()
    m = m._replace(cfg=dataclasses.replace(m.cfg, max_position_embeddings=64))
    c = get_config("voting")
    c.task.update(size=4, val_size=2)
    tasks = [Task(f"t/{i}", "math", "What is " + "1 + " * 20 + "1?", "21") for i in range(6)]
    rt = build(c, model=m, tasks=tasks)
    key = jax.random.PRNGKey(0)
    sample = PolicySampler(rt.sampler, rt.base, rt.init_trainable(key), key)
    assert sample.max_context == 64
    with pytest.raises(ValueError) as e:
        run_episodes(rt.workflow, rt.train_tasks[:1], 2, sample, m.tokenizer, role_to_slot=rt.role_to_slot,
                     max_new_tokens=rt.max_new_tokens())
    msg = str(e.value)
    n = len(m.tokenizer.encode_chat([{"role": "user", "content": tasks[0].question}]))
    assert "role 'generator'" in msg and "max_new_tokens=32" in msg and "context of 64 tokens" in msg
    assert "--config.rollout.max_new_tokens.generator" in msg
    assert int(msg.split("a prompt of ")[1].split(" tokens")[0]) >= n  # the rendered prompt, template included
    assert sample.calls == []  # refused before any sampling


def test_model_folder_without_tokenizer_files(tiny_ckpt):
    from marl_jax.models.loading import load_model

    folder = tiny_ckpt("qwen3")  # weights and config.json only
    with pytest.raises(FileNotFoundError) as e:
        load_model(str(folder))
    msg = str(e.value)
    assert f"model folder {folder} has no tokenizer files" in msg and "config.json" in msg
    assert "save_pretrained" in msg and "tokenizer.json" in msg


def test_mesh_the_devices_cannot_form():
    from marl_jax.models import sharding

    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"needs {2 * n} devices, have {n}"):
        sharding.make_mesh(data=2 * n, model=1)


# -- checkpoints ----------------------------------------------------------------------------------

def test_checkpoint_of_another_shape_names_the_key(tmp_path):
    saved = {"trainable": {"wq": {"a": np.ones((1, 2, 64, 8), np.float32)}}, "step": np.int32(3)}
    with Checkpointer(tmp_path) as ck:
        ck.save(3, saved)
    wrong = {"trainable": {"wq": {"a": np.zeros((1, 2, 64, 16), np.float32)}}, "step": np.int32(0)}
    with pytest.raises(ValueError) as e:
        Checkpointer(tmp_path).restore(3, template=wrong)
    msg = str(e.value)
    assert "checkpoint step 3" in msg and "does not fit this model" in msg
    assert "['trainable']['wq']['a'] has shape (1, 2, 64, 8) in the checkpoint, (1, 2, 64, 16) here" in msg
    assert "trainable.rank" in msg and "new --workdir" in msg
    restored, _ = Checkpointer(tmp_path).restore(3, template=saved)  # the right shape still restores
    np.testing.assert_array_equal(restored["trainable"]["wq"]["a"], saved["trainable"]["wq"]["a"])


def _tiny_run_config(prompt_dir):
    from marl_jax.configs import get_config

    c = get_config("voting")
    c.workflow_options.update(n_votes=2, prompt_dir=prompt_dir)
    c.task.update(extraction="last_number", size=16, val_size=4)
    c.num_tasks, c.rollout.group_size = 2, 2
    c.rollout.max_new_tokens.generator = c.rollout.max_new_tokens.aggregator = 2
    c.trainable.update(rank=4, alpha=8.0)
    c.train.update(steps=1, val_every=1, ckpt_every=1, tensorboard=False, plots=False, warmup=False)
    return c


@pytest.fixture(scope="module")
def tiny_run(prompt_dir, tmp_path_factory):
    """A finished one-step training run of a tiny model (its workdir, config, model and tasks)."""
    from marl_jax.models.tiny import char_tokenizer, tiny_model
    from marl_jax.tasks.base import Task
    from marl_jax.train.loop import Trainer

    tok = char_tokenizer("0123456789:\n=")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}="
    model = tiny_model(tok, seed=1)
    tasks = [Task(f"d/{i}", "math", str(i % 10), str(i % 10)) for i in range(20)]
    workdir = str(tmp_path_factory.mktemp("tiny-run"))
    Trainer(_tiny_run_config(prompt_dir), workdir, model=model, tasks=tasks, progress=False).run()
    return workdir, model, tasks


def test_step_records_carry_the_samplers_work(tiny_run):
    """Each training step logs what its sampler calls did (PolicySampler.summary)."""
    workdir, _, _ = tiny_run
    steps = [r for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))) if "update_s" in r]
    assert steps
    for r in steps:
        assert 0 < r["sample_row_use"] <= 1 and 0 <= r["sample_cached_frac"] <= 1, r
        assert r["sample_decode_s"] >= 0 and r["sample_prefill_s"] > 0 and r["sample_peak_kv_mib"] > 0, r
        assert r["sample_prefill_s"] + r["sample_decode_s"] <= r["sampler_s"] * 1.01 + 1e-3, r


def test_resume_under_a_changed_config_is_refused_listing_the_keys(tiny_run, prompt_dir):
    from marl_jax.train.loop import Trainer

    workdir, model, tasks = tiny_run
    c = _tiny_run_config(prompt_dir)
    c.optim.lr = 1e-3
    c.rollout.temperature = 1.0
    c.train.steps = 2  # a step count: free to change
    before = open(os.path.join(workdir, "config.json")).read()
    with pytest.raises(ConfigChangedError) as e:
        Trainer(c, workdir, model=model, tasks=tasks, progress=False)
    msg = str(e.value)
    assert "optim.lr: 0.0003 in the checkpoint, 0.001 now" in msg
    assert "rollout.temperature: 0.7 in the checkpoint, 1.0 now" in msg
    assert "train.steps" not in msg.split("Differing keys:")[1].split("Run with")[0]
    assert "--allow_config_change" in msg
    assert open(os.path.join(workdir, "config.json")).read() == before  # nothing rewritten

    c = _tiny_run_config(prompt_dir)
    c.train.steps = 2  # only a step count changed: resumes
    t = Trainer(c, workdir, model=model, tasks=tasks, progress=False)
    assert t.start_step == 1
    t.ckpt.close()


def test_resume_of_a_checkpoint_from_before_a_key_existed(tiny_run, prompt_dir, monkeypatch):
    """A key newer than the checkpoint, at its default, is the older code's behaviour: the run resumes; set to
    something else, it is a change like any other."""
    from marl_jax.train.checkpoint import Checkpointer
    from marl_jax.train.loop import check_resume_config

    workdir, model, tasks = tiny_run
    restore = Checkpointer.restore_meta

    def older(self, step):
        meta = restore(self, step)
        del meta["config"]["levers"]["balance_cap"]
        return meta
    monkeypatch.setattr(Checkpointer, "restore_meta", older)
    c = _tiny_run_config(prompt_dir)
    c.levers.balance_cap = 0.5  # the default: what the older code did
    assert check_resume_config(workdir, c) == []
    c.levers.balance_cap = 0.3
    with pytest.raises(ConfigChangedError, match="levers.balance_cap: '<absent>' in the checkpoint, 0.3 now"):
        check_resume_config(workdir, c)


def test_resume_under_another_layout_of_the_same_computation(tiny_run, prompt_dir):
    """Packing, prefix sharing, recomputation, unrolled layers, the window grid, token-budget micro-batches, the
    attention implementation, the sampler's batch, paged KV, prefill chunks, the KV budget, the refill's token cap,
    compaction buckets, the update's prompt sizing and its warm-up change speed and memory, not what is computed: a run resumes under new values of them (and only them)."""
    from marl_jax.train.checkpoint import LAYOUT_KEYS, RESUMABLE_KEYS
    from marl_jax.train.loop import Trainer, check_resume_config

    workdir, model, tasks = tiny_run
    c = _tiny_run_config(prompt_dir)
    c.grpo.update(packing=False, share_prefix=0, remat="full", remat_budget_gb=1.0, unroll=True, length_grid=8)
    c.rollout.update(max_batch=16, paged_kv="true", kv_block=8, compaction_buckets=4, compaction_patience=8,
                     prefill_chunk=64, kv_budget_gb=0.5, max_batched_tokens=4096)
    c.model.attention = "blockwise"
    c.grpo.max_tokens_per_micro_batch = 4096
    c.rollout.prompt_tokens = 333
    c.train.warmup = not c.train.warmup
    changed = {k for k, a, b in config_changes(json.load(open(os.path.join(workdir, "config.json"))),
                                               c.to_dict(), ignore=tuple(set(RESUMABLE_KEYS) - set(LAYOUT_KEYS)))}
    assert changed == set(LAYOUT_KEYS)  # every layout key differs from the checkpoint's
    assert check_resume_config(workdir, c) == []
    c.train.steps = 2
    t = Trainer(c, workdir, model=model, tasks=tasks, progress=False)
    assert t.start_step == 1
    t.ckpt.close()


def test_resume_with_another_rank_names_the_leaf_even_when_allowed(tiny_run, prompt_dir):
    """--allow_config_change lets the config differ, but a checkpoint of another shape still cannot load."""
    from marl_jax.train.loop import Trainer

    workdir, model, tasks = tiny_run
    c = _tiny_run_config(prompt_dir)
    c.trainable.rank = 8
    with pytest.raises(ValueError, match=r"does not fit this model: \S+\['a'\] has shape "
                                         r"\(1, 2, \d+, 4\) in the checkpoint, \(1, 2, \d+, 8\) here.*trainable.rank"):
        Trainer(c, workdir, model=model, tasks=tasks, progress=False, allow_config_change=True)


def test_run_py_refuses_a_changed_config(tmp_path):
    """launch/run.py prints the differing keys and exits 2, before loading any model."""
    from marl_jax.configs import get_config

    old = get_config("voting").to_dict()
    old["grpo"]["clip_high"] = 0.2
    with Checkpointer(tmp_path) as ck:
        ck.save(3, {"step": np.int32(3)}, meta={"config": json.loads(json.dumps(old, default=list))})
    cmd = [sys.executable, os.path.join(REPO, "launch", "run.py"), "--config=configs/voting.py",
           f"--workdir={tmp_path}", "--noprogress"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", MARL_JAX_CACHE="off"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert "grpo.clip_high: 0.2 in the checkpoint, 0.28 now" in p.stderr and "--allow_config_change" in p.stderr
    assert "Traceback" not in p.stderr


def _assert_previous_checkpoint_usable(ck_dir, err):
    msg = str(err)
    assert isinstance(err, CheckpointWriteError) and err.errno == errno.ENOSPC
    assert "checkpoint step 2 could not be written" in msg and "no space left on device" in msg
    assert "step 1, is intact and a rerun of the same command resumes from it" in msg
    reopened = Checkpointer(ck_dir)  # what a rerun does: drops the partial write, finds step 1
    assert reopened.all_steps() == [1]
    state, meta = reopened.restore()
    assert meta == {"step": 1} and state["w"].shape == (256,)
    reopened.close()


def test_disk_full_during_a_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    """ENOSPC raised inside orbax's own array write (as a full disk raises it), in its background thread."""
    from orbax.checkpoint._src.serialization import type_handlers

    ck = Checkpointer(tmp_path / "run")
    ck.save(1, {"w": np.arange(256, dtype=np.float32)}, meta={"step": 1})
    ck.wait()

    async def no_space(self, value, tspec, ts_context):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type_handlers.NumpyHandler, "_open_and_write", no_space)
    with pytest.raises(CheckpointWriteError) as e:
        ck.save(2, {"w": np.ones(256, np.float32)}, meta={"step": 2})
        ck.wait()
    monkeypatch.undo()
    ck.close()
    _assert_previous_checkpoint_usable(tmp_path / "run", e.value)


def test_disk_full_on_a_real_tiny_filesystem(tmp_path):
    """The same on a 1 MiB tmpfs, where there is permission to mount one."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the simulated ENOSPC test covers the logic")
    try:
        ck = Checkpointer(mnt / "run")
        ck.save(1, {"w": np.random.RandomState(0).rand(256).astype(np.float32)}, meta={"step": 1})
        ck.wait()
        with pytest.raises(CheckpointWriteError) as e:
            ck.save(2, {"w": np.random.RandomState(1).rand(1 << 19).astype(np.float32)}, meta={"step": 2})  # 2 MiB
            ck.wait()
        ck.close()
        _assert_previous_checkpoint_usable(mnt / "run", e.value)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
