"""The paged KV cache (Sampler(paged=True)): rows hold blocks of one shared pool only where they have tokens.
Same completions as the dense cache (greedy against transformers' generate is in tests/test_continuous.py),
sampled log-probs equal to the dense cache's and to a teacher-forced pass, the prefix cache filled from and
loaded into blocks, the pool grown when rows need more blocks, and the blocks in use bounded by the live rows'
tokens rather than rows x maximum length."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from marl_jax.generate.sampler import Sampler, SamplingParams, length_bucket

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_continuous import long_tail_limits  # noqa: E402
from test_sampler import PAD, _torch_threads, random_prompts, teacher_forced_logp, tiny  # noqa: E402,F401


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_paged_equals_dense_with_prefix_reuse(tiny, temperature):
    """30 prompts with a stop token, then 30 prompts extending the first call's sequences (their prefixes come
    from the prefix cache, stored from paged blocks): paged and dense give the same tokens, log-probs within
    1e-5, and the paged log-probs equal the teacher-forced pass."""
    cfg, params, model = tiny
    prompts = random_prompts(30, cfg.vocab_size, seed=22, lo=1, hi=24)
    limits = long_tail_limits(30, 24, seed=1)
    key = jax.random.PRNGKey(4)
    dense = Sampler(cfg, pad_id=PAD, max_batch=8, prefix_cache_tokens=2048)
    paged = Sampler(cfg, pad_id=PAD, max_batch=8, prefix_cache_tokens=2048, paged=True, kv_block=8)
    first = dense.generate(params, prompts, key, SamplingParams(24, temperature=temperature), max_new_tokens=limits)
    np.testing.assert_array_equal(paged.generate(params, prompts, key, SamplingParams(24, temperature=temperature),
                                                 max_new_tokens=limits).tokens, first.tokens)
    sp = SamplingParams(24, temperature=temperature, stop_ids=(int(first.tokens[2, 5]),))
    ext = [p + first.row(i)[0] + [3, 4] for i, p in enumerate(prompts)]
    for batch in (prompts, ext):
        ref = dense.generate(params, batch, key, sp, max_new_tokens=limits)
        out = paged.generate(params, batch, key, sp, max_new_tokens=limits)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_array_equal(out.lengths, ref.lengths)
        np.testing.assert_array_equal(out.finished, ref.finished)
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        assert paged.stats["refills"] >= 3
    assert paged.stats["cached_tokens"] > 0 and paged.stats["cached_tokens"] == dense.stats["cached_tokens"]
    for i, (tf_lp, _) in enumerate(teacher_forced_logp(model, ext, out, temperature)):
        np.testing.assert_allclose(out.row(i)[1], tf_lp, atol=1e-4, rtol=0, err_msg=f"row {i}")


def test_pool_grows_and_blocks_follow_live_tokens(tiny):
    """60 prompts through 8 rows; the three with the longest prompts (so they start together) run to 64 tokens,
    the rest stop within 4. The pool starts with the first rows' prompt blocks and a block of growth per row,
    and grows; the blocks held at once stay within the live rows' prompt blocks and a block of growth each,
    plus the long rows' completions (55% of the dense cache of the same 8 rows here); and no block leaks (the
    sampler checks that every block is free or held by one row at the end of a call)."""
    cfg, params, _ = tiny
    prompts = random_prompts(60, cfg.vocab_size, seed=5, lo=1, hi=12)
    T, blk, B = 64, 4, 8
    longest = set(np.argsort([-len(p) for p in prompts], kind="stable")[:3].tolist())
    short = np.random.RandomState(1).randint(1, 5, 60)
    limits = [T if i in longest else int(short[i]) for i in range(60)]
    key, sp = jax.random.PRNGKey(2), SamplingParams(T, temperature=0.0)
    paged = Sampler(cfg, pad_id=PAD, max_batch=B, min_batch=1, paged=True, kv_block=blk, prefix_cache_tokens=0)
    out = paged.generate(params, prompts, key, sp, max_new_tokens=limits)
    ref = Sampler(cfg, pad_id=PAD, max_batch=B, min_batch=1, prefix_cache_tokens=0).generate(
        params, prompts, key, sp, max_new_tokens=limits)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    st = paged.stats
    assert st["pool_grows"] >= 1 and st["refills"] >= 5
    L, H, hd = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    block_bytes = 2 * L * blk * H * hd * 4
    P, Tn = length_bucket(max(map(len, prompts))), length_bucket(T)
    bound = B * (-(-P // blk) + 1) + 3 * (T // blk)
    assert 0 < st["peak_kv_live_bytes"] <= bound * block_bytes, (st["peak_kv_live_bytes"], bound * block_bytes)
    dense_bytes = 2 * L * B * H * hd * (P + Tn) * 4
    assert bound * block_bytes * 100 <= dense_bytes * 55


def test_trainer_with_paged_kv_takes_the_same_first_step(prompt_dir, tmp_path):
    """rollout.paged_kv reaches the trainer's sampler: one step of the tiny Isolated-Policy voting run samples
    the same episodes (same rewards) and takes the same update with the paged cache as with the dense one."""
    from marl_jax.models.tiny import tiny_model
    from marl_jax.train.loop import Trainer
    from test_learning import digit_tasks, learning_config, tiny_tokenizer

    out = []
    for paged in (False, True):
        c = learning_config("isolated", prompt_dir)
        c.num_tasks, c.rollout.group_size = 4, 4
        c.task.update(size=40, val_size=4)
        c.rollout.update(paged_kv=str(paged).lower(), kv_block=8)
        c.train.update(steps=1, val_every=10, ckpt_every=10, warmup=False)
        t = Trainer(c, str(tmp_path / str(paged)), model=tiny_model(tiny_tokenizer(), seed=1), tasks=digit_tasks(44),
                    progress=False)
        assert t.rt.sampler.paged is paged
        rec = t.train_step(0)
        out.append(rec)
    for k in ("loss", "reward_mean"):
        assert k in out[0], sorted(out[0])
        np.testing.assert_allclose(out[0][k], out[1][k], rtol=1e-5, err_msg=k)


def test_pool_at_the_dense_bound_when_every_row_runs_to_its_limit(tiny):
    """Every row runs to the limit: the pool grows up to (never past) the dense cache's slots plus the null
    block, every row finds its blocks, and the tokens equal the dense cache's."""
    cfg, params, _ = tiny
    prompts = random_prompts(8, cfg.vocab_size, seed=9, lo=13, hi=16)
    key, sp = jax.random.PRNGKey(3), SamplingParams(64, temperature=0.0)
    paged = Sampler(cfg, pad_id=PAD, max_batch=8, paged=True, kv_block=4, prefix_cache_tokens=0)
    out = paged.generate(params, prompts, key, sp)
    dense = Sampler(cfg, pad_id=PAD, max_batch=8, prefix_cache_tokens=0)
    ref = dense.generate(params, prompts, key, sp)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert (out.lengths == 64).all() and paged.stats["pool_grows"] >= 1
    block_bytes = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    assert dense.stats["peak_kv_bytes"] < paged.stats["peak_kv_bytes"] <= dense.stats["peak_kv_bytes"] + block_bytes


