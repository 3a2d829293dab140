"""Token-budget micro-batches (UpdateConfig.max_tokens_per_micro_batch, grpo.max_tokens_per_micro_batch): the
split on hand-worked lengths, the same step as fixed micro-batches of rows, few compiled item shapes, a clear
error for a bad value, and an LM head that never holds a whole item's float32 logits."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marl_jax.models import decoder
from marl_jax.policy.lora import PolicySpec, init_trainable
from marl_jax.rl import layout
from marl_jax.rl import optim
from marl_jax.rl import update as U
from marl_jax.rl.batch import make_batch, make_groups
from marl_jax.rl.layout import Packed, Window
from marl_jax.rl.update import UpdateConfig, init_state, make_train_step
from test_update import CFG, LR, FakeRow, _assert_tree_close, _setup


def _live(it):
    return it.rows[it.rows >= 0]


def test_the_long_row_runs_alone_and_short_rows_fill_micro_batches_to_the_budget():
    lens = np.array([[30000] + [500] * 60 + [0] * 3])
    w, g = (lens > 0).astype(np.float32), np.where(lens > 0, 0, -1)
    items = layout.budget_items(lens, w, g, budget=32768, T=32768, W=1024)
    assert [(list(_live(it)), it.shape) for it in items[:1]] == [([0], Window(32768))]
    # 500 tokens run over a 512 window: 64 rows fit 32768 positions, so all sixty share one micro-batch
    # (padded to 64 rows, the grid size that holds them).
    assert len(items) == 2 and items[1].shape == Window(512) and len(items[1].rows) == 64
    assert sorted(_live(items[1])) == list(range(1, 61))
    assert all(it.positions <= 32768 for it in items)
    # Two hundred short rows: full micro-batches of 64 (64 x 512 = the budget), then the 8 left.
    lens = np.array([[30000] + [500] * 200])
    items = layout.budget_items(lens, np.ones(lens.shape, np.float32), np.zeros(lens.shape, int), budget=32768,
                                T=32768, W=1024)
    assert [len(_live(it)) for it in items] == [1, 64, 64, 64, 8]
    assert [it.positions for it in items] == [32768] * 4 + [8 * 512]
    # A row whose window (32768) is over the budget runs alone, over its window.
    items = layout.budget_items(lens[:, :3], np.ones((1, 3), np.float32), np.zeros((1, 3), int), budget=16384,
                                T=32768, W=1024)
    assert [(list(_live(it)), it.shape) for it in items] == [([0], Window(32768)), ([1, 2], Window(512))]
    # Packed: the long row's sequence takes short rows after it; the rest pack 64 sequences of 512.
    items = layout.budget_items(lens, np.ones(lens.shape, np.float32), np.zeros(lens.shape, int), budget=32768,
                                T=32768, W=256, packing=True)
    assert items[0].shape == Packed(1, 32768) and len(_live(items[0])) == 1 + (32768 - 30000) // 500
    assert all(it.positions <= 32768 for it in items)
    assert sorted(np.concatenate([_live(it) for it in items])) == list(range(201))


def test_grid_sizes():
    assert [layout.grid_size(n) for n in (0, 1, 2, 3, 4, 5, 7, 9, 13, 33, 60, 65)] == [1, 1, 2, 3, 4, 6, 8, 12, 16,
                                                                                       48, 64, 96]
    assert [layout.grid_size(n, 1) for n in (3, 5, 9)] == [4, 8, 16]


@pytest.mark.parametrize("packing,share", [(False, 0), (True, 0), (True, 3)])
def test_micro_batches_hold_one_slot_and_group_every_row_once_within_the_budget(packing, share):
    rng = np.random.RandomState(0)
    S, R, T, budget = 2, 40, 256, 300
    length = rng.randint(1, T + 1, (S, R)) * (rng.rand(S, R) < 0.8)
    group = np.where(length > 0, rng.randint(0, 3, (S, R)) + 3 * np.arange(S)[:, None], -1)
    tokens = np.where(np.arange(T) < length[..., None], rng.randint(1, 4, (S, R, T)), 0)  # many shared prefixes
    items = layout.budget_items(length, (length > 0).astype(np.float32), group, budget=budget, T=T, W=64,
                                packing=packing, tokens=tokens, share_prefix=share)
    seen = set()
    for it in items:
        rows = _live(it)
        assert len({int(g) for g in group[it.slot, rows]}) == 1  # one slot (the item's) and one group
        assert not seen & {(it.slot, int(r)) for r in rows}
        seen |= {(it.slot, int(r)) for r in rows}
        t = it.shape.t
        assert length[it.slot, rows].max() <= t
        # over the budget only for a row whose window is: alone (packed: in one sequence, with what fits beside it)
        assert it.positions <= budget or (t > budget and (it.shape.p == 1 if packing else len(rows) == 1))
        if packing:  # rows laid in the item's sequences without overlap (a shared prefix is written once)
            p = it.shape.p
            taken = np.zeros((p, t), int)
            for a, r in enumerate(it.rows):
                if r < 0:
                    continue
                c = it.pack.share[a] if share else 0
                s_, o_ = it.pack.seq[a], it.pack.off[a]
                assert s_ < p and o_ + length[it.slot, r] <= t
                taken[s_, o_ + c:o_ + length[it.slot, r]] += 1
            assert taken.max() <= 1
    assert seen == {(s, r) for s in range(S) for r in range(R) if length[s, r] > 0}
    # Without diagnostics only the slot bounds a micro-batch.
    items = layout.budget_items(length, (length > 0).astype(np.float32), group, budget=budget, T=T, W=64,
                                by_group=False)
    assert any(len({int(g) for g in group[it.slot, _live(it)]}) > 1 for it in items)


# ---- the step against fixed micro-batches ----

ROLES = ["gen", "judge"]


def _rows():
    """Under a 100-token budget: a long row alone, two long rows (one task's episodes, sharing their prompt)
    together, six short rows in one micro-batch unpacked (the last of them topping up its padded row count),
    in as many 64-token sequences as they need packed."""
    rng = np.random.RandomState(3)
    row = lambda role, p, c, i=0: FakeRow(list(rng.randint(1, 64, p)), list(rng.randint(1, 64, c)),
                                          list(-rng.uniform(0.5, 4.0, c)), role, i)
    rows = [row("gen", 40, 6, 0), row("gen", 36, 8, 1), row("gen", 35, 7, 1)]
    rows[2].prompt_tokens = list(rows[1].prompt_tokens[:35])
    rows += [row("judge", p, c) for p, c in [(9, 6), (8, 6), (10, 4), (7, 6), (9, 5), (4, 5)]]
    return rows, list(rng.randn(len(rows)))


def _budget_step(r2s, *, budget, packing, share=0, rows=None, step=None):
    """One step from the same start, with max_tokens_per_micro_batch=budget (0: fixed micro-batches of 4 rows);
    (new state, metrics, batch, step)."""
    base, spec, tr = _setup(max(r2s.values()) + 1, 0)
    rows, advs = rows or _rows()
    groups = make_groups(ROLES, r2s, {"gen": 2})
    batch = make_batch(rows, np.asarray(advs, np.float32), role_to_slot=r2s, num_slots=spec.num_slots,
                       groups=groups, micro_batch=4)
    tx = optim.per_slot(optax.sgd(LR))
    ucfg = UpdateConfig(micro_batch=4, length_buckets=1, packing=packing, share_prefix=share,
                        max_tokens_per_micro_batch=budget)
    step = step or make_train_step(CFG, spec, ucfg, tx, num_groups=len(groups.names), group_slot=groups.slot,
                                   group_role=[ROLES.index(r) for r in groups.role], num_roles=2,
                                   role_slot=[r2s[r] for r in ROLES])
    state = init_state(jax.tree_util.tree_map(jnp.array, tr), tx)
    new, m = step(state, base, jax.tree_util.tree_map(jnp.asarray, batch))
    return new, m, batch, step


@pytest.mark.parametrize("r2s", [{"gen": 0, "judge": 0}, {"gen": 0, "judge": 1}], ids=["shared", "isolated"])
@pytest.mark.parametrize("packing,share", [(False, 0), (True, 3)], ids=["unpacked", "packed"])
def test_a_token_budget_gives_the_fixed_micro_batches_step(r2s, packing, share):
    fixed = _budget_step(r2s, budget=0, packing=packing, share=share)
    budget = _budget_step(r2s, budget=100, packing=packing, share=share)
    items = layout.plan_items(budget[2], micro_batch=4, length_buckets=1, packing=packing, share_prefix=share,
                              max_tokens=100)
    sizes = sorted(len(_live(it)) for it in items)
    if not packing:  # the six short rows in one micro-batch, past the fixed layout's 4 rows
        assert sizes[0] == 1 and sizes[-1] > 4, sizes
    else:  # one sequence of T=64 tokens per item (pack_window: the budget holds one), as many rows as fit in it
        assert {it.shape for it in items} == {Packed(1, 64)} and sizes[0] == 1 and len(set(sizes)) > 2, sizes
    for k in ("loss", "loss_per_slot", "role_grad_norm", "role_grad_share", "role_grad_norm_share", "role_grad_cos",
              "role_copy_alignment", "group_grad_norm", "slot_grad_norm"):
        np.testing.assert_allclose(np.asarray(budget[1][k]), np.asarray(fixed[1][k]), rtol=1e-5, atol=1e-6,
                                   err_msg=k)
    for k in fixed[1]["role_stats"]:
        np.testing.assert_allclose(np.asarray(budget[1]["role_stats"][k]), np.asarray(fixed[1]["role_stats"][k]),
                                   rtol=1e-5, atol=1e-6, err_msg=k)
    assert int(budget[1]["misaligned_rows"]) == 0
    _assert_tree_close(budget[0].trainable, fixed[0].trainable, atol=1e-6, rtol=1e-5)


def test_packed_items_hold_more_rows_than_the_head_window_allows_and_give_the_same_step():
    """Packed items run the LM head over their completion tokens only (update.scored_positions), so under a
    budget they hold budget // ROW_TOKENS rows, past budget // window (the cap a head over every row's window
    needs) where the window is longer than ROW_TOKENS: the step still equals the fixed micro-batches'."""
    rng = np.random.RandomState(5)
    row = lambda role, p, c: FakeRow(list(rng.randint(1, 64, p)), list(rng.randint(1, 64, c)),
                                     list(-rng.uniform(0.5, 4.0, c)), role, 0)
    # one completion of 24 tokens: a window past ROW_TOKENS, so the head over rows x window holds fewer rows
    rows = [row("gen", 6, 24), row("judge", 10, 5)] + [row("judge", 2, int(rng.randint(1, 3))) for _ in range(14)]
    rows_advs = (rows, list(rng.randn(len(rows))))
    r2s, budget = {"gen": 0, "judge": 0}, 64
    fixed = _budget_step(r2s, budget=0, packing=True, rows=rows_advs)
    new = _budget_step(r2s, budget=budget, packing=True, rows=rows_advs)
    kw = dict(micro_batch=4, length_buckets=1, packing=True, max_tokens=budget)
    most = max(len(_live(it)) for it in layout.plan_items(new[2], **kw, head_over_rows=False))
    capped = max(len(_live(it)) for it in layout.plan_items(new[2], **kw))
    assert most > capped, (most, capped)  # the head over rows x window caps the rows at budget // window
    for k in ("loss", "loss_per_slot", "role_grad_norm", "slot_grad_norm"):
        np.testing.assert_allclose(np.asarray(new[1][k]), np.asarray(fixed[1][k]), rtol=1e-5, atol=1e-6, err_msg=k)
    _assert_tree_close(new[0].trainable, fixed[0].trainable, atol=1e-6, rtol=1e-5)


