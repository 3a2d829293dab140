"""Continuous batching: more prompts than batch rows; finished rows are refilled with waiting prompts. Completions
equal transformers' generate (greedy) and the run-each-chunk-to-its-end sampler, log-probs equal a teacher-forced
pass, and the batch does less wasted work and holds less KV cache than one dense batch of every row."""
from __future__ import annotations

import dataclasses

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from hf_fixtures import left_pad
from marl_jax.generate.sampler import Sampler, SamplingParams
from marl_jax.models import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_sampler import (HEAD_SCALE, PAD, _torch_threads, random_prompts,  # noqa: E402,F401
                          teacher_forced_logp, tiny)  # shared fixtures

REPO = pathlib.Path(__file__).resolve().parents[1]


def long_tail_limits(n, T, seed=0):
    """Most rows stop within a few tokens, one in six runs to the limit T."""
    rng = np.random.RandomState(seed)
    return np.where(np.arange(n) % 6 == 2, T, rng.randint(1, 6, n)).tolist()


@pytest.mark.parametrize("paged", [False, True, "fused"])
def test_greedy_refilled_rows_match_transformers_generate(tiny, paged, monkeypatch):
    """Refilled and compacted rows, with the dense and the paged KV cache, give transformers' greedy tokens;
    "fused": the paged cache read by GPU's decode path (attention.paged_fused, model.attention=cudnn)."""
    from marl_jax.models import attention as A
    cfg, params, model = tiny
    traced = []
    if paged == "fused":
        cfg = dataclasses.replace(cfg, attention="cudnn")
        real = A.paged_fused
        monkeypatch.setattr(A, "paged_fused", lambda *a, **k: traced.append(1) or real(*a, **k))
    prompts = random_prompts(20, cfg.vocab_size, seed=21, lo=2, hi=20)
    limits = long_tail_limits(20, 16)
    sampler = Sampler(cfg, pad_id=PAD, max_batch=8, min_batch=1, paged=bool(paged), kv_block=4)
    out = sampler.generate(params, prompts, jax.random.PRNGKey(0), SamplingParams(16, temperature=0.0),
                           max_new_tokens=limits)
    assert sampler.stats["refills"] >= 2 and sampler.stats["peak_kv_bytes"] > 0
    if paged:
        assert sampler.stats["compactions"] >= 1
    assert bool(traced) == (paged == "fused")  # the decode programs went through paged_fused
    tokens, mask, _ = left_pad(prompts, PAD)
    with torch.no_grad():
        ref = model.generate(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                             max_new_tokens=16, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    ref = ref[:, tokens.shape[1]:].numpy()
    np.testing.assert_array_equal(out.lengths, limits)
    for i, n in enumerate(limits):
        assert out.row(i)[0] == ref[i, :n].tolist(), f"row {i}"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_continuous_equals_chunks_run_to_their_end(tiny, temperature):
    """30 prompts, per-row limits and a stop token: 8 rows refilled as they finish, against chunks of 8 rows each
    run to its end without compaction. Same key, same completions; log-probs equal the teacher-forced pass;
    fewer computed row-steps and a quarter of the KV cache of one dense batch of all rows."""
    cfg, params, model = tiny
    prompts = random_prompts(30, cfg.vocab_size, seed=22, lo=1, hi=24)
    limits = long_tail_limits(30, 24, seed=1)
    key = jax.random.PRNGKey(4)
    chunked = Sampler(cfg, pad_id=PAD, max_batch=8, continuous=False, compaction=False, prefix_cache_tokens=0)
    ref = chunked.generate(params, prompts, key, SamplingParams(24, temperature=temperature), max_new_tokens=limits)
    stop = int(ref.tokens[2, 5])  # row 2 (a long one) ends on its 6th token, or earlier if it emits it before
    sp = SamplingParams(24, temperature=temperature, stop_ids=(stop,))
    ref = chunked.generate(params, prompts, key, sp, max_new_tokens=limits)
    cont = Sampler(cfg, pad_id=PAD, max_batch=8, prefix_cache_tokens=0)
    out = cont.generate(params, prompts, key, sp, max_new_tokens=limits)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_array_equal(out.finished, ref.finished)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert out.finished[2] and out.lengths[2] <= 6
    st = cont.stats
    assert st["refills"] >= 3 and st["row_steps"] < chunked.stats["row_steps"]
    assert st["useful_row_steps"] == int((out.lengths - 1).sum()) <= st["row_steps"]
    dense = Sampler(cfg, pad_id=PAD, max_batch=64, continuous=False, prefix_cache_tokens=0)
    dense.generate(params, prompts, key, sp, max_new_tokens=limits)
    assert st["peak_kv_bytes"] * 4 == dense.stats["peak_kv_bytes"]  # 8 rows against 32 (30 bucketed)
    for i, (tf_lp, _) in enumerate(teacher_forced_logp(model, prompts, out, temperature)):
        np.testing.assert_allclose(out.row(i)[1], tf_lp, atol=1e-4, rtol=0, err_msg=f"row {i}")


def test_continuous_and_prefix_cache_on_a_mesh():
    """8 fake CPU devices: continuous batching, compaction and the prefix cache give one device's greedy
    tokens on data-, fsdp- and model-split meshes, for the base model and an Isolated-Policy LoRA slot,
    with the dense and the paged KV cache, and under a KV budget that preempts rows (the reference is dense, on one
    device)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "sampler_mesh_driver.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert report["devices"] == 8
    assert sum(m.endswith("-paged") for m in report["meshes"]) == 3, report
    assert report["meshes"]["2x2x2-budget"]["preemptions"] >= 1, report  # a KV budget that preempts, per shard
    # Paged on 8 data shards: each device holds one shard of the pool, and decode moves no pool-sized data.
    loc = report["paged_locality"]
    assert loc["pool_shards"] == 8 and loc["shards_per_device"] == 1, loc
    assert 0 < loc["largest_collective"] * 20 < loc["pool_layer_elems"], loc
    for mesh, r in report["meshes"].items():
        assert r["refills"] >= 1 and r["cached_tokens"] > 0, mesh
        assert r["same"] and r["same_extended"] and r["lora_same"], (mesh, r)


def test_long_tails_compacted_onto_the_fine_grid_waste_fewer_row_steps(tiny):
    """A tail still decoding after compaction_patience steps is compacted onto compaction_buckets sizes per
    octave: the same completions as the coarse grid alone (compaction_buckets=2), no more computed row-steps
    for the same useful ones on a long-tail workload, and with patience never reached, the coarse schedule."""
    cfg, params, _ = tiny
    prompts = random_prompts(40, cfg.vocab_size, seed=23, lo=1, hi=20)
    limits = np.where(np.arange(40) % 9 == 3, 32, np.random.RandomState(2).randint(1, 6, 40)).tolist()
    key, sp = jax.random.PRNGKey(5), SamplingParams(32, temperature=0.0)
    run = {}
    for name, kw in (("coarse", dict(compaction_buckets=2)), ("fine", dict(compaction_buckets=16, compaction_patience=4)),
                     ("patient", dict(compaction_buckets=16, compaction_patience=1000)),
                     ("off", dict(compaction=False, compaction_patience=4))):
        s = Sampler(cfg, pad_id=PAD, max_batch=16, min_batch=1, prefix_cache_tokens=0, **kw)
        run[name] = (s.generate(params, prompts, key, sp, max_new_tokens=limits).tokens, dict(s.stats))
    (a, coarse), (b, fine), (c, patient), (d, off) = run["coarse"], run["fine"], run["patient"], run["off"]
    for other in (b, c, d):
        np.testing.assert_array_equal(a, other)
    assert off["compactions"] == 0 and off["row_steps"] > coarse["row_steps"]  # compaction=False: none at all
    assert fine["useful_row_steps"] == coarse["useful_row_steps"]
    assert fine["row_steps"] < coarse["row_steps"] and fine["fine_compactions"] >= 1, (fine, coarse)
    assert patient["row_steps"] == coarse["row_steps"] and patient["fine_compactions"] == 0


@pytest.mark.parametrize("per_octave,patience", [(2, 64), (16, 5), (8, 1)])
def test_host_replay_of_the_schedule_counts_what_the_sampler_computes(tiny, per_octave, patience):
    """schedule_row_steps (the planner's and the benchmark's replay of the batching schedule) gives the
    sampler's own row-steps, compactions and refills for the lengths the rows actually took."""
    from marl_jax.generate.scheduler import schedule_row_steps

    cfg, params, _ = tiny
    prompts = random_prompts(45, cfg.vocab_size, seed=31, lo=1, hi=24)
    limits = np.where(np.arange(45) % 9 == 4, 40, np.random.RandomState(3).randint(1, 9, 45)).tolist()
    s = Sampler(cfg, pad_id=PAD, max_batch=16, min_batch=1, prefix_cache_tokens=0, compaction_buckets=per_octave,
                compaction_patience=patience)
    out = s.generate(params, prompts, jax.random.PRNGKey(1), SamplingParams(40, temperature=0.0),
                     max_new_tokens=limits)
    order = np.argsort([-len(p) for p in prompts], kind="stable")  # the sampler takes the longest first
    r = schedule_row_steps(out.lengths[order], 16, min_batch=1, per_octave=per_octave, patience=patience)
    assert s.stats["compactions"] >= 2 and s.stats["refills"] >= 2, s.stats
    assert (per_octave == 2) == (s.stats["fine_compactions"] == 0), s.stats
    assert (r["row_steps"], r["useful"], r["compactions"], r["fine_compactions"], r["refills"]) == (
        s.stats["row_steps"], s.stats["useful_row_steps"], s.stats["compactions"], s.stats["fine_compactions"],
        s.stats["refills"]), (r, s.stats)
