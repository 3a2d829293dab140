"""Length-aware layout of the update: rows sorted by length within each diagnostic group, each micro-batch
run over a token window that just holds its longest row, the LM head in chunks of positions. All of it must
leave the loss, the gradients and the per-role diagnostics as the plain layout (every row in its given
order, every micro-batch over the whole padded length) gives them, and the plain layout is checked
against a per-row reference in tests/test_update.py."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.rl import loss as L
from marl_jax.rl import optim
from marl_jax.rl.batch import make_batch, make_groups
from marl_jax.rl.update import UpdateConfig, init_state, item_windows, length_ladder, make_train_step
from test_update import CFG, LR, FakeRow, _assert_tree_close, _ref_grad, _setup

import optax


def _uneven_rows(rng, spec):
    """Rows of very different lengths: (role, count, copies) with prompts of 2-40 and completions of 1-20 tokens."""
    rows = []
    for role, n, copies in spec:
        for i in range(n):
            p = list(rng.randint(1, 64, rng.randint(2, 41)))
            c = list(rng.randint(1, 64, rng.randint(1, 21)))
            rows.append(FakeRow(p, c, list(-rng.uniform(0.5, 4.0, len(c))), role, i % copies))
    return rows


def _run(rows, advs, roles, role_to_slot, copies, *, sort, buckets, micro_batch=4, head_chunk=0, dtype=jnp.float32,
         metrics=True, seed=0):
    base, spec, tr = _setup(max(role_to_slot.values()) + 1, seed)
    groups = make_groups(roles, role_to_slot, copies)
    batch = make_batch(rows, np.asarray(advs, np.float32), role_to_slot=role_to_slot, num_slots=spec.num_slots,
                       groups=groups, micro_batch=micro_batch, sort_by_length=sort)
    tx = optim.per_slot(optax.sgd(LR))
    ucfg = UpdateConfig(micro_batch=micro_batch, length_buckets=buckets, head_chunk=head_chunk, dtype=dtype,
                        metrics=metrics)
    step = make_train_step(CFG, spec, ucfg, tx, num_groups=len(groups.names), group_slot=groups.slot,
                           group_role=[roles.index(r) for r in groups.role], num_roles=len(roles),
                           role_slot=[role_to_slot[r] for r in roles])
    new, m = step(init_state(jax.tree_util.tree_map(jnp.array, tr), tx), base, jax.tree_util.tree_map(jnp.asarray, batch))
    grads = jax.tree_util.tree_map(lambda a, b: (b - a) / LR, new.trainable, tr)
    return grads, m, batch, new


DIAG_KEYS = ("loss", "loss_per_slot", "role_grad_norm", "role_grad_share", "role_grad_norm_share", "role_grad_cos",
             "role_copy_alignment", "group_grad_norm", "slot_grad_norm")


def _assert_same_step(a, b):
    ga, ma = a[0], a[1]
    gb, mb = b[0], b[1]
    _assert_tree_close(ga, gb, atol=1e-5, rtol=1e-5)
    for k in DIAG_KEYS:
        np.testing.assert_allclose(np.asarray(ma[k]), np.asarray(mb[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for k in ma["role_stats"]:
        np.testing.assert_allclose(np.asarray(ma["role_stats"][k]), np.asarray(mb["role_stats"][k]), rtol=1e-5,
                                   atol=1e-5, err_msg=k)


def test_length_ladder_and_item_windows():
    assert length_ladder(256, 4) == (64, 128, 192, 256)
    assert length_ladder(192, 1) == (192,)
    assert length_ladder(100, 3) == (40, 72, 100)  # multiples of 8, the last is T
    length = np.array([[60, 10, 0, 0, 130, 129, 3, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(item_windows(length, 4, 192, 3), [[64, 192, 0]])
    np.testing.assert_array_equal(item_windows(length, 4, 192, 1), [[192, 192, 0]])


def test_rows_are_sorted_longest_first_within_each_group_and_kept_once():
    rng = np.random.RandomState(0)
    rows = _uneven_rows(rng, [("gen", 7, 1), ("judge", 6, 1)])
    groups = make_groups(["gen", "judge"], {"gen": 0, "judge": 0}, None)
    b = make_batch(rows, np.ones(len(rows), np.float32), role_to_slot={"gen": 0, "judge": 0}, num_slots=1,
                   groups=groups, micro_batch=4)
    for g in (0, 1):
        lens = b.length[0][b.group[0] == g]
        assert list(lens) == sorted(lens, reverse=True)
        want = sorted(len(r.prompt_tokens) + len(r.completion_tokens) for r in rows if r.role == ("gen", "judge")[g])
        assert sorted(lens) == want
    np.testing.assert_array_equal(b.length[0], b.valid[0].sum(-1))
    # Tight micro-batches: the windows sum to less than running every micro-batch over the whole T.
    T = b.tokens.shape[-1]
    win = item_windows(b.length, 4, T, 4)
    assert 0 < win.sum() < (win > 0).sum() * T


@pytest.mark.parametrize("copies", [None, {"gen": 3}])
def test_sorted_rows_and_token_windows_give_the_plain_layouts_step(copies):
    rng = np.random.RandomState(1)
    rows = _uneven_rows(rng, [("gen", 9, 3), ("judge", 6, 1)])
    advs = list(rng.randn(len(rows)))
    roles, r2s = ["gen", "judge"], {"gen": 0, "judge": 0}
    plain = _run(rows, advs, roles, r2s, copies, sort=False, buckets=1)
    fast = _run(rows, advs, roles, r2s, copies, sort=True, buckets=4)
    assert sorted(set(item_windows(fast[2].length, 4, fast[2].tokens.shape[-1], 4).ravel()) - {0}) != [
        fast[2].tokens.shape[-1]], "the rows must exercise windows shorter than T"
    _assert_same_step(plain, fast)
    # And both are the gradient of the mean of the per-row losses, computed row by row.
    base, spec, tr = _setup(1)
    _assert_tree_close(jax.tree_util.tree_map(lambda x: x[0], fast[0]), _ref_grad(base, spec, tr, 0, rows, advs))


def test_isolated_slots_with_token_windows_equal_the_plain_layout():
    rng = np.random.RandomState(2)
    rows = _uneven_rows(rng, [("gen", 6, 1), ("judge", 5, 1)])
    advs = list(rng.randn(len(rows)))
    roles, r2s = ["gen", "judge"], {"gen": 0, "judge": 1}
    _assert_same_step(_run(rows, advs, roles, r2s, None, sort=False, buckets=1),
                      _run(rows, advs, roles, r2s, None, sort=True, buckets=3))


def test_head_in_chunks_of_positions_equals_the_whole_window():
    rng = np.random.RandomState(3)
    rows = _uneven_rows(rng, [("gen", 6, 1), ("judge", 4, 1)])
    advs = list(rng.randn(len(rows)))
    roles, r2s = ["gen", "judge"], {"gen": 0, "judge": 0}
    _assert_same_step(_run(rows, advs, roles, r2s, None, sort=True, buckets=2),
                      _run(rows, advs, roles, r2s, None, sort=True, buckets=2, head_chunk=3))


def test_head_logprobs_chunks_match_log_softmax_and_entropy():
    key = jax.random.PRNGKey(0)
    h = jax.random.normal(key, (3, 11, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 50))
    tg = jax.random.randint(jax.random.PRNGKey(2), (3, 11), 0, 50)
    head = lambda x: x @ w
    logp_ref = jnp.take_along_axis(jax.nn.log_softmax(head(h), -1), tg[..., None], -1)[..., 0]
    p = jax.nn.softmax(head(h), -1)
    ent_ref = -jnp.sum(p * jnp.log(p), -1)
    for chunk in (None, 4, 11, 64):
        lp, ent = L.head_logprobs(head, h, tg, entropy=True, chunk=chunk)
        np.testing.assert_allclose(lp, logp_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ent, ent_ref, rtol=1e-5, atol=1e-5)
    g_ref = jax.grad(lambda x: jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(head(x), -1), tg[..., None], -1)))(h)
    g = jax.grad(lambda x: jnp.sum(L.head_logprobs(head, x, tg, chunk=4)[0]))(h)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_keeps_adapters_gradients_and_optimizer_in_float32():
    rng = np.random.RandomState(4)
    rows = _uneven_rows(rng, [("gen", 5, 1)])
    advs = list(rng.randn(len(rows)))
    f32 = _run(rows, advs, ["gen"], {"gen": 0}, None, sort=True, buckets=2)
    bf16 = _run(rows, advs, ["gen"], {"gen": 0}, None, sort=True, buckets=2, dtype=jnp.bfloat16)
    for leaf in jax.tree_util.tree_leaves((bf16[3].trainable, bf16[3].opt_state, bf16[0])):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32, leaf.dtype
    # The same step up to bfloat16 rounding of the activations.
    np.testing.assert_allclose(float(bf16[1]["loss"]), float(f32[1]["loss"]), rtol=0.05, atol=1e-3)
    a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(f32[0])])
    b = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(bf16[0])])
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.98


def test_bad_length_buckets_and_head_chunk_are_refused():
    with pytest.raises(ValueError, match="length_buckets"):
        UpdateConfig(length_buckets=0)
    with pytest.raises(ValueError, match="head_chunk"):
        UpdateConfig(head_chunk=-1)


def test_remat_auto_keeps_activations_of_short_windows_and_recomputes_long_ones():
    from marl_jax.rl.update import remat_for
    from marl_jax.models.decoder import ModelConfig
    big = ModelConfig(family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                      num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True)
    gib = 2 ** 30
    # Qwen3-1.7B-shaped, 4 rows, LoRA r64, a 40 GiB budget: keep all at 256 tokens, matmul outputs at 1024,
    # recompute layers from 2048 (every layer's activations at 1024 tokens are ~30 GB).
    modes = [remat_for(big, 4, t, 128, 40 * gib, rank=64) for t in (256, 1024, 2048, 4096)]
    assert modes == ["none", "dots", "full", "full"]
    assert remat_for(big, 4, 256, 128, 400 * gib, rank=64) == "none"
    # Recomputation changes no value: the auto step equals the keep-everything step.
    rng = np.random.RandomState(5)
    rows = _uneven_rows(rng, [("gen", 6, 1)])
    advs = list(rng.randn(len(rows)))
    base, spec, tr = _setup(1)
    groups = make_groups(["gen"], {"gen": 0}, None)
    batch = jax.tree_util.tree_map(jnp.asarray, make_batch(rows, np.asarray(advs, np.float32), role_to_slot={"gen": 0},
                                                          num_slots=1, groups=groups, micro_batch=4))
    out = []
    for remat, budget in (("none", 4.0), ("auto", 1e-6)):  # a tiny budget: every window recomputes ("full")
        tx = optim.per_slot(optax.sgd(LR))
        step = make_train_step(CFG, spec, UpdateConfig(micro_batch=4, remat=remat, remat_budget_gb=budget), tx,
                               num_groups=1, group_slot=(0,), group_role=[0], num_roles=1, role_slot=[0])
        out.append(step(init_state(jax.tree_util.tree_map(jnp.array, tr), tx), base, batch))
    _assert_tree_close(out[0][0].trainable, out[1][0].trainable, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="remat"):
        UpdateConfig(remat="sometimes")
