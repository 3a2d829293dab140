"""The batched sampler: greedy parity with transformers' generate, log-probs against a teacher-forced pass,
randomness keyed per row, per-row limits and stops, top-k / top-p, and a bounded number of compiled programs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import left_pad
from marl_jax.generate.buckets import batch_bucket, next_smaller_bucket
from marl_jax.generate.sampling import sample_tokens
from marl_jax.generate.sampler import SampleOutput, Sampler, SamplingParams
from marl_jax.models import decoder, hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HEAD_SCALE = 20.0  # tiny random models have near-uniform logits; a scaled head gives peaked, tie-free ones


@pytest.fixture(scope="module", autouse=True)
def _torch_threads(torch_threads):
    with torch_threads():
        yield


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    """(cfg, params, transformers model) of one tiny Llama checkpoint, its LM head scaled in both."""
    path = tiny_ckpt("llama", tie=False, num_kv_heads=2)
    cfg, params = hf.load_hf_dir(path)
    params = jax.device_put({**params, "lm_head": params["lm_head"] * HEAD_SCALE})
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return cfg, params, model


PAD = 7
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
SAMPLE = SamplingParams(max_new_tokens=16, temperature=1.0)


@pytest.fixture(scope="module")
def sampler(tiny):
    """One sampler for the tiny model, shared so that tests reuse its compiled programs."""
    return Sampler(tiny[0], pad_id=PAD)


@pytest.fixture(scope="module")
def sampler_chunked(tiny):
    """Chunks of at most 8 rows and no compaction: must give what `sampler` gives."""
    return Sampler(tiny[0], pad_id=PAD, compaction=False, max_batch=8)


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 1, hi: int = 16) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, rng.randint(lo, hi + 1)).tolist() for _ in range(n)]


def teacher_forced_logp(model, prompts, out: SampleOutput, temperature: float):
    """Per row: transformers' log-softmax(logits / temperature) of each sampled token given everything before
    it, and the full next-token distributions (for truncation checks)."""
    seqs = [p + out.row(i)[0] for i, p in enumerate(prompts)]
    tokens, mask, pos = left_pad(seqs, pad_id=0)
    with torch.no_grad():
        logits = model(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                       position_ids=torch.tensor(pos)).logits.double().numpy()
    T = tokens.shape[1]
    rows = []
    for i, p in enumerate(prompts):
        n = int(out.lengths[i])
        start = T - len(seqs[i]) + len(p) - 1  # column whose logits predict the first sampled token
        lg = logits[i, start:start + n] / (temperature or 1.0)
        lp = lg - np.logaddexp.reduce(lg, axis=-1, keepdims=True)
        rows.append((lp[np.arange(n), out.row(i)[0]], lp))
    return rows


# --------------------------------------------------------------------- greedy parity on real weights

def test_greedy_matches_transformers_generate(smollm, chat_prompts, smollm_hf_export):
    """16 chat prompts of mixed lengths, left-padded in one batch, 64 new tokens, chat stop ids: token for
    token what transformers' generate(do_sample=False) produces on the same weights."""
    tok = smollm.tokenizer
    stops = tuple(tok.eos_token_ids)
    assert len(chat_prompts) >= 16 and len({len(p) for p in chat_prompts}) > 5
    sp = SamplingParams(max_new_tokens=64, temperature=0.0, stop_ids=stops)
    sampler = Sampler(smollm.cfg, pad_id=tok.pad_id)
    out = sampler.generate(jax.device_put(smollm.params), chat_prompts, jax.random.PRNGKey(0), sp)

    tokens, mask, _ = left_pad(chat_prompts, tok.pad_id)
    with torch.no_grad():
        gen = smollm_hf_export.generate(
            torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)), max_new_tokens=64,
            do_sample=False, eos_token_id=list(stops), pad_token_id=tok.pad_id, output_logits=True,
            return_dict_in_generate=True)
    ref_tokens = gen.sequences[:, tokens.shape[1]:].numpy()
    ref_lp = torch.log_softmax(torch.stack(gen.logits, 1).double(), -1).numpy()
    for i in range(len(chat_prompts)):
        ref = ref_tokens[i].tolist()
        n = next((k + 1 for k, t in enumerate(ref) if t in stops), len(ref))
        ids, lps = out.row(i)
        assert ids == ref[:n], f"row {i}: {tok.decode(ids)!r} != {tok.decode(ref[:n])!r}"
        assert bool(out.finished[i]) == (ref[n - 1] in stops)
        np.testing.assert_allclose(lps, ref_lp[i, np.arange(n), ref[:n]], atol=1e-3, rtol=0)
        assert np.all(out.tokens[i, n:] == tok.pad_id)
    # The batch really mixed rows that stopped with rows that ran to the limit, and the chat template's shared
    # system prompt was prefilled once.
    assert out.finished.any() and not out.finished.all() and sampler.stats["compactions"] >= 1
    assert sampler.stats["prefill_tokens"] < sampler.stats["prompt_tokens"]


