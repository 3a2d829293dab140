"""A KV budget (Sampler(kv_budget_bytes=...), rollout.kv_budget_gb): the paged pool has a fixed size, rows are
admitted while their blocks fit and, when the pool runs dry mid-decode, the last admitted rows are preempted
(blocks freed, tokens kept) and later prefilled again from prompt + generated tokens. Completions and
log-probs are those of an unbudgeted run (greedy: transformers' generate), the blocks in use never exceed the
pool (the sampler checks its bookkeeping at every host step), a row that cannot fit alone is refused before
sampling, and the episodes of a task re-prefill their prompt once."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from marl_jax.generate.sampler import Sampler, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_fixtures import left_pad  # noqa: E402
from test_continuous import long_tail_limits  # noqa: E402
from test_sampler import PAD, _torch_threads, random_prompts, teacher_forced_logp, tiny  # noqa: E402,F401


def _block_bytes(cfg, blk: int) -> int:
    return 2 * cfg.num_layers * blk * cfg.num_kv_heads * cfg.head_dim * 4


def _budgeted(cfg, blocks: int, blk: int = 4, **kw) -> Sampler:
    """A sampler whose pool holds `blocks` - 1 usable blocks (block 0 is the null block)."""
    return Sampler(cfg, pad_id=PAD, kv_block=blk, kv_budget_bytes=blocks * _block_bytes(cfg, blk),
                   check_blocks=True, **kw)


def test_greedy_under_preemption_matches_transformers(tiny):
    """12 prompts, 8 rows, a pool of about a quarter of what they need: rows are preempted several times and
    the greedy tokens are still transformers' own."""
    cfg, params, model = tiny
    prompts = random_prompts(12, cfg.vocab_size, seed=3, lo=4, hi=14)
    T = 24
    sp = SamplingParams(T, temperature=0.0)
    s = _budgeted(cfg, blocks=16, max_batch=8, prefix_cache_tokens=0)
    out = s.generate(params, prompts, jax.random.PRNGKey(0), sp)
    st = s.stats
    assert st["preemptions"] >= 3 and st["recomputed_tokens"] > 0, st
    assert st["pool_grows"] == 0
    tokens, mask, _ = left_pad(prompts, PAD)
    with torch.no_grad():
        ref = model.generate(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                             max_new_tokens=T, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    np.testing.assert_array_equal(out.tokens, ref[:, tokens.shape[1]:].numpy())


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sampled_rows_equal_unbudgeted_ones(tiny, temperature):
    """30 prompts in groups of 3 (a task's episodes) with long-tail limits and a stop token, a prefix cache:
    budgeted and unbudgeted calls give the same tokens, lengths and log-probs (1e-5), the log-probs equal the
    teacher-forced pass, and the pool never grows beyond the budget."""
    cfg, params, model = tiny
    base = random_prompts(10, cfg.vocab_size, seed=22, lo=2, hi=20)
    prompts = [p for p in base for _ in range(3)]
    limits = long_tail_limits(30, 32, seed=1)
    key = jax.random.PRNGKey(4)
    sp = SamplingParams(32, temperature=temperature, stop_ids=(5,))
    ref = Sampler(cfg, pad_id=PAD, max_batch=8, paged=True, kv_block=4).generate(params, prompts, key, sp,
                                                                                   max_new_tokens=limits)
    s = _budgeted(cfg, blocks=24, max_batch=8)
    out = s.generate(params, prompts, key, sp, max_new_tokens=limits)
    assert s.stats["preemptions"] >= 2, s.stats
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_array_equal(out.finished, ref.finished)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert s.stats["peak_kv_bytes"] <= 24 * _block_bytes(cfg, 4)
    for i, (tf_lp, _) in enumerate(teacher_forced_logp(model, prompts, out, temperature)):
        np.testing.assert_allclose(out.row(i)[1], tf_lp, atol=1e-4, rtol=0, err_msg=f"row {i}")


def test_token_cap_and_budget_with_trainable_slots(tiny):
    """max_batched_tokens limits each refill's prefill; LoRA slots (Isolated-Policy) sample each slot's own
    rows under the budget exactly as without it."""
    from marl_jax.policy.lora import PolicySpec, init_trainable

    cfg, params, _ = tiny
    spec = PolicySpec(mode="lora", rank=4, num_slots=2)
    trainable = init_trainable(spec, cfg, params, jax.random.PRNGKey(1))
    trainable = jax.tree_util.tree_map(lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(2), x.shape), trainable)
    prompts = random_prompts(16, cfg.vocab_size, seed=9, lo=3, hi=12)
    sp = SamplingParams(20, temperature=0.8)
    key = jax.random.PRNGKey(7)
    ref = Sampler(cfg, pad_id=PAD, spec=spec, max_batch=8)
    s = _budgeted(cfg, blocks=14, spec=spec, max_batch=8, max_batched_tokens=24)
    for slot in (0, 1):
        a = ref.generate(params, prompts, key, sp, trainable=trainable, slot=slot)
        b = s.generate(params, prompts, key, sp, trainable=trainable, slot=slot)
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4, rtol=0)  # LoRA: prefill vs decode order
        assert s.stats["preemptions"] >= 1 and s.stats["refills"] >= 3
    assert s.prefill_chunk == 24


