"""The jitted GRPO update against an independent per-row, per-role reference written here."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marl_jax.models import decoder
from marl_jax.policy.lora import PolicySpec, init_trainable, slot_params
from marl_jax.rl import optim
from marl_jax.rl.batch import make_batch, make_groups
from marl_jax.rl.update import UpdateConfig, init_state, make_train_step

CFG = decoder.ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, rope_theta=1e4)
LR = 0.5


@dataclasses.dataclass
class FakeRow:
    prompt_tokens: list
    completion_tokens: list
    logprobs: list
    role: str
    call_index: int = 0
    trained: bool = True


def _rows(rng, roles_counts):
    rows = []
    for role, n, copies in roles_counts:
        for i in range(n):
            # Two prompt and two completion lengths: varied rows, few reference compilations.
            p = list(rng.randint(1, 64, rng.choice([3, 5])))
            c = list(rng.randint(1, 64, rng.choice([2, 4])))
            rows.append(FakeRow(p, c, list(-rng.uniform(0.5, 4.0, len(c))), role, i % copies))
    return rows


def _setup(num_slots, seed=0):
    base = decoder.init_params(CFG, jax.random.PRNGKey(seed))
    spec = PolicySpec(rank=4, alpha=8.0, num_slots=num_slots)
    tr = init_trainable(spec, CFG, base, jax.random.PRNGKey(1))
    # Non-zero B so that both A and B get gradients; slots differ.
    tr = jax.tree_util.tree_map(lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(2), x.shape), tr)
    return base, spec, tr


@jax.jit
def _ref_row_grad(base, one_slot_lora, prompt, completion, old_logp, adv):
    """Gradient of one row's token-mean PPO-clip loss, computed directly from the unpadded row."""
    def loss(lora):
        seq = jnp.concatenate([prompt, completion])[None]
        logits = decoder.forward(base, CFG, seq, lora=lora, lora_scale=8.0 / 4)[0]
        P, C = prompt.shape[0], completion.shape[0]
        logp = jax.nn.log_softmax(logits[P - 1:P + C - 1], -1)[jnp.arange(C), completion]
        ratio = jnp.exp(logp - old_logp)
        pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - 0.2, 1 + 0.28))
        pg = jnp.where(adv < 0, jnp.minimum(pg, -adv * 3.0), pg)
        return jnp.mean(pg)
    return jax.grad(loss)(one_slot_lora)


def _ref_grad(base, spec, tr, slot, rows, advs, weight_rows=None):
    """Gradient for one slot of the mean-over-its-rows loss (optionally only some rows' terms)."""
    assert spec.scale == 8.0 / 4
    one = jax.tree_util.tree_map(lambda x: x[slot], tr)
    total = jax.tree_util.tree_map(jnp.zeros_like, one)
    for i, (r, a) in enumerate(zip(rows, advs)):
        if weight_rows is None or i in weight_rows:
            g = _ref_row_grad(base, one, jnp.asarray(r.prompt_tokens), jnp.asarray(r.completion_tokens),
                              jnp.asarray(r.logprobs, jnp.float32), jnp.float32(a))
            total = jax.tree_util.tree_map(jnp.add, total, g)
    return jax.tree_util.tree_map(lambda x: x / len(rows), total)