# ------------------------------------------------------------------------------ log-probs, truncation

@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 0.9, 0), (0.7, 1.0, 5), (0.0, 1.0, 0)])
def test_logprobs_equal_teacher_forced_pass(tiny, sampler, temperature, top_p, top_k):
    cfg, params, model = tiny
    prompts = random_prompts(6, cfg.vocab_size, seed=1)
    sp = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=top_p, top_k=top_k)
    out = sampler.generate(params, prompts, jax.random.PRNGKey(7), sp)
    assert np.all(out.lengths == 16)
    for i, (tf_lp, dists) in enumerate(teacher_forced_logp(model, prompts, out, temperature)):
        ids, lps = out.row(i)
        np.testing.assert_allclose(lps, tf_lp, atol=1e-4, rtol=0, err_msg=f"row {i}")
        probs = np.exp(dists)
        for j, t in enumerate(ids):
            if temperature == 0.0:
                assert t == int(np.argmax(probs[j]))
            if top_k:
                assert np.sum(probs[j] > probs[j, t]) < top_k
            if top_p < 1.0:  # the token lies in the nucleus: less than top_p of the mass ranks above it
                above = probs[j] > probs[j, t]
                if top_k:  # top-p applies to the top-k survivors, renormalised
                    mass = np.sort(probs[j])[::-1][:top_k].sum()
                    assert probs[j][above].sum() / mass < top_p + 1e-6
                else:
                    assert probs[j][above].sum() < top_p + 1e-6


def test_shared_prefix_prefilled_once_changes_nothing(tiny, sampler):
    """Prompts sharing a 37-token prefix, with own parts of 1 to 12 tokens: the prefix is prefilled once
    (C = 32 slots shared), and samples and log-probs equal both a sampler that prefills every prompt whole
    and transformers' teacher-forced pass."""
    cfg, params, model = tiny
    rng = np.random.RandomState(4)
    shared = rng.randint(0, cfg.vocab_size, 37).tolist()
    prompts = [shared + rng.randint(0, cfg.vocab_size, n).tolist() for n in (1, 5, 12, 3, 8, 2)]
    sp = SamplingParams(max_new_tokens=16, temperature=0.8)
    out = sampler.generate(params, prompts, jax.random.PRNGKey(2), sp)
    st = sampler.stats
    assert st["prompt_tokens"] == sum(map(len, prompts)) and st["prefill_tokens"] == st["prompt_tokens"] - 5 * 32
    whole = Sampler(cfg, pad_id=PAD, share_prefix=False)
    ref = whole.generate(params, prompts, jax.random.PRNGKey(2), sp)
    assert whole.stats["prefill_tokens"] == whole.stats["prompt_tokens"]
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    for i, (tf_lp, _) in enumerate(teacher_forced_logp(model, prompts, out, 0.8)):
        np.testing.assert_allclose(out.row(i)[1], tf_lp, atol=1e-4, rtol=0, err_msg=f"row {i}")


