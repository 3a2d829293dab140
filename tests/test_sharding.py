"""Sharding on 8 fake CPU devices: sharded parameters give the unsharded logits and samples.

XLA_FLAGS must be set before jax starts, so the multi-device part runs once, in a subprocess, and reports
JSON; the tests below check that report.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from marl_jax.models import sharding

REPO = pathlib.Path(__file__).resolve().parents[1]
MESHES = ((2, 4), (4, 2))

SCRIPT = textwrap.dedent('''
    import json

    import jax
    import numpy as np

    from marl_jax.generate.sampler import Sampler, SamplingParams
    from marl_jax.models import decoder, sharding
    from marl_jax.models.decoder import ModelConfig

    # vocab 322 = 2 * 161: split on a model axis of 2, not of 4.
    cfg = ModelConfig(family="qwen2", vocab_size=322, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
    params = decoder.init_params(cfg, jax.random.PRNGKey(0))
    params = {**params, "lm_head": params["lm_head"] * 20.0}  # peaked logits: greedy has no near-ties
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg.vocab_size, (8, 24))
    valid = np.ones_like(tokens, bool)
    for b in range(8):
        valid[b, : rng.randint(0, 12)] = False
    fwd = jax.jit(lambda p, t, v: decoder.forward(p, cfg, t, v))
    ref = np.asarray(fwd(params, tokens, valid))
    prompts = [rng.randint(0, cfg.vocab_size, rng.randint(1, 17)).tolist() for _ in range(11)]
    limits = [16, 3, 16, 2, 5, 16, 1, 4, 16, 2, 3]  # rows finish early: the sharded compaction runs too
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    key = jax.random.PRNGKey(1)
    g_ref = Sampler(cfg).generate(params, prompts, key, greedy, max_new_tokens=limits)
    shared = rng.randint(0, cfg.vocab_size, 20).tolist()  # prefilled once, then broadcast over the data axis
    prefixed = [shared + p for p in prompts]
    gp_ref = Sampler(cfg).generate(params, prefixed, key, greedy, max_new_tokens=limits)
    out = {"devices": len(jax.devices()), "logits_scale": float(np.abs(ref).max())}
    for data, model in MESHES:
        mesh = sharding.make_mesh(data, model)
        sharded = sharding.shard_params(params, mesh)
        flat = jax.tree_util.tree_flatten_with_path(sharded)[0]
        res = {
            "logits_max_diff": float(np.abs(np.asarray(fwd(sharded, tokens, valid)) - ref).max()),
            "specs": {jax.tree_util.keystr(p): [a if a is None else str(a) for a in x.sharding.spec] for p, x in flat},
            "shard_shapes": {jax.tree_util.keystr(p): list(x.addressable_shards[0].data.shape) for p, x in flat},
            "full_shapes": {jax.tree_util.keystr(p): list(x.shape) for p, x in flat},
        }
        if (data, model) == MESHES[0]:  # greedy, rows finishing early (compaction on the mesh)
            s = Sampler(cfg, mesh=mesh)
            g = s.generate(sharded, prompts, key, greedy, max_new_tokens=limits)
            res["compactions"] = s.stats["compactions"]
            res["greedy_tokens"], res["greedy_ref"] = g.tokens.tolist(), g_ref.tokens.tolist()
            res["greedy_lengths"], res["greedy_ref_lengths"] = g.lengths.tolist(), g_ref.lengths.tolist()
            gp = s.generate(sharded, prefixed, key, greedy, max_new_tokens=limits)
            res["prefix_shared"] = s.stats["prefill_tokens"] < s.stats["prompt_tokens"]
            res["prefixed_tokens"], res["prefixed_ref"] = gp.tokens.tolist(), gp_ref.tokens.tolist()
        out[f"{data}x{model}"] = res
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    script = tmp_path_factory.mktemp("sharding") / "run.py"
    script.write_text(f"MESHES = {MESHES!r}\n" + SCRIPT)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_eight_devices(report):
    assert report["devices"] == 8


@pytest.mark.parametrize("mesh", [f"{d}x{m}" for d, m in MESHES])
def test_sharded_forward_equals_unsharded(report, mesh):
    assert report["logits_scale"] > 5  # not trivially small logits
    assert report[mesh]["logits_max_diff"] <= 1e-5


def test_sharded_sampler_greedy_equals_unsharded(report):
    r = report["2x4"]
    assert r["greedy_lengths"] == r["greedy_ref_lengths"]
    assert r["greedy_tokens"] == r["greedy_ref"]
    assert r["compactions"] >= 1
    assert r["prefix_shared"] and r["prefixed_tokens"] == r["prefixed_ref"]


@pytest.mark.parametrize("mesh", [f"{d}x{m}" for d, m in MESHES])
def test_big_matrices_are_split_over_model_axis(report, mesh):
    r = report[mesh]
    model = int(mesh.split("x")[1])
    specs, shard, full = r["specs"], r["shard_shapes"], r["full_shapes"]
    split_out = ["['layers']['wq']", "['layers']['wk']", "['layers']['wv']", "['layers']['w_gate']",
                 "['layers']['w_up']"]
    split_in = ["['layers']['wo']", "['layers']['w_down']"]
    for name in split_out:
        assert specs[name] == [None, None, "model"], name
        assert shard[name][2] * model == full[name][2] and shard[name][:2] == full[name][:2], name
    for name in split_in:
        assert specs[name] == [None, "model", None], name
        assert shard[name][1] * model == full[name][1], name
    for name in ("['layers']['bq']", "['layers']['bk']", "['layers']['bv']"):
        assert shard[name][1] * model == full[name][1], name
    for name in ("['final_norm']", "['layers']['attn_norm']", "['layers']['mlp_norm']"):  # replicated
        assert all(a is None for a in specs[name]) and shard[name] == full[name], name


def test_indivisible_dimension_stays_unsplit(report):
    """The vocabulary (322) divides over a model axis of 2 but not of 4: there it stays whole."""
    four, two = report["2x4"], report["4x2"]
    assert four["specs"]["['embed']"] == [None, None] and four["shard_shapes"]["['embed']"] == [322, 64]
    assert four["specs"]["['lm_head']"] == [None, None] and four["shard_shapes"]["['lm_head']"] == [64, 322]
    assert two["specs"]["['embed']"] == ["model", None] and two["shard_shapes"]["['embed']"] == [161, 64]
    assert two["specs"]["['lm_head']"] == [None, "model"] and two["shard_shapes"]["['lm_head']"] == [64, 161]


# --------------------------------------------------------------------------- in-process, one device

def test_param_spec_rules_and_fit():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    P = jax.sharding.PartitionSpec
    assert sharding.param_spec(("layers", "wq"), (2, 64, 64), mesh) == P(None, None, "model")
    assert sharding.param_spec(("layers", "w_down"), (2, 128, 64), mesh) == P(None, "model", None)
    assert sharding.param_spec(("embed",), (322, 64), mesh) == P("model", None)
    assert sharding.param_spec(("layers", "attn_norm"), (2, 64), mesh) == P(None, None)
    # Stacked adapters (slot axis in front) follow the same rule for their last axes.
    assert sharding.param_spec(("layers", "wq"), (3, 2, 64, 64), mesh) == P(None, None, None, "model")


def test_make_mesh_errors():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"needs {2 * n} devices, have {n}"):
        sharding.make_mesh(data=2 * n, model=1)
    with pytest.raises(ValueError, match="does not divide"):
        sharding.make_mesh(data=-1, model=n + 1)
    mesh = sharding.make_mesh()
    assert dict(mesh.shape) == {"data": n, "model": 1}
