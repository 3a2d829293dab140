"""`python -m marl_jax.rollout` end to end on the embedded model, its error messages, and checkpoint loading."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.models.decoder import LINEAR_NAMES, config_from_hf
from marl_jax.models.embedded import embedded_gguf_path
from marl_jax.models.gguf import read_gguf_config
from marl_jax.policy.lora import PolicySpec, init_trainable
from marl_jax.rollout import load_trainable
from marl_jax.train.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOTING = os.path.join(REPO, "configs", "voting.py")
TINY = ["--config.num_tasks=1", "--config.rollout.group_size=2", "--config.rollout.max_new_tokens.generator=8",
        "--config.rollout.max_new_tokens.aggregator=8", "--config.task.size=8", "--config.task.val_size=2",
        "--seed=3"]
N_VOTES = 3  # configs/voting.py


def _cli(args, cwd, timeout=240):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's plain run
    return subprocess.run([sys.executable, "-m", "marl_jax.rollout", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _read_rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    proc = _cli([f"--config={VOTING}", *TINY, f"--out={d / 'out' / 'rows.jsonl'}"], cwd=d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, _read_rows(d / "out" / "rows.jsonl")


def test_cli_prints_transcripts_and_writes_rows(base_run):
    proc, rows = base_run
    out = proc.stdout
    headers = re.findall(r"^task (\S+) \(math\)  episode (\d+) ", out, flags=re.M)
    assert len(headers) == 2 and len({t for t, _ in headers}) == 1  # 1 task x 2 episodes
    assert out.count("] generator call") == 2 * N_VOTES and out.count("] aggregator call") == 2
    assert re.search(r"^final: reward [01] ", out, flags=re.M)
    assert re.search(r"^generator +\S+ +3\.00 ", out, flags=re.M)  # summary: 3 generator calls per episode
    assert re.search(r"time [\d.]+s \([\d.]+ episodes/s\): sampler [\d.]+s .* glue .* reward ", out)

    assert len(rows) == 2 * (N_VOTES + 1)
    assert sorted({r["role"] for r in rows}) == ["aggregator", "generator"]
    for r in rows:
        assert r["prompt_tokens"] and all(isinstance(t, int) for t in r["prompt_tokens"])
        assert 1 <= len(r["completion_tokens"]) <= 8
        assert len(r["logprobs"]) == len(r["completion_tokens"]) and max(r["logprobs"]) <= 0.0
        assert r["slot"] == 0 and r["reward"] in (0.0, 1.0)
    for ep in {r["episode_id"] for r in rows}:  # broadcast credit: one reward per episode
        assert len({r["reward"] for r in rows if r["episode_id"] == ep}) == 1
    # Voting on math groups voters by call index: (task, "generator", k) for k < n_votes.
    gen_keys = sorted(tuple(r["group_key"]) for r in rows if r["role"] == "generator")
    assert sorted({k[2] for k in gen_keys}) == list(range(N_VOTES))
    # The aggregator's prompt quotes every voter's output token for token (minus the stop token).
    for ep in {r["episode_id"] for r in rows}:
        agg = next(r for r in rows if r["episode_id"] == ep and r["role"] == "aggregator")
        for g in (r for r in rows if r["episode_id"] == ep and r["role"] == "generator"):
            quoted = g["completion_tokens"][:-1] if g["finished"] else g["completion_tokens"]
            p, q = agg["prompt_tokens"], quoted
            assert any(p[i:i + len(q)] == q for i in range(len(p) - len(q) + 1))


def test_cli_samples_from_a_trained_checkpoint_by_slot(base_run, tmp_path):
    """IP checkpoint: generator slot = base (B = 0), aggregator slot perturbed. Same seed as the SP
    base run: generator rows must come out identical, aggregator rows different and from slot 1."""
    _, base_rows = base_run
    cfg = config_from_hf(read_gguf_config(embedded_gguf_path("smollm2-135m-instruct")))
    spec = PolicySpec(rank=8, alpha=16.0, targets=LINEAR_NAMES, num_slots=2)  # configs' embedded LoRA
    tr = init_trainable(spec, cfg, None, jax.random.key(0))
    tr = {k: {"a": v["a"], "b": v["b"].at[1].set(0.02 * jax.random.normal(jax.random.key(i), v["b"].shape[1:]))}
          for i, (k, v) in enumerate(tr.items())}
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(5, {"trainable": tr, "step": jnp.int32(5)})

    proc = _cli([f"--config={VOTING}", *TINY, "--config.policy=isolated", f"--trained_workdir={tmp_path / 'run'}"],
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 5" in proc.stdout
    rows = _read_rows(tmp_path / "rollout_rows.jsonl")  # the default --out, in the cwd
    assert len(rows) == len(base_rows)
    for a, b in zip(base_rows, rows):
        assert a["role"] == b["role"] and a["episode_id"] == b["episode_id"]
        assert b["slot"] == (0 if b["role"] == "generator" else 1)
        if b["role"] == "generator":
            assert a["prompt_tokens"] == b["prompt_tokens"] and a["completion_tokens"] == b["completion_tokens"]
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
        else:
            assert a["prompt_tokens"] == b["prompt_tokens"]
            n = min(len(a["logprobs"]), len(b["logprobs"]))
            assert a["completion_tokens"] != b["completion_tokens"] or \
                np.max(np.abs(np.subtract(a["logprobs"][:n], b["logprobs"][:n]))) > 1e-3


def test_unknown_config_key_fails_naming_it(tmp_path):
    proc = _cli([f"--config={VOTING}", "--config.no_such_key=1"], cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "no_such_key" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli([f"--config={VOTING}", "--config.rollout.max_new_token.generator=3"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "did you mean --config.rollout.max_new_tokens.generator?" in proc.stderr


def test_bad_config_value_fails_naming_the_fix(tmp_path):
    proc = _cli([f"--config={VOTING}", "--config.policy=foo"], cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "--config.policy='foo'" in proc.stderr and "'shared'" in proc.stderr and "'isolated'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "rollout_rows.jsonl").exists()


def _small_tree(slots=2, rank=2):
    return {"wq": {"a": jnp.ones((slots, 1, 4, rank)), "b": jnp.arange(slots * rank * 3, dtype=jnp.float32)
                   .reshape(slots, 1, rank, 3)}}


def test_load_trainable_checks_the_checkpoint(tmp_path):
    tree = _small_tree()
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(2, {"trainable": tree, "opt": {"mu": jnp.zeros(3)}}, best_metric=0.5)
        ckpt.save(4, {"trainable": jax.tree_util.tree_map(lambda x: x + 1, tree)}, best_metric=0.25)
    got, step = load_trainable(str(tmp_path / "run"), "latest", jax.tree_util.tree_map(jnp.zeros_like, tree))
    assert step == 4
    np.testing.assert_array_equal(got["wq"]["b"], np.asarray(tree["wq"]["b"]) + 1)
    got, step = load_trainable(str(tmp_path / "run"), "best", tree)
    assert step == 2
    np.testing.assert_array_equal(got["wq"]["b"], tree["wq"]["b"])
    with pytest.raises(ValueError, match=r"\[.wq.\]\[.a.\] has shape \(2, 1, 4, 2\), this config builds "
                                         r"\(2, 1, 4, 4\).*trainable.rank"):
        load_trainable(str(tmp_path / "run"), "latest", _small_tree(rank=4))
    with pytest.raises(ValueError, match="does not match this config"):
        load_trainable(str(tmp_path / "run"), "latest", {"wk": tree["wq"]})
    with pytest.raises(ValueError, match="latest, best or a step number"):
        load_trainable(str(tmp_path / "run"), "newest", tree)
    with Checkpointer(tmp_path / "other") as ckpt:
        ckpt.save(1, {"params": tree})
    with pytest.raises(ValueError, match=r"no 'trainable' entry \(it holds \['params'\]\)"):
        load_trainable(str(tmp_path / "other"), "latest", tree)