def _whole_batch_grads(base, spec, tr, rows, advs, role_to_slot, roles):
    """Independent of the update's layout: each slot's loss over all its rows at once (right-padded to the
    longest row, one forward pass, seq-mean-token-mean of the dual-clipped PPO terms against the rows' own
    log-probs) and jax.grad of it. Returns {slot: (loss, gradient)}, {role: its part of its slot's gradient (its
    rows' terms over the same denominator)} and {role: token log-probs of its rows}."""
    n_tok = lambda r: len(r.prompt_tokens) + len(r.completion_tokens)
    T, C = max(map(n_tok, rows)), max(len(r.completion_tokens) for r in rows)
    out, per_role, logps = {}, {}, {}
    for slot in sorted(set(role_to_slot.values())):
        idx = [i for i, r in enumerate(rows) if role_to_slot[r.role] == slot and r.trained]
        tokens, valid = np.zeros((len(idx), T), np.int32), np.zeros((len(idx), T), bool)
        pos, tgt = np.zeros((len(idx), C), np.int32), np.zeros((len(idx), C), np.int32)
        mask, old = np.zeros((len(idx), C), np.float32), np.zeros((len(idx), C), np.float32)
        for a, i in enumerate(idx):
            r = rows[i]
            P, c = len(r.prompt_tokens), len(r.completion_tokens)
            tokens[a, :P + c], valid[a, :P + c] = r.prompt_tokens + r.completion_tokens, True
            pos[a, :c], tgt[a, :c] = np.arange(P - 1, P + c - 1), r.completion_tokens
            mask[a, :c], old[a, :c] = 1.0, r.logprobs
        adv = jnp.asarray([advs[i] for i in idx], jnp.float32)[:, None]

        def token_logp(lora):
            logits = decoder.forward(base, CFG, tokens, valid, lora=lora, lora_scale=spec.scale)
            lp = jax.nn.log_softmax(jnp.take_along_axis(logits, pos[..., None], axis=1), -1)
            return jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]

        def loss(lora, keep):
            ratio = jnp.exp(token_logp(lora) - old)
            pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - 0.2, 1 + 0.28))
            pg = jnp.where(adv < 0, jnp.minimum(pg, -adv * 3.0), pg)
            row = jnp.sum(pg * mask, -1) / mask.sum(-1)
            return jnp.sum(row * keep) / len(idx)

        one = jax.tree_util.tree_map(lambda x: x[slot], tr)
        out[slot] = (float(loss(one, np.ones(len(idx)))), jax.grad(loss)(one, np.ones(len(idx))))
        lp = np.asarray(token_logp(one))
        for role in {rows[i].role for i in idx}:
            keep = np.asarray([rows[i].role == role for i in idx], np.float32)
            per_role[role] = jax.grad(loss)(one, keep)
            logps[role] = [lp[a, :len(rows[i].completion_tokens)] for a, i in enumerate(idx) if keep[a]]
    return out, per_role, logps


def _step(base, spec, tr, rows, advs, role_to_slot, roles, copies=None, micro_batch=4, diagnostics=True,
          old_logp="sampler", keep_zero=False, tis_cap=0.0):
    S = spec.num_slots
    groups = make_groups(roles, role_to_slot, copies)
    batch = make_batch(rows, np.asarray(advs, np.float32), role_to_slot=role_to_slot, num_slots=S, groups=groups,
                       micro_batch=micro_batch, keep_zero_advantage=keep_zero)
    tx = optim.per_slot(optax.sgd(LR))
    ucfg = UpdateConfig(micro_batch=micro_batch, diagnostics=diagnostics, old_logp=old_logp, tis_cap=tis_cap)
    step = make_train_step(CFG, spec, ucfg, tx, num_groups=len(groups.names), group_slot=groups.slot,
                           group_role=[roles.index(r) for r in groups.role], num_roles=len(roles),
                           role_slot=[role_to_slot[r] for r in roles])
    state = init_state(jax.tree_util.tree_map(jnp.array, tr), tx)
    new, metrics = step(state, base, jax.tree_util.tree_map(jnp.asarray, batch))
    grads = jax.tree_util.tree_map(lambda a, b: (b - a) / LR, new.trainable, tr)  # sgd: new = old - lr * g
    return grads, metrics, new


def _assert_tree_close(a, b, atol=1e-5, rtol=1e-4):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol)


