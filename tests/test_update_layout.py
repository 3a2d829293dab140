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
from marl_jax.models import decoder
from marl_jax.rl.update import (Packed, UpdateConfig, init_state, item_positions, item_windows, length_ladder,
                                make_train_step, pack_batch, pack_rows, pack_shapes, pack_units, scored_positions,
                                share_units)
from test_update import CFG, LR, FakeRow, _assert_tree_close, _ref_grad, _setup, _whole_batch_grads

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
         metrics=True, seed=0, packing=False, share_prefix=0, remat="full", unroll=False, grid=2, budget=0):
    base, spec, tr = _setup(max(role_to_slot.values()) + 1, seed)
    groups = make_groups(roles, role_to_slot, copies)
    batch = make_batch(rows, np.asarray(advs, np.float32), role_to_slot=role_to_slot, num_slots=spec.num_slots,
                       groups=groups, micro_batch=micro_batch, sort_by_length=sort)
    tx = optim.per_slot(optax.sgd(LR))
    ucfg = UpdateConfig(micro_batch=micro_batch, length_buckets=buckets, head_chunk=head_chunk, dtype=dtype,
                        metrics=metrics, packing=packing, share_prefix=share_prefix, remat=remat,
                        unroll=unroll, length_grid=grid, max_tokens_per_micro_batch=budget)
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
    assert length_ladder(256, 4) == (64, 96, 128, 192, 256)
    assert length_ladder(192, 1) == (192,)
    assert length_ladder(128, 4) == (32, 48, 64, 96, 128)  # the same grid for every T
    assert length_ladder(100, 3) == (48, 64, 96, 100)  # the last is T
    assert length_ladder(256, 4, 4) == (64, 80, 96, 112, 128, 160, 192, 224, 256)  # 4 sizes per octave
    assert length_ladder(256, 4, 1) == (64, 128, 256)
    assert set(length_ladder(256, 4)) <= set(length_ladder(256, 4, 16))  # finer grids refine the default
    length = np.array([[60, 10, 0, 0, 130, 129, 3, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(item_windows(length, 4, 192, 3), [[64, 192, 0]])
    np.testing.assert_array_equal(item_windows(length, 4, 192, 1), [[192, 192, 0]])


def _shared_batch(seed, gen, judge):
    """Uneven gen / judge rows (gen, judge of them) laid out in one shared slot, micro-batches of 4."""
    rows = _uneven_rows(np.random.RandomState(seed), [("gen", gen, 1), ("judge", judge, 1)])
    groups = make_groups(["gen", "judge"], {"gen": 0, "judge": 0}, None)
    return rows, make_batch(rows, np.ones(len(rows), np.float32), role_to_slot={"gen": 0, "judge": 0}, num_slots=1,
                            groups=groups, micro_batch=4)


def test_rows_are_sorted_longest_first_within_each_group_and_kept_once():
    rows, b = _shared_batch(0, 7, 6)
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


@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layers_give_the_loops_step(remat):
    """grpo.unroll (the layers as straight-line code) computes the step the layer loop computes."""
    rng = np.random.RandomState(4)
    rows = _uneven_rows(rng, [("gen", 6, 3), ("judge", 4, 1)])
    advs = list(rng.randn(len(rows)))
    roles, r2s = ["gen", "judge"], {"gen": 0, "judge": 0}
    _assert_same_step(_run(rows, advs, roles, r2s, {"gen": 3}, sort=True, buckets=4, remat=remat),
                      _run(rows, advs, roles, r2s, {"gen": 3}, sort=True, buckets=4, remat=remat, unroll=True))


@pytest.mark.parametrize("packing", [False, True])
def test_a_finer_window_grid_computes_fewer_positions_and_the_same_step(packing):
    """grpo.length_grid=16 fits each micro-batch's window closer to its longest row: fewer positions, same step.
    Packed micro-batches fill sequences of the whole T, so their positions do not depend on the window grid."""
    rng = np.random.RandomState(6)
    rows = _uneven_rows(rng, [("gen", 8, 1), ("judge", 4, 1)])
    advs = list(rng.randn(len(rows)))
    roles, r2s = ["gen", "judge"], {"gen": 0, "judge": 0}
    coarse = _run(rows, advs, roles, r2s, None, sort=True, buckets=4, packing=packing)
    fine = _run(rows, advs, roles, r2s, None, sort=True, buckets=4, packing=packing, grid=16)
    fewer = item_positions(fine[2], 4, 4, packing, grid=16).sum() - item_positions(coarse[2], 4, 4, packing).sum()
    assert fewer == 0 if packing else fewer < 0, fewer
    _assert_same_step(coarse, fine)


def test_pack_rows_first_fit_decreasing_and_pack_shapes():
    seq, off, used = pack_rows([30, 0, 50, 20, 45], 64)
    # Longest first: 50 -> seq 0, 45 -> seq 1, 30 -> seq 2 (fits neither), 20 -> seq 2 at 30 (50 + 20 and 45 + 20 > 64).
    assert used == 3
    assert (seq[2], off[2]) == (0, 0) and (seq[4], off[4]) == (1, 0) and (seq[0], off[0]) == (2, 0)
    assert (seq[3], off[3]) == (2, 30)
    assert (seq[1], off[1]) == (0, 0)  # padding: nowhere
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([70], 64)
    # Sequences of the whole T, as many as the rows need on the grid: one program per count, whatever the rows.
    assert pack_shapes(128, 4) == ((1, 128), (2, 128), (3, 128), (4, 128))
    assert pack_shapes(64, 8) == ((1, 64), (2, 64), (3, 64), (4, 64), (6, 64), (8, 64))
    assert pack_shapes(64, 8, 1) == ((1, 64), (2, 64), (4, 64), (8, 64))


def test_rows_over_a_prompt_longer_than_half_of_T_share_it_in_sequences_of_2T():
    """A GRPO group of 8 rows over a 40-token prompt with 20-token completions (T=64): in sequences of T no two
    rows fit (nothing shared, 8 x 64 positions); in sequences of 2T the prompt is laid once per sequence, 4 rows
    over it in each (40 + 4 x 20 = 120 <= 128): 2 x 128 positions."""
    rng = np.random.RandomState(3)
    prompt = list(rng.randint(1, 64, 40))
    rows = [FakeRow(prompt, list(rng.randint(1, 64, 20)), [-1.0] * 20, "gen", 0) for _ in range(8)]
    groups = make_groups(["gen"], {"gen": 0}, None)
    b = make_batch(rows, np.ones(8, np.float32), role_to_slot={"gen": 0}, num_slots=1, groups=groups, micro_batch=8)
    T = b.tokens.shape[-1]
    assert T == 64 and pack_shapes(T, 8, share=True) == ((1, 128), (2, 128), (3, 128), (4, 128))
    pb = pack_batch(b, 8, share_prefix=16)
    assert (pb.pack_share[0] == 40).all() and sorted(np.bincount(pb.pack_seq[0])) == [4, 4]
    assert item_positions(pb, 8, 4, True, 16).sum() == 2 * 128
    assert item_positions(b, 8, 4, True).sum() == 8 * 64


def test_sequences_of_2T_hold_any_micro_batch_in_half_its_row_count():
    """pack_shapes(share=True) compiles at most ceil(mb / 2) sequences of 2T: first fit decreasing never needs
    more, whatever the rows' lengths and shared prefixes (pack_batch checks it on every micro-batch)."""
    rng = np.random.RandomState(5)
    for trial in range(40):
        rows = []
        for task in range(rng.randint(1, 5)):
            prompt = list(rng.randint(1, 64, rng.randint(1, 40)))
            for _ in range(rng.randint(1, 6)):
                n = rng.randint(1, 25)
                rows.append(FakeRow(prompt, list(rng.randint(1, 64, n)), [-1.0] * n, "gen", 0))
        groups = make_groups(["gen"], {"gen": 0}, None)
        b = make_batch(rows, np.ones(len(rows), np.float32), role_to_slot={"gen": 0}, num_slots=1, groups=groups,
                       micro_batch=8)
        pb = pack_batch(b, 8, share_prefix=rng.randint(1, 8))
        shapes = pack_shapes(b.tokens.shape[-1], 8, share=True)
        assert shapes[-1][0] == 4
        for m in range(b.length.shape[1] // 8):
            sl = slice(8 * m, 8 * m + 8)
            live = b.length[0, sl] > 0
            if live.any():
                p, _ = shapes[pb.pack_shape[0, 8 * m]]
                assert pb.pack_seq[0, sl][live].max() < p <= -(-int(live.sum()) // 2)


def test_packed_rows_do_not_overlap_and_use_fewer_positions():
    _, b = _shared_batch(6, 11, 7)
    T = b.tokens.shape[-1]
    pb = pack_batch(b, 4)
    shapes = pack_shapes(T, 4)
    for m in range(b.length.shape[1] // 4):
        sl = slice(4 * m, 4 * m + 4)
        p, t = shapes[pb.pack_shape[0, sl][0]]
        assert (pb.pack_shape[0, sl] == pb.pack_shape[0, 4 * m]).all()
        taken = np.zeros((p, t), int)
        for L_, s_, o_ in zip(b.length[0, sl], pb.pack_seq[0, sl], pb.pack_off[0, sl]):
            if L_:
                assert s_ < p and o_ + L_ <= t
                taken[s_, o_:o_ + L_] += 1
        assert taken.max() <= 1  # no two rows share a position
    packed, windows = item_positions(b, 4, 4, True), item_positions(b, 4, 4, False)
    assert packed.sum() < windows.sum() and ((packed > 0) == (windows > 0)).all()


def test_segments_keep_attention_within_rows():
    """A packed sequence's rows give the outputs of each row run alone, and changing one row's tokens
    changes no other row's outputs (the test fails if attention crosses a segment boundary)."""
    cfg, params = CFG, _setup(1)[0]
    rng = np.random.RandomState(7)
    a, b_, c = (list(rng.randint(1, 64, n)) for n in (7, 12, 5))
    packed = jnp.asarray([a + b_ + c + [0] * 4])
    seg = jnp.asarray([[1] * 7 + [2] * 12 + [3] * 5 + [0] * 4])
    out = decoder.forward(params, cfg, packed, segments=seg)
    at = {1: slice(0, 7), 2: slice(7, 19), 3: slice(19, 24)}
    for k, row in zip((1, 2, 3), (a, b_, c)):
        alone = decoder.forward(params, cfg, jnp.asarray([row]))
        np.testing.assert_allclose(out[0, at[k]], alone[0], rtol=1e-5, atol=1e-5)
    changed = decoder.forward(params, cfg, packed.at[0, 8].set((packed[0, 8] % 63) + 1), segments=seg)
    np.testing.assert_array_equal(np.asarray(changed[0, at[1]]), np.asarray(out[0, at[1]]))
    np.testing.assert_array_equal(np.asarray(changed[0, at[3]]), np.asarray(out[0, at[3]]))
    assert not np.allclose(changed[0, at[2]][1:], out[0, at[2]][1:])  # the changed row itself does change
    # One segment id over two rows would let them attend to each other: the outputs differ.
    merged = decoder.forward(params, cfg, packed, segments=seg.at[0, 7:19].set(1))
    assert not np.allclose(merged[0, at[2]], out[0, at[2]], atol=1e-4)


def test_share_units_and_their_packing_by_hand():
    pre = [5, 6, 7, 8, 9, 10]
    tokens = np.zeros((5, 12), np.int32)
    rows = [pre + [1, 2], pre[:4] + [3, 3, 3, 3, 3], pre + [4], [9, 9, 9], pre + [2, 2, 2]]
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    lens = np.array([len(r) for r in rows])
    # Rows 0, 2 and 4 share 6 tokens (2 x 6 = 12 saved); row 1 shares only 4 with them: one unit of all four
    # would save 3 x 4 = 12 too, and ties go to the smaller units. Units come longest first (rows 1 and 4: 9).
    assert share_units(tokens, lens, 3) == [([1], 0), ([4, 0, 2], 6), ([3], 0)]
    assert share_units(tokens, lens, 5) == [([1], 0), ([4, 0, 2], 6), ([3], 0)]
    assert share_units(tokens, lens, 7) == [([1], 0), ([4], 0), ([0], 0), ([2], 0), ([3], 0)]
    where, used = pack_units(share_units(tokens, lens, 5), lens, 16)
    # unit (4, 0, 2) over one prefix copy: 6 + 3 + 2 + 1 = 12 tokens in sequence 0; row 1 (9) in sequence 1;
    # row 3 (3) fits after the unit in sequence 0.
    assert used == 2
    assert where[4] == (0, 0, 0, 6) and where[0] == (0, 0, 3 - 6 + 6, 6) and where[2] == (0, 0, 5, 6)
    assert where[1] == (1, 0, 0, 0) and where[3] == (0, 12, 12, 0)
    # a unit longer than a sequence splits, each part with its own prefix copy
    where, used = pack_units([([4, 0, 2], 6)], lens, 10)  # 6 + 3 + 2 + 1 = 12 > 10: row 4 alone, 0 and 2 share
    assert used == 2 and where[4] == (0, 0, 0, 0) and where[0] == (1, 0, 0, 6) and where[2] == (1, 0, 2, 6)


def test_share_units_keeps_groups_under_a_common_template_head():
    """A GRPO batch: two groups of three completions, each group over its own 6-token prompt, every prompt
    after the same 3-token template head. One unit over the head would save 5 x 3 = 15 tokens; a unit per
    group saves 2 x 2 x 6 = 24, and within a group two completions that share one more token do not split it
    (2 x 6 = 12 > 1 x 7 + 0)."""
    head, pa, pb = [1, 2, 3], [1, 2, 3, 10, 11, 12], [1, 2, 3, 20, 21, 22]
    rows = [pa + [30, 31], pa + [30, 32, 33], pa + [40], pb + [50, 51, 52, 53], pb + [60], pb + [61, 62]]
    tokens = np.zeros((6, 10), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    lens = np.array([len(r) for r in rows])
    assert all(r[:3] == head for r in rows)
    units = share_units(tokens, lens, 3)
    assert units == [([3, 5, 4], 6), ([1, 0, 2], 6)]
    saved = sum((len(u) - 1) * c for u, c in units)
    assert saved == 24
    # above the prompts' length only rows 0 and 1 (7 tokens in common) share; above that nothing does
    assert [u for u in share_units(tokens, lens, 7) if u[1]] == [([1, 0], 7)]
    assert all(c == 0 for _, c in share_units(tokens, lens, 8))


def test_shared_prefix_layout_gives_each_rows_outputs_and_never_crosses_rows():
    """Two rows over one copy of their common prefix, a third alone: each row's outputs are those of the
    row run alone; changing one row's own tokens changes no other row; without the parent link they differ."""
    cfg, params = CFG, _setup(1)[0]
    rng = np.random.RandomState(3)
    P_, a, b_, c = (list(rng.randint(1, 64, n)) for n in (9, 5, 7, 6))
    packed = jnp.asarray([P_ + a + b_ + c + [0] * 3])
    seg = jnp.asarray([[9] * 9 + [1] * 5 + [2] * 7 + [3] * 6 + [0] * 3])
    par = jnp.asarray([[0] * 9 + [9] * 12 + [0] * 9])
    pos = jnp.asarray([list(range(9)) + list(range(9, 14)) + list(range(9, 16)) + list(range(6)) + [0] * 3])
    out = decoder.forward(params, cfg, packed, segments=(seg, par, pos))
    at = {"a": np.r_[0:9, 9:14], "b": np.r_[0:9, 14:21], "c": np.r_[21:27]}
    for k, row in (("a", P_ + a), ("b", P_ + b_), ("c", c)):
        alone = decoder.forward(params, cfg, jnp.asarray([row]))
        np.testing.assert_allclose(out[0, at[k]], alone[0], rtol=1e-5, atol=1e-5)
    changed = decoder.forward(params, cfg, packed.at[0, 16].set((packed[0, 16] % 63) + 1), segments=(seg, par, pos))
    np.testing.assert_array_equal(np.asarray(changed[0, at["a"]]), np.asarray(out[0, at["a"]]))
    np.testing.assert_array_equal(np.asarray(changed[0, at["c"]]), np.asarray(out[0, at["c"]]))
    assert not np.allclose(changed[0, 17:21], out[0, 17:21])
    # b attending to a's tokens (one segment for both) or not to the prefix (no parent): outputs differ
    merged = decoder.forward(params, cfg, packed, segments=(seg.at[0, 14:21].set(1), par, pos))
    assert not np.allclose(merged[0, 14:21], out[0, 14:21], atol=1e-4)
    orphan = decoder.forward(params, cfg, packed, segments=(seg, par.at[0, 14:21].set(0), pos))
    assert not np.allclose(orphan[0, 14:21], out[0, 14:21], atol=1e-4)


def _prefix_rows(rng):
    """A task's episodes share its prompt; the roles' instructions are shared across tasks."""
    rows = []
    for role, instr_len in (("gen", 12), ("judge", 20)):
        instr = list(rng.randint(1, 64, instr_len))
        for task in range(3):
            prompt = instr + list(rng.randint(1, 64, rng.randint(3, 15)))
            for ep in range(3):
                c = list(rng.randint(1, 64, rng.randint(1, 16)))
                rows.append(FakeRow(prompt, c, list(-rng.uniform(0.5, 4.0, len(c))), role, ep % 3 if role == "gen" else 0))
    return rows


@pytest.mark.parametrize("r2s", [{"gen": 0, "judge": 0}, {"gen": 0, "judge": 1}], ids=["shared", "isolated"])
def test_shared_prefix_packing_gives_the_plain_layouts_step(r2s):
    """Rows laid over shared prefix copies: the same loss, gradients and per-role diagnostics as the plain
    layout, from fewer computed positions."""
    rng = np.random.RandomState(11)
    rows = _prefix_rows(rng)
    advs = list(rng.randn(len(rows)))
    roles, copies = ["gen", "judge"], {"gen": 3}
    plain = _run(rows, advs, roles, r2s, copies, sort=False, buckets=1)
    shared = _run(rows, advs, roles, r2s, copies, sort=True, buckets=3, packing=True, share_prefix=4)
    b = pack_batch(shared[2], 4, share_prefix=4)
    assert (b.pack_share > 0).sum() >= 12, "most rows must read a shared prefix"
    assert item_positions(b, 4, 3, True, 4).sum() < item_positions(shared[2], 4, 3, True).sum()
    _assert_same_step(plain, shared)
    with pytest.raises(ValueError, match="packing=True"):
        UpdateConfig(share_prefix=4)


@pytest.mark.parametrize("r2s", [{"gen": 0, "judge": 0}, {"gen": 0, "judge": 1}], ids=["shared", "isolated"])
def test_packed_micro_batches_give_the_plain_layouts_step(r2s):
    rng = np.random.RandomState(8)
    rows = _uneven_rows(rng, [("gen", 9, 3), ("judge", 6, 1)])
    advs = list(rng.randn(len(rows)))
    roles, copies = ["gen", "judge"], {"gen": 3}
    plain = _run(rows, advs, roles, r2s, copies, sort=False, buckets=1)
    packed = _run(rows, advs, roles, r2s, copies, sort=True, buckets=3, packing=True)
    b = pack_batch(packed[2], 4)
    used = {pack_shapes(b.tokens.shape[-1], 4)[k][0] for k in np.unique(b.pack_shape[b.length > 0])}
    assert min(used) < 4, "some micro-batch must be packed into fewer sequences than rows"
    # Packed items score only their completion tokens in the LM head (update.scored_positions), not every
    # row's window: some item here must take that path for the comparison to cover it.
    from marl_jax.rl.layout import plan_items
    W, mask = b.targets.shape[-1], np.asarray(b.loss_mask)
    gathered = [scored_positions(mask[it.slot][it.rows][:, :min(W, it.shape.t)], it.positions)
                for it in plan_items(b, micro_batch=4, length_buckets=3, packing=True) if isinstance(it.shape, Packed)]
    assert any(g is not None for g in gathered)
    _assert_same_step(plain, packed)


def test_scored_positions_are_the_masked_positions_padded_past_the_end():
    mask = np.array([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    np.testing.assert_array_equal(scored_positions(mask, 6), [1, 2, 4, 12, 12, 12])
    assert scored_positions(mask, 12) is None  # the whole window: nothing saved
    assert scored_positions(mask, 2) is None  # would not fit: the item keeps its window


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
    # Qwen3-1.7B-shaped, 4 rows, LoRA r64, a 40 GiB budget, memory-bounded attention above 512 tokens (CPU:
    # blockwise): keep all up to 1024 tokens (~32 GiB), matmul outputs at 2048, recompute layers at 4096.
    modes = [remat_for(big, 4, t, 128, 40 * gib, rank=64, backend="cpu") for t in (256, 1024, 2048, 4096)]
    assert modes == ["none", "none", "dots", "full"]
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


def test_trainer_with_packing_takes_the_same_first_step(prompt_dir, tmp_path):
    """grpo.packing and grpo.share_prefix reach the trainer's update: one step of the tiny voting run, packed
    (over shared prefixes or not) and not, from the same rollout, gives the same loss and updated weights."""
    from marl_jax.models.tiny import tiny_model
    from marl_jax.train.loop import Trainer
    from test_learning import digit_tasks, learning_config, tiny_tokenizer

    out = []
    for packing, share in ((False, 0), (True, 0), (True, 4)):
        c = learning_config("isolated", prompt_dir)
        c.num_tasks, c.rollout.group_size = 4, 4
        c.task.update(size=40, val_size=4)
        c.grpo.update(micro_batch=4, packing=packing, share_prefix=share)
        c.train.update(steps=1, val_every=10, ckpt_every=10, warmup=False)
        t = Trainer(c, str(tmp_path / f"{packing}-{share}"), model=tiny_model(tiny_tokenizer(), seed=1),
                    tasks=digit_tasks(44), progress=False)
        assert (t.ucfg.packing, t.ucfg.share_prefix) == (packing, share)
        rec = t.train_step(0)
        out.append((rec["loss"], t.state.trainable))
    for o in out[1:]:
        np.testing.assert_allclose(out[0][0], o[0], rtol=1e-5)
        _assert_tree_close(out[0][1], o[1], atol=1e-6, rtol=1e-5)


def test_share_prefix_config_needs_packing():
    from marl_jax.config import base_config, validate

    c = base_config("voting", ("generator", "aggregator"))
    c.grpo.share_prefix = 16
    with pytest.raises(ValueError, match="share_prefix=16 .* add --config.grpo.packing=true"):
        validate(c)
    c.grpo.packing = True
    validate(c)
    c.grpo.share_prefix = -1
    with pytest.raises(ValueError, match="share_prefix must be >= 0"):
        validate(c)


@pytest.mark.parametrize("layout,r2s", [
    (dict(buckets=4), {"gen": 0, "judge": 0}),
    (dict(buckets=3, packing=True, share_prefix=3), {"gen": 0, "judge": 1}),
    (dict(buckets=1, packing=True, share_prefix=3, budget=100), {"gen": 0, "judge": 0})],
    ids=["windows", "packed-shared-isolated", "budget-packed-shared"])
def test_the_item_by_item_step_is_the_gradient_of_the_whole_batch_loss(layout, r2s):
    """Item by item (windows, packed rows over shared prefixes, token-budget items) against a plain jax.grad of
    each slot's loss over all its rows at once, written in the test (test_update._whole_batch_grads): the same
    slot gradients, loss, per-role gradient norms, and every row's tokens counted once in the role stats."""
    rng = np.random.RandomState(5)
    rows = _uneven_rows(rng, [("gen", 9, 3), ("judge", 6, 1)])
    for r in rows[1:4]:  # a task's episodes share their prompt
        r.prompt_tokens = list(rows[0].prompt_tokens)
    advs = list(rng.randn(len(rows)))
    roles = ["gen", "judge"]
    grads, m, _, _ = _run(rows, advs, roles, r2s, {"gen": 3}, sort=True, **layout)
    base, spec, tr = _setup(max(r2s.values()) + 1, 0)
    ref, per_role, logps = _whole_batch_grads(base, spec, tr, rows, advs, r2s, roles)
    for slot, (loss, g) in ref.items():
        _assert_tree_close(jax.tree_util.tree_map(lambda x: x[slot], grads), g)
        np.testing.assert_allclose(float(m["loss_per_slot"][slot]), loss, rtol=1e-5, atol=1e-6)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])
    for k, role in enumerate(roles):
        np.testing.assert_allclose(float(m["role_grad_norm"][k]), np.linalg.norm(flat(per_role[role])), rtol=1e-4)
        st = {key: float(v[k]) for key, v in m["role_stats"].items()}
        mine = [r for r in rows if r.role == role]
        assert st["rows"] == len(mine) and st["tokens"] == sum(len(r.completion_tokens) for r in mine)
        gap = sum(np.abs(lp - np.asarray(r.logprobs)).sum() for lp, r in zip(logps[role], mine))
        np.testing.assert_allclose(st["logp_gap_abs"], gap, rtol=1e-5)
    assert int(m["misaligned_rows"]) == 0


def test_item_programs_compile_once_per_item_shape_across_batches():
    """Batches of other row counts and padded lengths reuse the item programs of the shapes they share: a
    step of an RL run compiles only for item shapes no earlier step had."""
    base, spec, tr = _setup(1, 0)
    roles, r2s = ["gen", "judge"], {"gen": 0, "judge": 0}
    groups = make_groups(roles, r2s, None)
    tx = optim.per_slot(optax.sgd(LR))
    step = make_train_step(CFG, spec, UpdateConfig(micro_batch=4, length_buckets=2), tx, num_groups=len(groups.names),
                           group_slot=groups.slot, group_role=[0, 1], num_roles=2, role_slot=[0, 0])
    state = init_state(jax.tree_util.tree_map(jnp.array, tr), tx)
    row = lambda role, p, c: FakeRow(list(range(1, p + 1)), list(range(1, c + 1)), [-1.0] * c, role, 0)
    # 8 rows, every item over a window of 32 tokens, vs 12 rows with one item over 64: a program over the whole
    # batch would compile twice over (other rows, other packed shapes); the 32-token item program is reused.
    a = [row("gen", 10, 8)] * 4 + [row("judge", 12, 6)] * 4
    b = [row("gen", 9, 7)] * 4 + [row("judge", 11, 9)] * 4 + [row("gen", 40, 10)] * 4
    seen = []
    for rows in (a, b):
        batch = make_batch(rows, np.ones(len(rows), np.float32), role_to_slot=r2s, num_slots=1, groups=groups,
                           micro_batch=4)
        state, _ = step(state, base, batch)
        seen.append(step.item_programs())
    assert seen[0] == 1 and seen[1] == 2, seen


def test_the_sampling_limit_as_width_keeps_one_steps_programs_for_the_next():
    """make_batch(width=the sampling limit): a step whose completions all stop early has the same W and T as
    one whose longest completion hit the limit, so it reuses that step's item programs (without width it
    compiles its own), and the padding changes nothing: the same update either way."""
    base, spec, tr = _setup(1, 0)
    roles, r2s = ["gen", "judge"], {"gen": 0, "judge": 0}
    groups = make_groups(roles, r2s, None)
    tx = optim.per_slot(optax.sgd(LR))
    make = lambda: make_train_step(CFG, spec, UpdateConfig(micro_batch=4, length_buckets=2), tx,
                                   num_groups=len(groups.names), group_slot=groups.slot, group_role=[0, 1],
                                   num_roles=2, role_slot=[0, 0])
    state = lambda: init_state(jax.tree_util.tree_map(jnp.array, tr), tx)  # a step donates its state
    row = lambda role, p, c: FakeRow(list(range(1, p + 1)), list(range(3, c + 3)), [-1.0] * c, role, 0)
    limit = 48
    full = [row("gen", 20, limit)] * 4 + [row("judge", 22, 30)] * 4
    early = [row("gen", 40, 30)] * 4 + [row("judge", 30, 28)] * 4  # rows in the same token windows (96, 64)
    batch = lambda rows, width: make_batch(rows, np.linspace(-1, 1, len(rows)).astype(np.float32), role_to_slot=r2s,
                                           num_slots=1, groups=groups, micro_batch=4, width=width)
    b_full, b_early, b_plain = batch(full, limit), batch(early, limit), batch(early, None)
    assert b_early.targets.shape == b_full.targets.shape and b_early.tokens.shape == b_full.tokens.shape
    assert b_plain.targets.shape[-1] < b_early.targets.shape[-1]
    step = make()
    step(state(), base, b_full)
    n = step.item_programs()
    after_early, _ = step(state(), base, b_early)
    assert step.item_programs() == n  # nothing compiled for the early-stopping step
    plain = make()
    after_plain, _ = plain(state(), base, b_plain)
    assert plain.item_programs() >= 1
    for a, b in zip(jax.tree_util.tree_leaves(after_early.trainable), jax.tree_util.tree_leaves(after_plain.trainable)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