def test_compiled_item_shapes_stay_few_across_batches():
    """Batches of other row counts and lengths reuse the budget's item programs: one per (row count, window) on
    the grid, at most budget // window rows for each window."""
    budget, r2s = 128, {"gen": 0, "judge": 0}
    rng = np.random.RandomState(1)
    row = lambda role, p, c: FakeRow(list(rng.randint(1, 64, p)), list(rng.randint(1, 64, c)), [-1.0] * c, role, 0)
    step, shapes, counts, n_items = None, set(), [], 0
    for n, longest in ((6, 30), (10, 100), (12, 50)):
        rows = [row(("gen", "judge")[i % 2], int(rng.randint(2, longest - 8)), int(rng.randint(2, 9)))
                for i in range(n)]
        _, _, batch, step = _budget_step(r2s, budget=budget, packing=False, rows=(rows, list(rng.randn(n))),
                                         step=step)
        items = layout.plan_items(batch, micro_batch=4, length_buckets=1, max_tokens=budget)
        n_items += len(items)
        for it in items:
            assert len(it.rows) <= max(1, budget // it.shape.t)
            shapes.add((len(it.rows), it.shape, batch.targets.shape[2]))
        counts.append(step.item_programs())
    assert counts[-1] == len(shapes) < n_items, (counts, len(shapes), n_items)
    # Over many random batches the shapes stay within what the buckets allow: each window of the grid (8 ... T)
    # with row counts on the grid up to budget // window; a coarser grid (grpo.length_grid) allows fewer.
    def shapes(grid):
        seen = set()
        for seed in range(40):
            g = np.random.RandomState(seed)
            length = g.randint(3, 65, (1, 32)) * (g.rand(1, 32) < 0.7)
            seen |= {(len(it.rows), it.shape) for it in layout.budget_items(
                length, (length > 0).astype(np.float32), g.randint(0, 2, (1, 32)), budget=budget, T=64, W=16,
                grid=grid)}
        bound = sum(len({min(layout.grid_size(n, grid), budget // w) for n in range(1, budget // w + 1)})
                    for w in layout.length_ladder(64, 64, grid))
        return len(seen), bound
    (n2, bound2), (n1, bound1) = shapes(2), shapes(1)
    assert n2 <= bound2 and n1 <= bound1 and bound1 < bound2 and n1 < n2, (n2, bound2, n1, bound1)


def test_a_bad_budget_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 0"):
        UpdateConfig(max_tokens_per_micro_batch=-1)
    from marl_jax.config import base_config, validate

    c = base_config("voting", ("generator", "aggregator"))
    c.grpo.max_tokens_per_micro_batch = -5
    with pytest.raises(ValueError, match=r"--config.grpo.max_tokens_per_micro_batch must be >= 0 .*got -5"):
        validate(c)
    c.grpo.max_tokens_per_micro_batch = 4096
    validate(c)


def test_the_trainer_takes_the_budget_from_the_config_and_the_same_first_step(prompt_dir, tmp_path):
    """grpo.max_tokens_per_micro_batch reaches the trainer's update: one step of the tiny voting run from the same
    rollout gives the fixed micro-batches' loss and updated weights."""
    from marl_jax.models.tiny import tiny_model
    from marl_jax.train.loop import Trainer
    from test_learning import digit_tasks, learning_config, tiny_tokenizer

    out = []
    for budget in (0, 160):
        c = learning_config("shared", prompt_dir)
        c.num_tasks, c.rollout.group_size = 4, 4
        c.task.update(size=40, val_size=4)
        c.grpo.update(micro_batch=4, max_tokens_per_micro_batch=budget)
        c.train.update(steps=1, val_every=10, ckpt_every=10, warmup=False)
        t = Trainer(c, str(tmp_path / str(budget)), model=tiny_model(tiny_tokenizer(), seed=1),
                    tasks=digit_tasks(44), progress=False)
        assert t.ucfg.max_tokens_per_micro_batch == budget
        rec = t.train_step(0)
        out.append((rec["loss"], t.state.trainable))
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5)
    _assert_tree_close(out[0][1], out[1][1], atol=1e-6, rtol=1e-5)


# ---- the LM head ----

def test_the_lm_head_chunk_bounds_float32_logits_for_long_rows_and_many_rows():
    V, cap = 151936, U._HEAD_BYTES
    for N, W in ((1, 30000), (64, 512), (512, 64), (8, 4096)):
        chunk, flat = U.head_chunk(N, W, V)
        assert flat and chunk * V * 4 <= cap, (N, W, chunk)
    assert U.head_chunk(4, 16, V) == (16, False)  # small items: the whole window at once
    assert U.head_chunk(64, 512, V, 7) == (7, False)  # UpdateConfig.head_chunk: positions per row


def test_scoring_never_materialises_an_items_full_logits(monkeypatch):
    """Every teacher-forced scoring pass of the update (the policy's log-probs and entropies, recomputed old
    log-probs, the KL reference's) goes through the chunked head: traced with a small logits budget, no float
    array over the vocabulary holds more positions than one chunk, forward or backward."""
    cfg = dataclasses.replace(CFG, vocab_size=72)  # a vocabulary no other dimension of the item equals
    V = cfg.vocab_size
    monkeypatch.setattr(U, "_HEAD_BYTES", 4 * V * 16)  # 16 positions of logits
    base = decoder.init_params(cfg, jax.random.PRNGKey(0))
    spec = PolicySpec(rank=4, alpha=8.0, num_slots=1)
    tr = init_trainable(spec, cfg, base, jax.random.PRNGKey(1))
    rows, advs = _rows()
    groups = make_groups(ROLES, {"gen": 0, "judge": 0}, None)
    b = make_batch(rows, np.asarray(advs, np.float32), role_to_slot={"gen": 0, "judge": 0}, num_slots=1,
                   groups=groups, micro_batch=8, keep_zero_advantage=True)
    ucfg = UpdateConfig(micro_batch=8, kl=True, old_logp="recompute", entropy_coef=0.01)
    r = {k: jnp.asarray(getattr(b, k)[0, :8]) for k in ("tokens", "valid", "win_start", "targets", "loss_mask",
                                                         "old_logp", "advantages", "kl_coef", "length")}
    assert 8 * b.targets.shape[2] > 16  # the item's whole logits would exceed the budget
    one = jax.tree_util.tree_map(lambda x: x[0], tr)

    def step(lora):
        nums, vjp, aux = jax.vjp(lambda x: U.row_terms(cfg, spec, ucfg, base, x, r), lora, has_aux=True)
        return vjp(jnp.ones_like(nums)), aux

    shapes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            shapes.extend(v.aval.shape for v in eqn.outvars if getattr(v.aval, "shape", ())
                          and v.aval.shape[-1] == V and v.aval.dtype == jnp.float32)
            for p_ in eqn.params.values():
                for j in (p_ if isinstance(p_, (tuple, list)) else (p_,)):
                    inner = getattr(j, "jaxpr", j)
                    if hasattr(inner, "eqns"):
                        walk(inner)
    walk(jax.make_jaxpr(step)(one).jaxpr)
    logits = [s for s in shapes if s != (cfg.hidden_size, V)]  # the LM head's weight is [D, V]
    assert logits, "the trace must reach the LM head"
    assert max(int(np.prod(s[:-1])) for s in logits) <= 16, sorted(set(logits))