def test_episodes_of_a_task_share_their_prompt_blocks(tiny):
    """4 tasks x 4 episodes (sampled, so the episodes differ) through 8 rows: rows with the same prompt hold
    its whole blocks once, also when they are admitted in different refills, and the tokens and log-probs are
    the dense cache's. 16 distinct prompts of the same lengths hold 8 rows' prompts in full."""
    cfg, params, _ = tiny
    tasks = random_prompts(4, cfg.vocab_size, seed=11, lo=40, hi=40)
    shared = [p for p in tasks for _ in range(4)]
    distinct = random_prompts(16, cfg.vocab_size, seed=12, lo=40, hi=40)
    key, sp = jax.random.PRNGKey(6), SamplingParams(6, temperature=0.9)
    limits = [6, 2, 4, 3] * 4
    peak = {}
    for name, prompts in (("shared", shared), ("distinct", distinct)):
        paged = Sampler(cfg, pad_id=PAD, max_batch=8, min_batch=1, paged=True, kv_block=4, prefix_cache_tokens=0)
        out = paged.generate(params, prompts, key, sp, max_new_tokens=limits)
        ref = Sampler(cfg, pad_id=PAD, max_batch=8, min_batch=1, prefix_cache_tokens=0).generate(
            params, prompts, key, sp, max_new_tokens=limits)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        assert paged.stats["refills"] >= 1
        peak[name] = paged.stats["peak_kv_live_bytes"]
    # A 40-token prompt fills 10 blocks of 4 before slot P = 48, a completion 1 or 2 more: 8 rows of distinct
    # prompts hold at least 8 x 11 blocks at once; shared ones at most 4 tasks x 10 + 8 x 2 (refills mix tasks).
    block_bytes = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    assert peak["distinct"] >= 8 * 11 * block_bytes and peak["shared"] <= (4 * 10 + 8 * 2) * block_bytes, peak