def test_top_k_1_equals_greedy(tiny, sampler):
    cfg, params, _ = tiny
    prompts = random_prompts(5, cfg.vocab_size, seed=2)
    greedy = sampler.generate(params, prompts, jax.random.PRNGKey(0), GREEDY)
    for key in (1, 2):
        k1 = sampler.generate(params, prompts, jax.random.PRNGKey(key), SamplingParams(16, temperature=1.0, top_k=1))
        np.testing.assert_array_equal(k1.tokens, greedy.tokens)
        np.testing.assert_allclose(k1.logprobs, greedy.logprobs, atol=1e-5, rtol=0)  # softmax(logits / 1)


def _logits_for(probs):
    return jnp.log(jnp.asarray(probs, jnp.float32))


@pytest.mark.parametrize("probs,temperature,top_p,top_k,expected", [
    # cumulative mass before each token: 0, .5, .75, .9, .96 -> top_p .85 keeps the first three
    ([0.5, 0.25, 0.15, 0.06, 0.04], 1.0, 0.85, 0, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0]),
    # top-k 3 first, then top-p on the renormalised three: .5/.9, .25/.9 (cum .833 >= .8): two kept
    ([0.5, 0.25, 0.15, 0.06, 0.04], 1.0, 0.8, 3, [2 / 3, 1 / 3, 0, 0, 0]),
    # temperature 2 flattens: p^(1/2) normalised, then top_p 0.9 drops only the tail token (mass before it .911)
    ([0.64, 0.16, 0.09, 0.08, 0.03], 2.0, 0.9, 0, None),
    ([0.4, 0.3, 0.2, 0.1], 1.0, 1.0, 2, [4 / 7, 3 / 7, 0, 0]),
])
def test_sample_tokens_distribution(probs, temperature, top_p, top_k, expected):
    probs = np.asarray(probs, np.float64)
    if expected is None:  # hand-worked: p^(1/T), normalised; mass before each token decides the nucleus
        flat = probs ** (1 / temperature) / np.sum(probs ** (1 / temperature))
        before = np.concatenate([[0], np.cumsum(flat)[:-1]])
        kept = np.where(before < top_p, flat, 0)
        expected = kept / kept.sum()
        assert expected[-1] == 0 and expected[-2] > 0
    n = 20000
    sp = SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k)
    logits = jnp.broadcast_to(_logits_for(probs), (n, len(probs)))
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    tok, lp = jax.jit(lambda l, k: sample_tokens(l, k, sp))(logits, keys)
    freq = np.bincount(np.asarray(tok), minlength=len(probs)) / n
    expected = np.asarray(expected)
    assert np.all(freq[expected == 0] == 0), freq
    np.testing.assert_allclose(freq, expected, atol=0.015)
    # Log-probs are of the untruncated, temperature-scaled distribution.
    flat = probs ** (1 / temperature) / np.sum(probs ** (1 / temperature))
    np.testing.assert_allclose(np.asarray(lp), np.log(flat)[np.asarray(tok)], atol=1e-5)


def test_sample_tokens_greedy_ignores_keys():
    logits = jnp.asarray([[0.1, 2.0, -1.0], [3.0, 3.5, 0.0]])
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    tok, lp = sample_tokens(logits, keys, SamplingParams(temperature=0.0))
    np.testing.assert_array_equal(np.asarray(tok), [1, 1])
    ref = np.asarray(logits, np.float64)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp), ref[[0, 1], [1, 1]], atol=1e-6)


# ------------------------------------------------------------------------------------- randomness

