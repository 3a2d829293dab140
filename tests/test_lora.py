"""Trainable slots: LoRA starts equal to the base model, slots route independently, merging is exact."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.models import decoder
from marl_jax.policy.lora import PolicySpec, init_trainable, merge_lora, parse_targets, slot_params
from marl_jax.policy.slots import num_slots, role_to_slot

CFG = decoder.ModelConfig(family="llama", vocab_size=50, hidden_size=32, intermediate_size=40, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4)
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, 50, (2, 9)))


@pytest.fixture(scope="module")
def base():
    return decoder.init_params(CFG, jax.random.PRNGKey(0))


def _logits(base, spec, tr, slot):
    params, lora = slot_params(spec, base, tr, slot)
    return decoder.forward(params, CFG, TOKENS, lora=lora, lora_scale=spec.scale)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_every_slot_starts_equal_to_the_base_model(base, mode):
    spec = PolicySpec(mode=mode, rank=4, alpha=8.0, num_slots=3)
    tr = init_trainable(spec, CFG, base, jax.random.PRNGKey(1))
    ref = decoder.forward(base, CFG, TOKENS)
    for s in range(3):
        np.testing.assert_allclose(np.asarray(_logits(base, spec, tr, s)), np.asarray(ref), atol=1e-6)
    lead = {x.shape[0] for x in jax.tree_util.tree_leaves(tr)}
    assert lead == {3}


def test_slots_are_independent_and_merge_is_exact(base):
    spec = PolicySpec(rank=4, alpha=8.0, num_slots=2, targets=("q_proj", "w_down"))
    tr = init_trainable(spec, CFG, base, jax.random.PRNGKey(1))
    assert sorted(tr) == ["w_down", "wq"]
    tr["wq"]["b"] = tr["wq"]["b"].at[1].set(0.3 * jax.random.normal(jax.random.PRNGKey(2), tr["wq"]["b"].shape[1:]))
    ref = decoder.forward(base, CFG, TOKENS)
    np.testing.assert_allclose(np.asarray(_logits(base, spec, tr, 0)), np.asarray(ref), atol=1e-6)
    changed = _logits(base, spec, tr, 1)
    assert float(jnp.abs(changed - ref).max()) > 1e-3
    # Folding slot 1's adapters into the weights computes the same function (export path).
    merged = merge_lora(spec, base, tr, 1)
    np.testing.assert_allclose(np.asarray(decoder.forward(merged, CFG, TOKENS)), np.asarray(changed), atol=1e-5)
    # By hand for one layer's q projection: W + scale * A @ B.
    want = base["layers"]["wq"][0] + spec.scale * tr["wq"]["a"][1, 0] @ tr["wq"]["b"][1, 0]
    np.testing.assert_allclose(np.asarray(merged["layers"]["wq"][0]), np.asarray(want), atol=1e-6)


def test_bad_specs_name_the_fix():
    with pytest.raises(ValueError, match="choose from"):
        PolicySpec(targets=("qkv",))
    with pytest.raises(ValueError, match="'lora' or 'full'"):
        PolicySpec(mode="adapter")
    with pytest.raises(ValueError, match="rank"):
        PolicySpec(rank=0)
    assert parse_targets("all") == decoder.LINEAR_NAMES
    assert parse_targets("q_proj, v_proj") == ("q_proj", "v_proj")


def test_role_to_slot_shared_and_isolated():
    roles = ["orchestrator", "worker", "synthesizer"]
    assert role_to_slot(roles, "shared") == {r: 0 for r in roles}
    assert role_to_slot(roles, "isolated") == {"orchestrator": 0, "worker": 1, "synthesizer": 2}
    assert num_slots(roles, "SP") == 1 and num_slots(roles, "IP") == 3
    with pytest.raises(ValueError, match="shared, isolated"):
        role_to_slot(roles, "separate")