def test_a_row_over_the_budget_is_refused_before_sampling(tiny):
    cfg, params, _ = tiny
    s = _budgeted(cfg, blocks=4, max_batch=8)
    with pytest.raises(ValueError, match=r"needs \d+ KV blocks .* raise --config.rollout.kv_budget_gb to at least"):
        s.generate(params, [[1, 2, 3]], jax.random.PRNGKey(0), SamplingParams(64))
    assert s.stats["decode_steps"] == 0 and s.stats["prefill_rows"] == 0


def test_episodes_share_their_prompt_when_prefilled_again(tiny):
    """8 episodes of one long prompt, preempted together: their prompt is prefilled once per re-admission, not
    once per episode (recomputed tokens = the prompt per re-admission + each row's own tokens)."""
    cfg, params, _ = tiny
    prompt = random_prompts(1, cfg.vocab_size, seed=1, lo=40, hi=41)[0]
    s = _budgeted(cfg, blocks=40, max_batch=8, prefix_cache_tokens=0, min_batch=1)
    sp = SamplingParams(24, temperature=1.0)
    out = s.generate(params, [prompt] * 8, jax.random.PRNGKey(3), sp)
    ref = Sampler(cfg, pad_id=PAD, max_batch=8, prefix_cache_tokens=0, min_batch=1).generate(
        params, [prompt] * 8, jax.random.PRNGKey(3), sp)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    st = s.stats
    assert st["preemptions"] >= 2 and st["resumed_rows"] > st["resume_prefills"], st
    assert st["recomputed_prompt_tokens"] == st["resume_prefills"] * len(prompt), st


def test_budgeted_calls_under_a_call_shape_compile_nothing_after_the_warm_up(tiny):
    """Under a KV budget and a CallShape over max_batch, the pool is the budget's one size, the first rows fill
    the whole batch and later admissions run in refill chunks, whatever the free blocks let in: calls that
    preempt no row compile nothing after the warm-up (a preempted row's prefill of its tokens compiles when
    met) and sample what an unbudgeted batch of every row samples."""
    from marl_jax.generate import buckets
    from marl_jax.generate.types import CallShape
    from marl_jax.train import compiles

    cfg, params, _ = tiny
    shape = CallShape(rows=48, distinct=12, prompt=48)
    s = _budgeted(cfg, blocks=60, blk=8, max_batch=16, min_batch=2, prefix_cache_tokens=1024)
    whole = Sampler(cfg, pad_id=PAD, max_batch=64, min_batch=2, prefix_cache_tokens=1024)
    sp = SamplingParams(24, temperature=0.9)
    P, Tn = Sampler.prompt_region(shape), buckets.length_bucket(24)
    assert s.pool_blocks(16, P, Tn, shape) == 60 < buckets.shape_pool_blocks(16, 12, P, Tn, 8)  # the budget binds
    assert s.warmup(params, sp, shape) > 0
    rng = np.random.RandomState(5)
    system = rng.randint(0, cfg.vocab_size, 20).tolist()
    calls, fill = [], 0.0
    for r in range(3):
        n = 48 - 8 * (r % 2)
        tasks = random_prompts(12, cfg.vocab_size, seed=40 + r, lo=4, hi=20)
        prompts = [system + tasks[i // 4] for i in range(n)]
        limits = long_tail_limits(n, 24, seed=r)
        key = jax.random.PRNGKey(r)
        before = compiles.snapshot()
        out = s.generate(params, prompts, key, sp, max_new_tokens=limits, shape=shape)
        calls.append((compiles.since(before)["all"].programs, s.stats["preemptions"]))
        fill = max(fill, s.stats["peak_kv_live_bytes"] / s.stats["peak_kv_bytes"])
        assert s.stats["refills"] > 0 and s.stats["pool_grows"] == 0
        ref = whole.generate(params, prompts, key, sp, max_new_tokens=limits)
        np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=f"call {r}")
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    later = [c for c, preempted in calls[1:] if not preempted]
    assert len(later) >= 2 and not any(later), calls
    assert fill >= 0.9, fill  # admissions waited for blocks: the pool ran nearly full