def test_same_key_same_samples_other_key_differs(tiny, sampler):
    cfg, params, _ = tiny
    prompts = random_prompts(6, cfg.vocab_size, seed=3)
    a = sampler.generate(params, prompts, jax.random.PRNGKey(11), SAMPLE)
    b = sampler.generate(params, prompts, jax.random.PRNGKey(11), SAMPLE)
    c = sampler.generate(params, prompts, jax.random.PRNGKey(12), SAMPLE)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert np.mean(a.tokens != c.tokens) > 0.5
    # Rows with the same prompt still draw their own samples.
    twins = sampler.generate(params, [prompts[0]] * 2, jax.random.PRNGKey(11), SAMPLE)
    assert not np.array_equal(twins.tokens[0], twins.tokens[1])


def test_row_sample_independent_of_batch_mates(tiny, sampler):
    """Row i's randomness is keyed by (i, step): the same prompt at the same index gives the same completion
    alone and among other prompts (another batch bucket)."""
    cfg, params, _ = tiny
    key = jax.random.PRNGKey(5)
    prompts = random_prompts(11, cfg.vocab_size, seed=4)
    full = sampler.generate(params, prompts, key, SAMPLE)
    for i in (0, 3):
        alone = sampler.generate(params, [[0]] * i + prompts[i:i + 1], key, SAMPLE)
        np.testing.assert_array_equal(alone.tokens[i], full.tokens[i])
        np.testing.assert_allclose(alone.logprobs[i], full.logprobs[i], atol=1e-5, rtol=0)


def test_compaction_and_chunking_do_not_change_results(tiny, sampler, sampler_chunked):
    """16 rows with per-row limits: one batch of 16 compacted as rows finish, against two chunks of 8 run
    without compaction. Same key, same completions."""
    cfg, params, _ = tiny
    prompts = random_prompts(16, cfg.vocab_size, seed=6)
    limits = [2, 3, 16, 4, 1, 16, 5, 6, 2, 16, 3, 7, 1, 16, 8, 2]
    key = jax.random.PRNGKey(9)
    a = sampler.generate(params, prompts, key, SAMPLE, max_new_tokens=limits)
    assert sampler.stats["compactions"] >= 1
    b = sampler_chunked.generate(params, prompts, key, SAMPLE, max_new_tokens=limits)
    assert sampler_chunked.stats["compactions"] == 0
    assert sampler.stats["row_steps"] < sampler_chunked.stats["row_steps"]
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, limits)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_batch_buckets():
    """Buckets are multiple * {1, 2, 3, 4, 6, 8, 12, ...}, at least the minimum; compaction moves one bucket down."""
    assert [batch_bucket(n, 8) for n in (1, 8, 9, 12, 13, 17, 25, 33, 49, 65)] == [8, 8, 12, 12, 16, 24, 32, 48, 64, 96]
    assert [batch_bucket(n) for n in range(1, 10)] == [1, 2, 3, 4, 6, 6, 8, 8, 12]
    assert [batch_bucket(n, 8, 8) for n in (1, 9, 17, 25, 33, 49)] == [8, 16, 24, 32, 48, 64]  # data axis of 8
    assert [next_smaller_bucket(b, 8) for b in (64, 48, 32, 24, 16, 12, 8)] == [48, 32, 24, 16, 12, 8, 0]
    assert next_smaller_bucket(24, 8, 8) == 16 and next_smaller_bucket(16, 16, 8) == 0


