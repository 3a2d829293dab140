"""The planner's memory model against XLA's own memory analysis of the programs it describes, on CPU.

The update step (rl.update's item_grad, accumulate and finish, composed here into one program so that XLA sees
the step's peak: the state, the accumulators and one item's temporaries) and the sampler's decode and prefill
programs are lowered and compiled (never run) for small models whose activations dominate; their argument and
temporary bytes must be within 15% of marl_jax.plan's numbers. The shapes differ from the ones the
coefficients were counted on. The prefill chunk and decode step programs, and the update item under
memory-bounded attention, are checked in tests/test_plan_aot.py."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import plan as P
from marl_jax.config import base_config
from marl_jax.models import decoder
from marl_jax.policy.lora import PolicySpec, init_trainable
from marl_jax.rl import optim
from marl_jax.rl.batch import TrainBatch, make_groups
from marl_jax.rl import update as U
from marl_jax.rl.layout import Window
from marl_jax.rl.update import UpdateConfig, init_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = ("orchestrator", "worker", "synthesizer")
CFG = decoder.ModelConfig(family="qwen3", vocab_size=2048, hidden_size=192, intermediate_size=768, num_layers=3,
                          num_heads=6, num_kv_heads=2, head_dim=32, qk_norm=True, tie_word_embeddings=False)
T, W, ROWS = 384, 128, 4  # tokens per row, scored positions, rows per role


def _config(rank=16, remat="full", mb=2, policy="isolated", mode="lora"):
    c = base_config("orch_workers", ROLES)
    c.model.dtype = "float32"  # XLA:CPU computes bfloat16 matmuls in float32, so its bf16 buffers say little
    c.trainable.update(mode=mode, rank=rank)
    c.grpo.update(remat=remat, micro_batch=mb, copy_alignment=False)
    c.policy = policy
    return c


def _workload(c):
    slots = 3 if c.policy == "isolated" else 1
    r2s = {r: (i if slots > 1 else 0) for i, r in enumerate(ROLES)}
    stages = tuple(P.Stage(r, ROWS, ROWS, T - W, W) for r in ROLES)
    w = P.Workload(stages, ROLES, r2s, slots, len(ROLES), 256)
    assert (w.seq_len, w.window) == (T, W)
    return w


def _update_analysis(c, w):
    r2s = w.role_slot
    spec = PolicySpec(mode=c.trainable.mode, rank=c.trainable.rank, alpha=32.0, num_slots=w.num_slots)
    groups = make_groups(ROLES, r2s, None)
    tx = optim.per_slot(optim.make_optimizer(lr=1e-5, grad_clip=1.0))
    base = jax.eval_shape(lambda: decoder.init_params(CFG, jax.random.PRNGKey(0)))
    state = jax.eval_shape(lambda: init_state(init_trainable(
        spec, CFG, decoder.init_params(CFG, jax.random.PRNGKey(0)), jax.random.PRNGKey(1)), tx))
    S = w.num_slots
    R = max(w.slot_rows())
    sd = jax.ShapeDtypeStruct
    batch = TrainBatch(tokens=sd((S, R, T), jnp.int32), valid=sd((S, R, T), bool), win_start=sd((S, R), jnp.int32),
                       targets=sd((S, R, W), jnp.int32), loss_mask=sd((S, R, W), jnp.float32),
                       old_logp=sd((S, R, W), jnp.float32), advantages=sd((S, R), jnp.float32),
                       row_weight=sd((S, R), jnp.float32), group=sd((S, R), jnp.int32),
                       kl_coef=sd((S, R), jnp.float32), den=sd((S,), jnp.float32))
    ucfg = UpdateConfig(micro_batch=c.grpo.micro_batch, remat=c.grpo.remat, dtype=jnp.float32)
    tables = U.Tables(groups.slot, tuple(ROLES.index(r) for r in groups.role), tuple(r2s[r] for r in ROLES))
    step = jax.jit(functools.partial(_whole_step, spec, ucfg, tx, tables), donate_argnums=(0,))
    return step.lower(state, base, batch).compile().memory_analysis()


def _whole_step(spec, ucfg, tx, tables, state, base, batch):
    """The update's programs as one: item_grad over each micro-batch of every slot (a scan), accumulate, finish."""
    S, R, T = batch.tokens.shape
    mb = ucfg.micro_batch
    split = lambda x: x.reshape((S * (R // mb), mb) + x.shape[2:])
    rows = U.ItemRows(*(split(getattr(batch, k)) for k in ("tokens", "valid", "win_start", "targets", "loss_mask",
                                                            "old_logp", "advantages", "kl_coef", "row_weight",
                                                            "group")))
    den = jnp.maximum(batch.den, 1.0)
    item = lambda r, slot: U.item_grad(CFG, spec, ucfg, Window(T), jax.tree_util.tree_map(
        lambda x: x[slot], state.trainable), base, r, den[slot], group_role=tables.group_role, num_roles=len(ROLES))

    def body(acc, xs):
        r, slot = xs
        return U.accumulate(acc, item(r, slot), slot, jnp.max(r.group), 0, diagnostics=True), None

    first = jax.tree_util.tree_map(lambda x: x[0], rows)
    acc = U.zero_accum(state.trainable, jax.eval_shape(item, first, 0).stats, num_groups=len(tables.group_slot),
                       diagnostics=True)
    acc, _ = jax.lax.scan(body, acc, (rows, jnp.repeat(jnp.arange(S), R // mb)))
    return U.finish(state, acc, den, tx=tx, tables=tables, diagnostics=True)


def _close(ours, xla, tol=0.15):
    assert abs(ours - xla) <= tol * xla, f"plan {ours / 1e6:.2f} MB vs XLA {xla / 1e6:.2f} MB ({ours / xla - 1:+.1%})"


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_update_temporaries_match_xla(remat):
    """Activations of one work item plus the gradient buffers against XLA's temp bytes, per remat mode."""
    c = _config(remat=remat)
    w = _workload(c)
    knobs = P.Knobs(P.Mesh(), c.grpo.micro_batch, remat, 256)
    mem = P.memory(CFG, c, w, knobs)
    ma = _update_analysis(c, w)
    _close(mem["activations"] + mem["gradients"], ma.temp_size_in_bytes)


def test_update_arguments_match_xla():
    """Base weights, trainable weights, optimizer state and the batch against XLA's argument bytes."""
    for policy in ("shared", "isolated"):
        c = _config(policy=policy)
        w = _workload(c)
        mem = P.memory(CFG, c, w, P.Knobs(P.Mesh(), 2, "full", 256))
        ma = _update_analysis(c, w)
        _close(mem["base_weights"] + mem["trainable"] + mem["optimizer"] + mem["update_batch"],
               ma.argument_size_in_bytes, tol=0.02)


def test_remat_ordering_and_micro_batch_scaling():
    c = _config()
    w = _workload(c)
    act = {r: P.activation_bytes(CFG, c, w, P.Knobs(P.Mesh(), 4, r, 256)) for r in P.REMATS}
    assert act["none"] > act["dots"] > act["full"]
    one, four = (P.activation_bytes(CFG, c, w, P.Knobs(P.Mesh(), mb, "none", 256)) for mb in (1, 4))
    assert 3.9 < four / one < 4.1
    # Rows split over data * fsdp: micro-batch 4 on 4 data devices is micro-batch 1 on one.
    assert P.activation_bytes(CFG, c, w, P.Knobs(P.Mesh(data=4), 4, "none", 256)) == one


@pytest.mark.parametrize("rows,distinct,plen,new", [(16, 16, 20, 100), (16, 4, 70, 30)])
def test_paged_kv_pool_matches_the_sampler(rows, distinct, plen, new):
    """rollout.paged_kv: under a CallShape the sampler's pool takes one size, what every row at its limit
    holds (buckets.shape_pool_blocks), and every row running to its limit fits it without growing; the planner
    counts that pool. Sharing a prompt (4 tasks x 4 episodes) keeps it below the dense cache."""
    from marl_jax.generate import buckets
    from marl_jax.generate.sampler import Sampler, SamplingParams, length_bucket
    from marl_jax.generate.types import CallShape

    params = decoder.init_params(CFG, jax.random.PRNGKey(0))
    rng = np.random.RandomState(0)
    base = [rng.randint(3, CFG.vocab_size, plen).tolist() for _ in range(distinct)]
    s = Sampler(CFG, max_batch=rows, paged=True, kv_block=16, prefix_cache_tokens=0)
    out = s.generate(params, [base[i % distinct] for i in range(rows)], jax.random.PRNGKey(1),
                     SamplingParams(max_new_tokens=new, temperature=1.0), shape=CallShape(rows, distinct, plen))
    assert (out.lengths == new).all() and s.stats["pool_grows"] == 0
    slot = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4
    N = buckets.shape_pool_blocks(rows, distinct, length_bucket(plen), length_bucket(new), 16)
    assert s.stats["peak_kv_bytes"] == N * 16 * slot
    c = _config()
    w = P.Workload((P.Stage("worker", rows, distinct, plen, new),), ROLES, {r: 0 for r in ROLES}, 1, 3, rows)
    dense = P.kv_bytes(CFG, c, w, P.Mesh(), rows)
    c.rollout.paged_kv = "true"
    paged = P.kv_bytes(CFG, c, w, P.Mesh(), rows)
    logits = 8 * 16 * CFG.vocab_size  # the decode step's float32 logits and softmax, in both
    assert paged[0] - logits >= N * 16 * slot - 1
    assert paged[1] < dense[1]  # the paged prefill caches prompt slots only
    if distinct < rows:
        assert paged[0] < dense[0]


@pytest.mark.parametrize("rows,distinct,budget_blocks,mbt,paged", [
    (16, 16, 40, 0, True),  # the budget's blocks bind: 5 prompts of 7 blocks beside the 1% watermark
    (16, 16, 200, 300, True),  # max_batched_tokens binds: 3 prompts of 100 tokens
    (16, 4, 40, 0, True),  # a task's 4 episodes share their prompt's blocks: all 16 rows admitted
    (16, 16, 0, 0, True),  # paged without a budget: the first batch
    (16, 16, 0, 0, False),  # dense: the first batch
])
def test_prefill_rows_match_the_sampler(rows, distinct, budget_blocks, mbt, paged):
    """The dense prompt caches a prefill builds (its distinct prompts', then every admitted row's) are as many
    rows as the plan counts: Sampler._prefill runs them before the rows' blocks go into the pool."""
    from marl_jax.generate.sampler import Sampler, SamplingParams

    params = decoder.init_params(CFG, jax.random.PRNGKey(0))
    rng = np.random.RandomState(0)
    base = [rng.randint(3, CFG.vocab_size, 100).tolist() for _ in range(distinct)]
    slot = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4
    s = Sampler(CFG, max_batch=rows, paged=paged, kv_block=16, prefix_cache_tokens=0,
                kv_budget_bytes=budget_blocks * 16 * slot, max_batched_tokens=mbt)
    out = s.generate(params, [base[i * distinct // rows] for i in range(rows)], jax.random.PRNGKey(1),
                     SamplingParams(max_new_tokens=32, temperature=1.0))
    assert (out.lengths == 32).all()
    c = _config()
    st = P.Stage("worker", rows, distinct, 100, 32)
    got = P.prefill_rows(CFG, c, st, P.Mesh(), rows, budget_blocks * 16 * slot / P.GiB, mbt, paged)
    assert got == (s.stats["peak_prefill_distinct"], s.stats["peak_prefill_rows"])
    if budget_blocks and distinct == rows:  # the cap left rows waiting for later refills
        assert s.stats["refills"] > 1 and got[1] < rows


def test_a_budget_without_a_prefill_cap_counts_the_admitted_prompts():
    """Under a KV budget the rows a refill admits are prefilled into dense caches before their blocks: for
    voting's 512 distinct 15,872-token aggregator prompts that is 256 rows of 16,384 slots (XLA:TPU refuses
    to compile it on a v5p-8: 122.75 GiB of the prefill chunk alone), so the plan's knobs cap the prompt
    tokens a refill prefills with rollout.max_batched_tokens. With 28 layers a 75 GiB pool holds 43 such
    prompts per shard, so the first refill admits 43 rows (all to the first shard), prefilled over 4 devices."""
    c = _preset()
    cfg, w, mesh = P.model_config(c.model.name), P.workload(c), P.Mesh(4)
    _, uncapped, _ = P.kv_bytes(cfg, c, w, mesh, 256, 75.0, 0)
    _, capped, _ = P.kv_bytes(cfg, c, w, mesh, 256, 75.0, 16384)
    slot = P.slot_bytes(cfg, c, mesh)
    agg = max(w.stages, key=lambda s: s.prompt)
    assert P.prefill_rows(cfg, c, agg, mesh, 256, 75.0, 0, True) == (12, 12)  # 43 rows, bucketed to 48
    assert uncapped >= 2 * 12 * 16384 * slot > 40 * P.GiB  # beside the 75 GiB pool: no fit on 95 GiB
    assert P.prefill_rows(cfg, c, agg, mesh, 256, 75.0, 16384, True) == (1, 1)
    assert capped < 5 * P.GiB
    f = P.plan(c, "v5p-8", search_chips=False)["smallest_fit"]
    assert "--config.rollout.max_batched_tokens=16384" in f["flags"] and f["memory"]["prefill_transient"] < 5 * P.GiB


def test_chips_and_meshes():
    chip, n = P.parse_chip("v4-16")
    assert chip.name == "TPU v4" and n == 8
    assert P.parse_chip("v5e-8")[1] == 8 and P.parse_chip("v5p-8")[1] == 4 and P.parse_chip("H200x8")[1] == 8
    with pytest.raises(ValueError, match="H100-80GB"):
        P.parse_chip("a100")
    assert {str(m) for m in P.meshes(4)} == {"4x1x1", "2x2x1", "1x4x1", "2x1x2", "1x2x2", "1x1x4"}
    # Splitting weights over fsdp x model divides every matrix the axes divide; norms stay whole.
    full, split = P.sharded_param_count(CFG, P.Mesh()), P.sharded_param_count(CFG, P.Mesh(1, 2, 2))
    norms = CFG.num_layers * (2 * CFG.hidden_size + 2 * CFG.head_dim) + CFG.hidden_size
    assert full == CFG.num_params() + CFG.num_layers * 2 * CFG.head_dim  # num_params omits the qk norms
    assert split == pytest.approx((full - norms) / 4 + norms)


def test_presets_have_the_public_shapes():
    # Parameter counts of the public checkpoints (model cards: 0.6B, 1.7B, 4.0B, tied embeddings for the first two).
    counts = {k: P.PRESET_MODELS[k].num_params() / 1e9 for k in ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B")}
    assert counts["Qwen/Qwen3-0.6B"] == pytest.approx(0.596, abs=0.01)
    assert counts["Qwen/Qwen3-1.7B"] == pytest.approx(1.72, abs=0.02)
    assert counts["Qwen/Qwen3-4B"] == pytest.approx(4.41, abs=0.03)


def test_cli_prints_a_plan_and_a_search(tmp_path):
    """The command line takes launch/run.py's config overrides; a small run fits one H200, the
    reference-length voting preset does not fit a v5e-8 as configured."""
    run = lambda *a: subprocess.run([sys.executable, "-m", "marl_jax.plan", *a], cwd=ROOT, capture_output=True,
                                    text=True, timeout=120)
    out = run("--config=configs/voting.py:qwen3-0.6b,math", "--chip=H200", "--json",
              "--config.rollout.max_new_tokens.generator=256", "--config.rollout.max_new_tokens.aggregator=256",
              "--config.num_tasks=8")
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert p["fits"] and p["devices"] == 1 and p["stages"][0]["rows"] == 8 * 8 * 3
    assert p["time"]["decode_s"] > 0 and p["time"]["update_s"] > 0
    out = run("--config=configs/voting.py:qwen3-4b,math", "--chip=v5e-8")
    assert out.returncode == 0, out.stderr
    assert "does NOT fit" in out.stdout and "roofline" in out.stdout
    out = run("--config=configs/voting.py:qwen3-4b,math", "--chip=v9")
    assert out.returncode != 0 and "unknown --chip" in out.stderr


def test_the_training_path_does_not_import_the_planner():
    """The planner is a leaf: the trainer and the update import neither it nor its AOT half."""
    code = ("import sys, marl_jax.train.loop, marl_jax.rl.update; "
            "bad = [m for m in ('marl_jax.plan', 'marl_jax.plan_aot') if m in sys.modules]; "
            "assert not bad, bad; from marl_jax.train.loop import parallel_copies; "
            "from marl_jax.rl.update import remat_for")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _preset(wf="voting", arg="qwen3-1.7b,math", **over):
    from marl_jax.configs import get_config
    c = get_config(wf, arg)
    for k, v in over.items():
        sec, key = k.split("__")
        c[sec][key] = v
    return c


def test_reference_lengths_have_no_quadratic_term():
    """voting:qwen3-1.7b,math on a v5p-8 counted 1.7 TB from a [T, T] prefill; chunked prefill and linear
    attention leave the KV cache as what does not fit, and the plan prints a KV budget that does. (On TPU the
    cache is paged: a refill prefills every admitted row's prompt cache beside the distinct prompts', 224 GiB
    here without a token cap; with the budget the plan caps it by rollout.max_batched_tokens.)"""
    p = P.plan(_preset(), "v5p-8", search_chips=False)
    m = p["memory"]
    assert m["prefill_transient"] < 300 * P.GiB and m["activations"] < 40 * P.GiB
    assert not p["fits"] and m["kv_cache"] > 100 * P.GiB
    f = p["smallest_fit"]
    assert "--config.rollout.kv_budget_gb=" in f["flags"] and "--config.rollout.paged_kv=true" in f["flags"]
    assert f["memory"]["peak"] <= p["usable_per_device"] and f["kv_budget_gb"] > 10
    assert f["time"]["decode_waves"] >= p["time"]["decode_waves"]
    out = subprocess.run([sys.executable, "-m", "marl_jax.plan", "--config=configs/voting.py:qwen3-1.7b,math",
                          "--chip=v5p-8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--config.rollout.kv_budget_gb=" in out.stdout and "preemption worst case" in out.stdout


def test_kv_budget_sets_the_pool_and_the_concurrency():
    c = _preset(rollout__kv_budget_gb=8.0, rollout__paged_kv="true")
    cfg = P.model_config(c.model.name)
    w = P.workload(c)
    mesh = P.Mesh(4)
    kv, pre, B = P.kv_bytes(cfg, c, w, mesh, 256)
    assert 8 * P.GiB < kv < 8.5 * P.GiB  # the pool and one decode step's temporaries
    st = max(w.stages, key=lambda s: s.prompt)
    cc = P.budget_concurrency(cfg, c, st, mesh, 256, 8.0, 16)
    slot = P.slot_bytes(cfg, c, mesh)
    assert cc["concurrent"] == (int(8 * P.GiB // (16 * slot)) - 1) // cc["row_blocks"] * 4
    assert cc["admitted"] >= cc["concurrent"] and 0 < cc["slots_at_preemption"] <= 15872 + 5120 + 16
    k = P.Knobs(mesh, 8, "full", 256, kv_budget_gb=8.0, backend="tpu")
    t8, t32 = P.roofline(cfg, c, w, k, P.CHIPS["v5p"]), P.roofline(cfg, c, w, dataclasses.replace(k, kv_budget_gb=32.0),
                                                                   P.CHIPS["v5p"])
    assert t8["decode_waves"] > t32["decode_waves"] and t8["preempt_s"] >= t32["preempt_s"] >= 0
    # A pool that cannot hold the longest row alone is no fit.
    assert not P._row_fits(cfg, c, w, mesh, 0.5 * slot * 1000 / P.GiB)


def test_token_budget_bounds_an_item_by_tokens():
    c = _config()
    w = _workload(c)
    k = P.Knobs(P.Mesh(), 8, "full", 256)
    eight = P.activation_bytes(CFG, c, w, k)
    budget = dataclasses.replace(k, max_tokens=2 * T)
    assert P.item_rows(budget, T) == 2
    assert P.activation_bytes(CFG, c, w, budget) == P.activation_bytes(CFG, c, w, dataclasses.replace(k, micro_batch=2))
    assert P.activation_bytes(CFG, c, w, budget) < eight / 3
    assert P.item_rows(dataclasses.replace(k, max_tokens=T // 2), T) == 1  # a longer row runs alone


def test_attention_terms_are_linear_except_dense():
    from marl_jax.rl import memory
    kw = dict(rows=1, W=128, remat="full", e=2, rank=16)
    for impl in ("blockwise", "splash", "cudnn"):
        a, b = (memory.activation_bytes(CFG, T=t, impl=impl, **kw) for t in (8192, 16384))
        assert 1.9 < (b - memory.activation_bytes(CFG, T=1, impl=impl, **kw)) / (
            a - memory.activation_bytes(CFG, T=1, impl=impl, **kw)) < 2.1
    a, b = (memory.activation_bytes(CFG, T=t, impl="dense", **kw) for t in (8192, 16384))
    assert b / a > 3.5
    assert memory.attention_impl(CFG, 8192, 8192, "tpu") == "splash"
    assert memory.attention_impl(CFG, 8192, 8192, "gpu") == "cudnn"
    assert memory.attention_impl(CFG, 256, 256, "tpu") == "dense"
    # A prefill chunk against a long prompt is linear in the prompt (blockwise: the kernels take no cache chunk).
    x, y = (P.prefill_chunk_bytes(CFG, 4, 2048, p, 2) for p in (16384, 32768))
    assert y < 2.1 * x


def test_table_lists_every_preset_on_every_chip():
    rows = P.preset_rows(chips=("ref", "v5p-8"))
    assert len(rows) == 4 * 6 * 2
    assert {r["chip"] for r in rows} == {"H100-80GBx2", "H100-80GBx4", "v5p-8"}
    assert all(r["fits"] or r["knobs"] for r in rows), [r["preset"] for r in rows if not (r["fits"] or r["knobs"])]
    text = P.format_table(rows)
    first = text.split("\n\n")[0].splitlines()
    assert len(first) == 2 + 24 and first[2].startswith("| eval_opt:qwen3-0.6b,math | ")


def test_kv_dtype_sets_the_cache_bytes_as_the_sampler_stores_them():
    """rollout.kv_dtype=bfloat16 under float32 compute: the plan's bytes per cached token halve, and a KV block
    is what the sampler's pool allocates for it."""
    from marl_jax.generate.sampler import Sampler
    c = _config()
    assert c.model.dtype == "float32"
    f32 = P.slot_bytes(CFG, c, P.Mesh())
    c.rollout.kv_dtype = "bfloat16"
    bf16 = P.slot_bytes(CFG, c, P.Mesh())
    assert bf16 * 2 == f32
    assert Sampler(CFG, kv_dtype=jnp.bfloat16, kv_block=16).block_bytes() == 16 * bf16


def test_sampler_shapes_list_the_warm_up_s_windows_and_pool_by_backend():
    """On TPU with a bfloat16 pool (paged by default) each stage decodes over one window, its row's whole
    blocks (the kernel reads each row's length), in a pool of buckets.shape_pool_blocks; on CPU the dense cache's
    windows and no pool; with float32 keys and values the paged windows are the dense ones in whole blocks."""
    from marl_jax.generate import buckets

    c = base_config("orch_workers", ROLES)
    c.model.dtype = "bfloat16"
    for role in ROLES:  # long completions after short prompts: the dense cache decodes over 3 windows
        c.rollout.max_new_tokens[role] = 300
    blk = int(c.rollout.kv_block)
    c.rollout.prompt_tokens = 64
    assert any(len(st["windows"]) == 3 for st in P.sampler_shapes(c, "cpu"))
    for st in P.sampler_shapes(c, "tpu"):
        P_, Tn = st["prompt_slots"], st["new_slots"]
        assert st["windows"] == [buckets.blocks_for(P_ + Tn, blk) * blk], st
        assert st["pool_blocks"] == buckets.shape_pool_blocks(
            st["batch"], dict(P.call_shapes(c))[st["stage"]][1].distinct, P_, Tn, blk) > 0
    for st in P.sampler_shapes(c, "cpu"):
        assert st["windows"] == list(buckets.decode_windows(st["prompt_slots"], st["new_slots"])) and not st["pool_blocks"]
    c.model.dtype, c.rollout.paged_kv = "float32", "true"
    for st in P.sampler_shapes(c, "cpu"):
        P_, Tn = st["prompt_slots"], st["new_slots"]
        width = buckets.blocks_for(P_ + Tn, blk) * blk
        assert st["windows"] == sorted({buckets.pool_window(w, blk, width) for w in buckets.decode_windows(P_, Tn)})
    for st in P.sampler_shapes(c, "cpu"):  # 512-1536 rows over max_batch 256: refills of an eighth of the batch
        assert (st["batch"], st["refill_rows"], st["refill_distinct"]) == (256, 32, [1, 2, 4, 8, 16, 32]), st
    c.rollout.max_batch = 2048
    assert all(st["refill_rows"] == 0 and not st["refill_distinct"] for st in P.sampler_shapes(c, "cpu"))