def test_bfloat16_kv_under_float32_compute(tiny):
    """kv_dtype=bfloat16 with float32 compute (rollout.kv_dtype): the pool and the prefix cache hold bfloat16,
    half the bytes of a float32 pool grown the same way, and the sampled tokens' log-probs are transformers'
    float32 teacher-forced ones to bfloat16 accuracy (keys and values rounded once, read back in float32)."""
    import jax.numpy as jnp
    cfg, params, model = tiny
    prompts = random_prompts(20, cfg.vocab_size, seed=9, lo=2, hi=30)
    sp = SamplingParams(20, temperature=0.0)
    run = {}
    for name, kv in (("f32", None), ("bf16", jnp.bfloat16)):
        s = Sampler(cfg, pad_id=PAD, max_batch=8, paged=True, kv_block=8, kv_dtype=kv, check_blocks=True)
        run[name] = (s.generate(params, prompts, jax.random.PRNGKey(0), sp), s)
    out, s = run["bf16"]
    assert s.stats["peak_kv_bytes"] * 2 == run["f32"][1].stats["peak_kv_bytes"]
    assert s.prefix_cache.k.dtype == jnp.bfloat16
    for i, (tf_lp, _) in enumerate(teacher_forced_logp(model, prompts, out, 0.0)):
        np.testing.assert_allclose(out.row(i)[1], tf_lp, atol=3e-2, rtol=0, err_msg=f"row {i}")
    err = np.abs(out.logprobs[:, 0] - run["f32"][0].logprobs[:, 0]).max()  # the first token: the same context
    assert 0 < err < 3e-2, err  # rounded keys and values, not the float32 cache


def test_paged_calls_under_a_call_shape_run_warmed_programs_only(tiny):
    """Under a CallShape the paged pool takes one size (the shape's full pool, no growth) and the first rows fill
    the whole batch, so Sampler.warmup compiles every program a call runs: calls with long-tailed completions
    and prefix-cache hits compile nothing after it and sample what the dense cache samples."""
    from marl_jax.generate.types import CallShape
    from marl_jax.train import compiles

    cfg, params, _ = tiny
    shape = CallShape(rows=16, distinct=4, prompt=40)
    paged = Sampler(cfg, pad_id=PAD, max_batch=16, min_batch=2, paged=True, kv_block=8, prefix_cache_tokens=1024)
    dense = Sampler(cfg, pad_id=PAD, max_batch=16, min_batch=2, prefix_cache_tokens=1024)
    sp = SamplingParams(24, temperature=0.9)
    assert paged.warmup(params, sp, shape) > 0
    dense.warmup(params, sp, shape)
    rng = np.random.RandomState(3)
    heads = random_prompts(4, cfg.vocab_size, seed=8, lo=6, hi=20)
    sizes, compiled = set(), 0
    for r in range(3):
        n = 16 - 4 * r  # fewer rows than the shape's: padded up to it
        tails = [rng.randint(0, cfg.vocab_size, 2).tolist() for _ in range(4)]
        prompts = [heads[i % 4] + tails[i % 4] for i in range(n)]  # 4 tasks' episodes
        limits = long_tail_limits(n, 24, seed=r)
        key = jax.random.PRNGKey(r)
        before = compiles.snapshot()
        out = paged.generate(params, prompts, key, sp, max_new_tokens=limits, shape=shape)
        compiled += compiles.since(before)["all"].programs
        sizes.add(paged.stats["peak_kv_bytes"])
        assert paged.stats["pool_grows"] == 0 and paged.stats["compactions"] > 0
        assert (paged.stats["cached_tokens"] > 0) == (r > 0)  # later rounds load prefix-cache hits
        ref = dense.generate(params, prompts, key, sp, max_new_tokens=limits, shape=shape)
        np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=f"round {r}")
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        heads = [prompts[i] + out.row(i)[0][:3] for i in range(4)]  # later rounds extend earlier sequences
    assert compiled == 0
    assert len(sizes) == 1  # one pool size