def test_attention_window_changes_nothing(tiny):
    """Prefill and decode steps attending over a window of the cache that holds every written slot give the
    same logits and cache as attending over all of it."""
    cfg, params, _ = tiny
    prompts = random_prompts(3, cfg.vocab_size, seed=12, lo=2, hi=9)
    tokens, mask, _ = left_pad(prompts, pad_id=0)
    P, T = tokens.shape[1], tokens.shape[1] + 8
    positions = jnp.asarray(np.maximum(np.cumsum(mask, 1) - 1, 0))
    run = jax.jit(decoder.forward_cached, static_argnums=(1,), static_argnames=("window",))
    out = {}
    for window in (None, P):
        logits, cache = run(params, cfg, jnp.asarray(tokens), positions, decoder.init_cache(cfg, 3, T), jnp.int32(0),
                            jnp.asarray(mask), window=window)
        steps = [logits[:, -1]]
        pos = positions[:, -1]
        for j in range(4):  # windows P + 2 and P + 4 cover the slots written so far; None is all T
            pos = pos + 1
            w = None if window is None else P + 2 * (j // 2 + 1)
            tok = jnp.argmax(steps[-1], -1)[:, None].astype(jnp.int32)
            logits, cache = run(params, cfg, tok, pos[:, None], cache, jnp.int32(P + j), jnp.ones((3, 1), bool),
                                window=w)
            steps.append(logits[:, 0])
        out[window] = (np.stack(steps), cache)
    np.testing.assert_allclose(out[P][0], out[None][0], atol=1e-5, rtol=0)
    valid = np.asarray(out[None][1].valid)  # slots of padding tokens hold keys nothing attends to
    np.testing.assert_array_equal(valid, np.asarray(out[P][1].valid))
    for a, b in ((out[P][1].k, out[None][1].k), (np.swapaxes(out[P][1].v, -1, -2), np.swapaxes(out[None][1].v, -1, -2))):
        np.testing.assert_allclose(np.asarray(a) * valid[None, :, None, None], np.asarray(b) * valid[None, :, None, None],
                                   atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="window"):
        run(params, cfg, jnp.asarray(tokens), positions, decoder.init_cache(cfg, 3, T), jnp.int32(0),
            jnp.asarray(mask), window=T + 1)


# ------------------------------------------------------------------------------ limits and stops

def test_per_row_limits_pad_the_rest(tiny, sampler):
    cfg, params, _ = tiny
    prompts = random_prompts(5, cfg.vocab_size, seed=8)
    full = sampler.generate(params, prompts, jax.random.PRNGKey(0), GREEDY)
    limits = [1, 5, 16, 3, 40]  # a limit above max_new_tokens is capped by it
    out = sampler.generate(params, prompts, jax.random.PRNGKey(0), GREEDY, max_new_tokens=limits)
    assert out.tokens.shape == (5, 16) and out.tokens.dtype == np.int32
    np.testing.assert_array_equal(out.lengths, [1, 5, 16, 3, 16])
    assert not out.finished.any()
    for i, n in enumerate(out.lengths):
        np.testing.assert_array_equal(out.tokens[i, :n], full.tokens[i, :n])  # greedy: a prefix of the full run
        assert np.all(out.tokens[i, n:] == PAD) and np.all(out.logprobs[i, n:] == 0)
        assert np.all(out.logprobs[i, :n] < 0)


def test_stop_tokens_end_rows(tiny, sampler):
    cfg, params, _ = tiny
    prompts = random_prompts(6, cfg.vocab_size, seed=10)
    ref = sampler.generate(params, prompts, jax.random.PRNGKey(0), GREEDY)
    # Stop on a token row 0 emits at step 4 or later (not before), and on row 1's very first token.
    row0 = ref.tokens[0].tolist()
    s0 = next(t for j, t in enumerate(row0) if j >= 4 and t not in row0[:j] and t != PAD)
    s1 = int(ref.tokens[1, 0])
    stops = (s0, s1)
    sp = SamplingParams(16, temperature=0.0, stop_ids=stops)
    out = sampler.generate(params, prompts, jax.random.PRNGKey(0), sp)
    for i in range(len(prompts)):
        r = ref.tokens[i].tolist()
        hit = next((j for j, t in enumerate(r) if t in stops), None)
        n = 16 if hit is None else hit + 1  # the stop token is part of the completion
        assert out.lengths[i] == n and bool(out.finished[i]) == (hit is not None), i
        np.testing.assert_array_equal(out.tokens[i, :n], r[:n])
        assert np.all(out.tokens[i, n:] == PAD) and np.all(out.logprobs[i, n:] == 0)
    assert out.finished[0] and out.lengths[1] == 1 and out.finished[1]
    # A stop token only counts inside a row's limit.
    capped = sampler.generate(params, prompts, jax.random.PRNGKey(0), sp,
                              max_new_tokens=[out.lengths[0] - 1] + [16] * 5)
    assert capped.lengths[0] == out.lengths[0] - 1 and not capped.finished[0]


# ------------------------------------------------------------------------------- compiled programs

def test_compiled_programs_stay_bounded(tiny):
    """Calls with random batch sizes (1-12), prompt lengths (1-16) and per-row limits compile a bounded set of
    programs (shapes are bucketed): 60 calls, at most 16 programs (prefill per batch and unique-prompt bucket,
    decode per batch bucket and attention window, the compaction gather)."""
    cfg, params, _ = tiny
    rng = np.random.RandomState(0)
    sampler = Sampler(cfg)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)

    def compiled() -> int:
        return sum(f._cache_size() for f in sampler.programs.fns.values())

    def calls(first: int, count: int) -> set:
        sizes = set()
        for call in range(first, first + count):
            n = int(rng.randint(1, 13))
            prompts = random_prompts(n, cfg.vocab_size, seed=100 + call, lo=1, hi=16)
            limits = rng.randint(1, 9, n).tolist()
            out = sampler.generate(params, prompts, jax.random.PRNGKey(call), sp, max_new_tokens=limits)
            np.testing.assert_array_equal(out.lengths, limits)
            sizes.add((n, max(map(len, prompts))))
        return sizes

    # Unbucketed, every distinct (rows, longest prompt) pair would compile its own prefill and decode.
    sizes = calls(0, 30)
    assert len(sizes) >= 20
    assert compiled() <= 16, {k: f._cache_size() for k, f in sampler.programs.fns.items()}
    first = compiled()
    sizes |= calls(30, 30)
    assert len(sizes) >= 35
    assert compiled() <= 16 and compiled() - first <= 2, {k: f._cache_size() for k, f in sampler.programs.fns.items()}