def test_isolated_vmapped_update_equals_separate_per_role_updates():
    rng = np.random.RandomState(0)
    base, spec, tr = _setup(2)
    rows = _rows(rng, [("gen", 5, 1), ("judge", 3, 1)])
    advs = list(rng.randn(len(rows)))
    grads, metrics, _ = _step(base, spec, tr, rows, advs, {"gen": 0, "judge": 1}, ["gen", "judge"])
    for slot, role in enumerate(["gen", "judge"]):
        idx = [i for i, r in enumerate(rows) if r.role == role]
        ref = _ref_grad(base, spec, tr, slot, [rows[i] for i in idx], [advs[i] for i in idx])
        _assert_tree_close(jax.tree_util.tree_map(lambda x: x[slot], grads), ref)
    # Each slot's loss is normalised by its own rows: doubling gen's rows leaves judge's step unchanged.
    rows2 = rows + _rows(np.random.RandomState(9), [("gen", 4, 1)])
    advs2 = advs + list(np.random.RandomState(9).randn(4))
    grads2, _, _ = _step(base, spec, tr, rows2, advs2, {"gen": 0, "judge": 1}, ["gen", "judge"])
    _assert_tree_close(jax.tree_util.tree_map(lambda x: x[1], grads2), jax.tree_util.tree_map(lambda x: x[1], grads))