def test_prompts_over_a_call_shape_still_sample_and_name_the_knob_once(tiny, caplog):
    """A call whose prompts outgrow its CallShape's prompt region runs (compiling what it needs, not refused)
    and says once per shape which setting keeps such calls in the warm-up's programs."""
    from marl_jax.generate.types import CallShape

    cfg, params, _ = tiny
    shape = CallShape(rows=4, distinct=4, prompt=8)
    s = Sampler(cfg, pad_id=PAD, max_batch=4, min_batch=2)
    sp = SamplingParams(6, temperature=0.0)
    prompts = random_prompts(4, cfg.vocab_size, seed=2, lo=30, hi=40)
    ref = Sampler(cfg, pad_id=PAD, max_batch=4, min_batch=2).generate(params, prompts, jax.random.PRNGKey(0), sp)
    with caplog.at_level("WARNING", logger="marl_jax.generate.sampler"):
        for _ in range(2):
            out = s.generate(params, prompts, jax.random.PRNGKey(0), sp, shape=shape)
            np.testing.assert_array_equal(out.tokens, ref.tokens)
    said = [r.getMessage() for r in caplog.records if "rollout.prompt_tokens" in r.getMessage()]
    longest = max(len(p) for p in prompts)
    assert len(said) == 1 and f"a prompt of {longest} tokens" in said[0] and f"by {longest - 8}" in said[0], said


@pytest.mark.parametrize("paged, prefix_cache", [(False, 1024), (True, 0)])
def test_refilling_calls_under_a_call_shape_compile_nothing_after_the_first(tiny, paged, prefix_cache):
    """A CallShape over max_batch refills: its refills run in chunks of one size (buckets.refill_rows) with
    their distinct prompts at a few sizes, which the warm-up compiles (at each prefix-cache region) and the first
    call compiles for the shared prefix it sets. Calls after the first compile nothing, and sample what one
    batch holding every row samples."""
    from marl_jax.generate.types import CallShape
    from marl_jax.train import compiles

    cfg, params, _ = tiny
    shape = CallShape(rows=48, distinct=12, prompt=48)
    kw = dict(pad_id=PAD, min_batch=2, prefix_cache_tokens=prefix_cache)
    s = Sampler(cfg, max_batch=16, paged=paged, kv_block=8, **kw)
    whole = Sampler(cfg, max_batch=64, **kw)  # every row in one batch: no refill
    sp = SamplingParams(24, temperature=0.9)
    assert s.warmup(params, sp, shape) > 0
    rng = np.random.RandomState(5)
    system = rng.randint(0, cfg.vocab_size, 20).tolist()  # a prefix every prompt shares (the first call sets it)
    compiled = []
    for r in range(3):
        n = 48 - 8 * r
        tasks = random_prompts(12, cfg.vocab_size, seed=20 + r, lo=4, hi=20)
        prompts = [system + tasks[i // 4] for i in range(n)]  # 4 episodes per task, in order
        limits = long_tail_limits(n, 24, seed=r)
        key = jax.random.PRNGKey(r)
        before = compiles.snapshot()
        out = s.generate(params, prompts, key, sp, max_new_tokens=limits, shape=shape)
        compiled.append(compiles.since(before)["all"].programs)
        assert s.stats["refills"] > 0
        if paged:
            assert s.stats["pool_grows"] == 0
        ref = whole.generate(params, prompts, key, sp, max_new_tokens=limits)
        np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=f"round {r}")
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert compiled[1:] == [0, 0], compiled