def test_prompts_sharing_a_longer_prefix_reuse_the_decode_programs(tiny):
    """The prompt region is one length bucket whatever part of it the prompts share (prefilled once), so a
    call whose prompts share 24 tokens decodes with the programs of one whose prompts share 16, as long as
    its prompts are no longer; and sharing the prefix gives what prefilling every prompt whole gives."""
    cfg, params, _ = tiny
    rng = np.random.RandomState(3)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    sampler = Sampler(cfg, pad_id=PAD)
    decode = lambda: sorted((k[2], k[3], f._cache_size()) for k, f in sampler.programs.fns.items() if k[0] == "decode")
    calls = []
    for shared, rests in ((16, (20, 24, 9, 13)), (24, (14, 17, 5, 11))):  # 40 and 41 tokens at most
        head = rng.randint(1, cfg.vocab_size, shared).tolist()
        prompts = [head + rng.randint(1, cfg.vocab_size, n).tolist() for n in rests]
        calls.append((prompts, sampler.generate(params, prompts, jax.random.PRNGKey(0), sp)))
        if shared == 16:
            first = decode()
    assert decode() == first, (first, decode())
    whole = Sampler(cfg, pad_id=PAD, share_prefix=False)
    for prompts, out in calls:
        np.testing.assert_array_equal(whole.generate(params, prompts, jax.random.PRNGKey(0), sp).tokens, out.tokens)


# ----------------------------------------------------------------------------------------- errors

def test_empty_prompts_and_bad_params(tiny, sampler):
    cfg, params, _ = tiny
    out = sampler.generate(params, [], jax.random.PRNGKey(0), SamplingParams(max_new_tokens=5))
    assert out.tokens.shape == (0, 5) and out.logprobs.shape == (0, 5) and out.lengths.shape == (0,)
    with pytest.raises(ValueError, match="at least one token"):
        sampler.generate(params, [[1, 2], []], jax.random.PRNGKey(0), SamplingParams(max_new_tokens=5))
    for bad, match in ((dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-0.1), "temperature"),
                       (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