def test_shared_per_role_gradients_add_up_to_the_full_gradient():
    rng = np.random.RandomState(1)
    base, spec, tr = _setup(1)
    rows = _rows(rng, [("gen", 5, 1), ("judge", 3, 1)])
    advs = list(rng.randn(len(rows)))
    grads, m, _ = _step(base, spec, tr, rows, advs, {"gen": 0, "judge": 0}, ["gen", "judge"])
    full = _ref_grad(base, spec, tr, 0, rows, advs)
    _assert_tree_close(jax.tree_util.tree_map(lambda x: x[0], grads), full)
    flat = lambda t: np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(t)])
    per_role = {r: flat(_ref_grad(base, spec, tr, 0, rows, advs, {i for i, x in enumerate(rows) if x.role == r}))
                for r in ["gen", "judge"]}
    g = flat(full)
    for k, r in enumerate(["gen", "judge"]):
        np.testing.assert_allclose(float(m["role_grad_norm"][k]), np.linalg.norm(per_role[r]), rtol=1e-4)
        np.testing.assert_allclose(float(m["role_grad_share"][k]), per_role[r] @ g / (g @ g), rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(float(m["role_grad_share"].sum()), 1.0, atol=1e-5)
    cos = per_role["gen"] @ per_role["judge"] / np.linalg.norm(per_role["gen"]) / np.linalg.norm(per_role["judge"])
    np.testing.assert_allclose(float(m["role_grad_cos"][0, 1]), cos, rtol=1e-3, atol=1e-5)


def test_micro_batches_accumulate_exactly_and_diagnostics_do_not_change_the_step():
    rng = np.random.RandomState(2)
    base, spec, tr = _setup(2)
    rows = _rows(rng, [("gen", 7, 1), ("judge", 5, 1)])
    advs = list(rng.randn(len(rows)))
    ref, _, _ = _step(base, spec, tr, rows, advs, {"gen": 0, "judge": 1}, ["gen", "judge"], micro_batch=8)
    for mb, diag in [(2, True), (1, False), (4, False)]:
        g, _, _ = _step(base, spec, tr, rows, advs, {"gen": 0, "judge": 1}, ["gen", "judge"], micro_batch=mb,
                        diagnostics=diag)
        _assert_tree_close(g, ref)


def test_copy_alignment_is_sqrt_k_for_identical_copies_and_about_one_for_unrelated():
    rng = np.random.RandomState(3)
    base, spec, tr = _setup(1)
    one = _rows(rng, [("voter", 1, 1)])[0]
    same = [dataclasses.replace(one, call_index=c) for c in range(3)]
    _, m, _ = _step(base, spec, tr, same, [1.0, 1.0, 1.0], {"voter": 0}, ["voter"], copies={"voter": 3})
    np.testing.assert_allclose(float(m["role_copy_alignment"][0]), np.sqrt(3), rtol=1e-4)
    # Opposite advantages on identical rows (ratio 1, so no clipping) cancel: alignment near 0.
    _, m2, _ = _step(base, spec, tr, same[:2], [1.0, -1.0], {"voter": 0}, ["voter"], copies={"voter": 2},
                     old_logp="recompute")
    assert float(m2["role_copy_alignment"][0]) < 0.05


def test_non_finite_loss_skips_the_update_and_is_counted():
    rng = np.random.RandomState(4)
    base, spec, tr = _setup(1)
    rows = _rows(rng, [("gen", 4, 1)])
    advs = [1.0, np.nan, -1.0, 0.5]
    _, m, new = _step(base, spec, tr, rows, advs, {"gen": 0}, ["gen"])
    assert not bool(m["finite"])
    assert int(new.skipped) == 1
    _assert_tree_close(new.trainable, tr, atol=0, rtol=0)


def test_padding_and_untrained_rows_add_no_gradient():
    rng = np.random.RandomState(5)
    base, spec, tr = _setup(1)
    rows = _rows(rng, [("gen", 3, 1)])
    advs = list(rng.randn(3))
    g, _, _ = _step(base, spec, tr, rows, advs, {"gen": 0}, ["gen"], micro_batch=8)  # 5 padding rows
    extra = _rows(np.random.RandomState(6), [("gen", 2, 1)])
    for r in extra:
        r.trained = False
    g2, _, _ = _step(base, spec, tr, rows + extra, advs + [3.0, -3.0], {"gen": 0}, ["gen"], micro_batch=8)
    # Untrained rows count neither in the gradient nor in the mean's denominator.
    _assert_tree_close(g, g2)


def test_leaving_out_zero_advantage_rows_is_exact():
    rng = np.random.RandomState(7)
    base, spec, tr = _setup(2)
    rows = _rows(rng, [("gen", 6, 1), ("judge", 4, 1)])
    advs = [0.0 if i % 2 else float(a) for i, a in enumerate(rng.randn(len(rows)))]
    pruned, _, _ = _step(base, spec, tr, rows, advs, {"gen": 0, "judge": 1}, ["gen", "judge"])
    kept, _, _ = _step(base, spec, tr, rows, advs, {"gen": 0, "judge": 1}, ["gen", "judge"], keep_zero=True)
    _assert_tree_close(pruned, kept)
    for slot, role in enumerate(["gen", "judge"]):
        idx = [i for i, r in enumerate(rows) if r.role == role]
        ref = _ref_grad(base, spec, tr, slot, [rows[i] for i in idx], [advs[i] for i in idx])
        _assert_tree_close(jax.tree_util.tree_map(lambda x: x[slot], pruned), ref)


def test_group_aligned_layout_puts_one_group_per_micro_batch_and_misalignment_is_reported():
    rng = np.random.RandomState(8)
    rows = _rows(rng, [("gen", 5, 1), ("judge", 3, 1), ("gen", 2, 1)])  # roles interleaved
    groups = make_groups(["gen", "judge"], {"gen": 0, "judge": 0}, None)
    advs = np.ones(len(rows), np.float32)
    b = make_batch(rows, advs, role_to_slot={"gen": 0, "judge": 0}, num_slots=1, groups=groups, micro_batch=4)
    mbs = b.group[0].reshape(-1, 4)
    for mb in mbs:
        assert len(set(mb[mb >= 0].tolist())) <= 1, mbs
    assert sorted(b.group[0][b.group[0] >= 0].tolist()) == [0] * 7 + [1] * 3  # every row kept once
    base, spec, tr = _setup(1)
    unaligned = make_batch(rows, advs, role_to_slot={"gen": 0, "judge": 0}, num_slots=1, groups=groups,
                           micro_batch=4, align_groups=False)
    step = make_train_step(CFG, spec, UpdateConfig(micro_batch=4), optim.per_slot(optax.sgd(LR)), num_groups=2,
                           group_slot=groups.slot, group_role=[0, 1], num_roles=2, role_slot=[0, 0])
    _, m = step(init_state(tr, optim.per_slot(optax.sgd(LR))), base, jax.tree_util.tree_map(jnp.asarray, unaligned))
    assert int(m["misaligned_rows"]) > 0


# ---- the sampler's log-probs against the trainer's ----

@jax.jit
def _ref_row_logp(base, one_slot_lora, prompt, completion):
    """One row's completion log-probs under these parameters, computed directly from the unpadded row."""
    logits = decoder.forward(base, CFG, jnp.concatenate([prompt, completion])[None], lora=one_slot_lora,
                             lora_scale=8.0 / 4)[0]
    P, C = prompt.shape[0], completion.shape[0]
    return jax.nn.log_softmax(logits[P - 1:P + C - 1], -1)[jnp.arange(C), completion]


def _shifted_rows(base, tr, rows, role_to_slot, shift):
    """The rows with sampler log-probs = the trainer's own (the slot's current parameters) + shift[role]."""
    for r in rows:
        one = jax.tree_util.tree_map(lambda x: x[role_to_slot[r.role]], tr)
        lp = _ref_row_logp(base, one, jnp.asarray(r.prompt_tokens), jnp.asarray(r.completion_tokens))
        r.logprobs = list(np.asarray(lp, np.float64) + shift[r.role])
    return rows


@pytest.mark.parametrize("old_logp", ["sampler", "recompute"])
@pytest.mark.parametrize("r2s", [{"gen": 0, "judge": 0}, {"gen": 0, "judge": 1}], ids=["shared", "isolated"])
def test_logged_logp_gap_is_the_known_shift_between_sampler_and_trainer(old_logp, r2s):
    """Sampler log-probs = the trainer's - 0.1 for gen and + 0.2 for judge on every token. Logged per role:
    mean_abs = 0.1 and 0.2; k3 = E[r - 1 - log r], r = p_trainer / p_sampler, log r = +0.1 and -0.2:
    e^0.1 - 1.1 = 0.0051709 and e^-0.2 - 0.8 = 0.0187308 (a gap measured the other way round would give
    0.0048374 and 0.0214028). The same whatever old_logp the PPO ratio uses."""
    from marl_jax.train.loop import update_record

    base, spec, tr = _setup(max(r2s.values()) + 1)
    rows = _shifted_rows(base, tr, _rows(np.random.RandomState(11), [("gen", 5, 1), ("judge", 3, 1)]), r2s,
                         {"gen": -0.1, "judge": 0.2})
    advs = list(np.random.RandomState(12).randn(len(rows)))
    _, m, _ = _step(base, spec, tr, rows, advs, r2s, ["gen", "judge"], old_logp=old_logp)
    rec = update_record(m, ["gen", "judge"], r2s, {})
    np.testing.assert_allclose(rec["logp_gap/gen/mean_abs"], 0.1, rtol=1e-4)
    np.testing.assert_allclose(rec["logp_gap/judge/mean_abs"], 0.2, rtol=1e-4)
    np.testing.assert_allclose(rec["logp_gap/gen/k3"], np.exp(0.1) - 1.1, rtol=1e-3)
    np.testing.assert_allclose(rec["logp_gap/judge/k3"], np.exp(-0.2) - 0.8, rtol=1e-3)
    assert "logp_gap/gen/tis_capped_frac" not in rec


@pytest.mark.parametrize("cap", [2.0, 1.05])
def test_truncated_importance_sampling_scales_the_gradient_by_the_capped_ratio(cap):
    """Sampler log-probs 0.1 below the trainer's on every token, old_logp=recompute: the PPO ratio is 1 (no
    clipping), so the TIS weight min(e^0.1, C), the same on every token, scales the whole step: by
    e^0.1 = 1.10517 under C = 2, by C = 1.05 under C = 1.05 (every token capped). The step without it is the
    per-row reference gradient at ratio 1 (test_update's _ref_grad with the trainer's own log-probs)."""
    from marl_jax.train.loop import update_record

    r2s = {"gen": 0, "judge": 1}
    base, spec, tr = _setup(2)
    rows = _rows(np.random.RandomState(13), [("gen", 5, 1), ("judge", 3, 1)])
    advs = list(np.random.RandomState(14).randn(len(rows)))
    own = _shifted_rows(base, tr, [dataclasses.replace(r) for r in rows], r2s, {"gen": 0.0, "judge": 0.0})
    rows = _shifted_rows(base, tr, rows, r2s, {"gen": -0.1, "judge": -0.1})
    plain, _, _ = _step(base, spec, tr, rows, advs, r2s, ["gen", "judge"], old_logp="recompute")
    tis, m, _ = _step(base, spec, tr, rows, advs, r2s, ["gen", "judge"], old_logp="recompute", tis_cap=cap)
    w = min(np.exp(0.1), cap)
    _assert_tree_close(tis, jax.tree_util.tree_map(lambda g: w * g, plain))
    for slot, role in enumerate(["gen", "judge"]):
        idx = [i for i, r in enumerate(own) if r.role == role]
        ref = _ref_grad(base, spec, tr, slot, [own[i] for i in idx], [advs[i] for i in idx])
        _assert_tree_close(jax.tree_util.tree_map(lambda x: x[slot], plain), ref)
    rec = update_record(m, ["gen", "judge"], r2s, {})
    assert rec["logp_gap/gen/tis_capped_frac"] == (1.0 if cap < np.exp(0.1) else 0.0)


def test_truncated_importance_sampling_needs_recomputed_old_logprobs():
    from marl_jax.config import base_config, validate

    with pytest.raises(ValueError, match="needs old_logp='recompute'"):
        UpdateConfig(tis_cap=2.0)
    UpdateConfig(tis_cap=2.0, old_logp="recompute")
    c = base_config("voting", ("generator", "aggregator"))
    c.grpo.tis_cap = 2.0
    with pytest.raises(ValueError, match="add --config.grpo.old_logp=recompute"):
        validate(c)
    c.grpo.old_logp = "recompute"
    validate(c)
    c.grpo.tis_cap = -1.0
    with pytest.raises(ValueError, match="tis_cap must be >= 0"):
        validate(c)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_trainer_logs_each_roles_gap_and_float32_has_none(temperature, prompt_dir, tmp_path):
    """One step of the tiny voting run (float32, dense attention): the sampler's log-probs and the update's
    recomputation agree to float noise at temperature 1 and below it (the update scores softmax(logits / T),
    the distribution the rows were drawn from), and the record has both roles' gap keys; the summary's train
    table shows them."""
    from marl_jax.models.tiny import tiny_model
    from marl_jax.train.loop import Trainer
    from marl_jax.train.summary import summary_table
    from test_learning import digit_tasks, learning_config, tiny_tokenizer

    c = learning_config("isolated", prompt_dir)
    c.num_tasks, c.rollout.group_size = 4, 4
    c.rollout.max_new_tokens.generator = c.rollout.max_new_tokens.aggregator = 4
    c.rollout.temperature = temperature
    c.task.update(size=40, val_size=4)
    c.grpo.entropy_coef = 1e-3  # keeps rows of advantage 0 in the batch: a tiny random model rarely scores
    c.train.update(steps=1, val_every=10, ckpt_every=10, warmup=False)
    t = Trainer(c, str(tmp_path), model=tiny_model(tiny_tokenizer(), seed=1), tasks=digit_tasks(44), progress=False)
    rec = t.train_step(0)
    for role in ("generator", "aggregator"):
        assert 0 <= rec[f"logp_gap/{role}/mean_abs"] < 1e-4, rec
        assert 0 <= rec[f"logp_gap/{role}/k3"] < 1e-7, rec
    table = summary_table([rec], ["generator", "aggregator"])
    assert "| logp_gap/generator/mean_abs |" in table and "| logp_gap/aggregator/k3 |" in table
