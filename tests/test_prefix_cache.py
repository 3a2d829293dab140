"""Prefix reuse across sampler calls: a prompt extending an earlier call's prompt + completion loads that
prefix's keys and values instead of prefilling it. Completions equal a sampler without the cache, log-probs
equal transformers' teacher-forced pass, the cache empties on new parameters and stays within its blocks."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from marl_jax.generate.sampler import PrefixCache, Sampler, SamplingParams
from marl_jax.models import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_sampler import (HEAD_SCALE, PAD, _torch_threads, random_prompts,  # noqa: E402,F401
                          teacher_forced_logp, tiny)  # shared fixtures


@pytest.fixture(scope="module")
def plain(tiny):
    """The reference: no prefix cache, no shared-prefix prefill."""
    return Sampler(tiny[0], pad_id=PAD, prefix_cache_tokens=0, share_prefix=False)


def rounds(sampler, params, prompts, key, sp, n_rounds=3, seed=0):
    """Calls whose prompts extend the previous call's prompt + completion by a few new tokens (an eval_opt
    round after the previous one); returns each call's (prompts, output, stats)."""
    rng = np.random.RandomState(seed)
    out = []
    for r in range(n_rounds):
        res = sampler.generate(params, prompts, jax.random.fold_in(key, r), sp)
        out.append((prompts, res, dict(sampler.stats)))
        prompts = [p + res.row(i)[0] + rng.randint(0, 50, 3).tolist() for i, p in enumerate(prompts)]
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_extending_prompts_load_the_cached_prefix(tiny, plain, temperature):
    cfg, params, model = tiny
    sampler = Sampler(cfg, pad_id=PAD)
    prompts = random_prompts(5, cfg.vocab_size, seed=3, lo=18, hi=40)
    sp = SamplingParams(max_new_tokens=16, temperature=temperature)
    key = jax.random.PRNGKey(5)
    got = rounds(sampler, params, prompts, key, sp)
    ref = rounds(plain, params, prompts, key, sp)
    for r, ((p, a, st), (_, b, _)) in enumerate(zip(got, ref)):
        np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"round {r}")
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert st["prefill_tokens"] == st["prompt_tokens"] - st["cached_tokens"]
        if r:  # every row found at least the blocks of its previous prompt
            assert st["cached_tokens"] >= sum(len(x) // 16 * 16 for x in got[r - 1][0])
        for i, (tf_lp, _) in enumerate(teacher_forced_logp(model, p, a, temperature)):
            np.testing.assert_allclose(a.row(i)[1], tf_lp, atol=1e-4, rtol=0, err_msg=f"round {r} row {i}")
    assert got[0][2]["cached_tokens"] == 0 and got[-1][2]["cached_tokens"] > 0.5 * got[-1][2]["prompt_tokens"]


def test_new_params_empty_the_cache(tiny, plain):
    cfg, params, _ = tiny
    sampler = Sampler(cfg, pad_id=PAD)
    prompts = random_prompts(4, cfg.vocab_size, seed=8, lo=20, hi=36)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    sampler.generate(params, prompts, jax.random.PRNGKey(0), sp)
    sampler.generate(params, prompts, jax.random.PRNGKey(0), sp)
    assert sampler.stats["cached_tokens"] > 0
    # An update: other values in another object. Nothing cached under the old parameters may be used.
    new = jax.tree_util.tree_map(lambda x: x * 1.01, params)
    a = sampler.generate(new, prompts, jax.random.PRNGKey(0), sp)
    assert sampler.stats["cached_tokens"] == 0
    b = plain.generate(new, prompts, jax.random.PRNGKey(0), sp)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_small_cache_evicts_and_changes_nothing(tiny, plain):
    """A 4-block cache over calls whose sequences need more: least recently used blocks are reused, the
    cache never holds more than its blocks, and completions equal the plain sampler's."""
    cfg, params, _ = tiny
    sampler = Sampler(cfg, pad_id=PAD, prefix_cache_tokens=64)
    prompts = random_prompts(6, cfg.vocab_size, seed=9, lo=17, hi=40)
    sp = SamplingParams(max_new_tokens=16, temperature=0.8)
    got = rounds(sampler, params, prompts, jax.random.PRNGKey(3), sp, n_rounds=3, seed=1)
    ref = rounds(plain, params, prompts, jax.random.PRNGKey(3), sp, n_rounds=3, seed=1)
    for (_, a, _), (_, b, _) in zip(got, ref):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    pc = sampler.prefix_cache
    assert len(pc.nodes) + len(pc.free) == pc.num_blocks == 4
    assert pc.k.shape[-1] == 64 and pc.nbytes == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 64 * 4


def test_block_trie_lru_by_hand(tiny):
    """Worked by hand: 4 blocks of 2 tokens. A = 7 tokens stores 3 blocks (a0 a1 a2), B = 4 tokens needs 2:
    one is free, the other is A's least recently used block, its tail a2. A then finds a0 a1 only; a
    prompt equal to a stored sequence leaves its last token uncached; another slot finds nothing."""
    pc = PrefixCache(tiny[0], num_blocks=4, block=2)
    A, B = [1, 2, 3, 4, 5, 6, 7], [9, 9, 8, 8]
    a = pc.reserve(0, A, set())
    assert [s for s, _ in a] == [0, 2, 4]
    assert pc.lookup(0, A + [0]) == [blk for _, blk in a]
    b = pc.reserve(0, B, set())
    assert [s for s, _ in b] == [0, 2] and b[1][1] == a[2][1]
    assert pc.lookup(0, A + [0]) == [a[0][1], a[1][1]]
    assert pc.lookup(0, B) == [b[0][1]]  # 4 tokens: the last one must be computed
    assert pc.lookup(1, A) == []
    assert pc.reserve(0, A[:4], set()) == []  # already held
    pc.bind("params", None)
    assert pc.lookup(0, A) == [] and len(pc.free) == 4
    with pytest.raises(ValueError, match="num_blocks"):
        PrefixCache(tiny[0], num_blocks=0)


def test_hits_under_a_call_shape_run_warmed_programs_only(tiny, plain):
    """Under a CallShape a call loading hits takes one of a fixed set of cached regions (hits past it are
    prefilled again): after the warm-up, rounds whose hits grow compile nothing and sample what a sampler
    without the cache samples."""
    from marl_jax.generate import buckets
    from marl_jax.generate.types import CallShape
    from marl_jax.train import compiles

    cfg, params, _ = tiny
    sampler = Sampler(cfg, pad_id=PAD, share_prefix=False)
    sp = SamplingParams(max_new_tokens=16, temperature=0.8)
    prompts = random_prompts(5, cfg.vocab_size, seed=4, lo=18, hi=40)
    shape = CallShape(rows=5, distinct=5, prompt=40 + 3 * (16 + 3))  # the longest prompt of the last round
    sampler.warmup(params, sp, shape)
    key, rng = jax.random.PRNGKey(6), np.random.RandomState(1)
    regions = buckets.cached_regions(sampler.prompt_region(shape), 16)
    seen, compiled = [], 0
    for r in range(4):
        lay = sampler.layout(prompts, 0, shape)
        seen.append(lay.C)
        assert lay.C in (0, *regions) and lay.C + lay.S == sampler.prompt_region(shape)
        k = jax.random.fold_in(key, r)
        before = compiles.snapshot()
        got = sampler.generate(params, prompts, k, sp, shape=shape)
        compiled += compiles.since(before)["all"].programs
        ref = plain.generate(params, prompts, k, sp)
        np.testing.assert_array_equal(got.tokens, ref.tokens, err_msg=f"round {r}")
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        prompts = [p + got.row(i)[0] + rng.randint(0, 50, 3).tolist() for i, p in enumerate(prompts)]
    assert seen[0] == 0 and all(seen[1:]), seen  # every later round loads hits
    assert compiled == 0


def test_cached_regions_and_hit_region_by_hand():
    from marl_jax.generate import buckets

    assert buckets.cached_regions(128, 16) == (64, 96)
    assert buckets.cached_regions(48, 16) == (16, 32)  # 24 and 36 rounded down to whole blocks
    assert buckets.cached_regions(16, 16) == ()  # no whole block fits: hits load nothing
    p = lambda n: [1] * n
    # 100 tokens, 80 of them cached: C=96 leaves 32 slots for 100 - 80 = 20 tokens
    assert buckets.hit_region([p(100)], [80], 128, 16) == 96
    # a second prompt with 16 cached: 90 - 16 = 74 tokens need C <= 54: none of 64/96 (64 leaves 64 slots)
    assert buckets.hit_region([p(100), p(90)], [80, 16], 128, 16) == 0
    # with 32 cached: 58 tokens fit after C=64; the first prompt's hits are cut to 64 (36 tokens prefilled)
    assert buckets.hit_region([p(100), p(90)], [80, 32], 128, 16) == 64


def test_a_stage_s_first_call_sets_its_shared_prefix_even_when_it_finds_hits(tiny, plain):
    """A validation call stores sequences the first training call then finds (same parameters): that first
    call still prefills its shared prefix, so the program a later call without hits (new parameters) runs is
    compiled in the first step, not in a later one."""
    from marl_jax.generate.types import CallShape
    from marl_jax.train import compiles

    cfg, params, _ = tiny
    params = jax.tree_util.tree_map(lambda x: x * 1.0, params)  # made as the update below makes its parameters
    sampler = Sampler(cfg, pad_id=PAD)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    rng = np.random.RandomState(2)
    head = rng.randint(0, cfg.vocab_size, 40).tolist()  # a role's instructions: every prompt starts with them
    prompts = lambda n: [head + rng.randint(0, cfg.vocab_size, rng.randint(4, 12)).tolist() for _ in range(n)]
    shape = CallShape(rows=4, distinct=4, prompt=64)
    sampler.warmup(params, sp, shape)
    sampler.generate(params, prompts(6), jax.random.PRNGKey(0), sp, shape=CallShape(6, 6, 64))  # "validation"
    first = prompts(4)
    assert any(sampler.prefix_cache.lookup(0, p) for p in first)  # the first call would find hits
    sampler.generate(params, first, jax.random.PRNGKey(1), sp, shape=shape)
    assert sampler.stats["cached_tokens"] == 0 and sampler.prefix_lens[(0, shape)] == 32  # its shared prefix
    new = jax.tree_util.tree_map(lambda x: x * 1.01, params)  # an update: the cache empties
    later = prompts(4)
    before = compiles.snapshot()
    got = sampler.generate(new, later, jax.random.PRNGKey(2), sp, shape=shape)
    assert compiles.since(before)["all"].programs == 0
    np.testing.assert_array_equal(got.tokens, plain.generate(new, later, jax.random.PRNGKey(2), sp).tokens)
