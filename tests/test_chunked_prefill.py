"""Chunked prefill: prompts run through the cache in chunks of `prefill_chunk` tokens give transformers' greedy
tokens (tiny Qwen3 / Llama / Qwen2 checkpoints and the embedded SmolLM2; with a shared prefix, a prefix-cache hit,
the paged cache, continuous-batching refills and a mesh), the teacher-forced log-probs and the unchunked sampler's
samples; prefill memory grows linearly with the prompt; one prompt is prefilled as one row; and
`python -m marl_jax.generate` runs a long prompt on a long-context checkpoint and refuses one that cannot fit."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import TINY, left_pad, save_tiny_tokenizer
from marl_jax.generate import prefill as pf
from marl_jax.generate.buckets import shared_prefix_len
from marl_jax.generate.sampler import Sampler, SamplingParams, length_bucket
from marl_jax.models import decoder, hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_sampler import HEAD_SCALE, PAD, _torch_threads, random_prompts, teacher_forced_logp  # noqa: E402,F401

REPO = pathlib.Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
# Lengths that no chunk size below divides, the longest over four chunks of 20.
LENGTHS = (37, 5, 70, 53, 21, 83)


def _dense(cfg):
    """The config with dense attention where the decoder offers a choice: what chunking alone bounds."""
    names = {f.name for f in dataclasses.fields(cfg)}
    return dataclasses.replace(cfg, attention="dense") if "attention" in names else cfg


def _load(path, scale=HEAD_SCALE):
    """(cfg, params, transformers model) of a checkpoint folder, the LM head scaled in both (peaked logits:
    greedy without near-ties) and transformers' generation config without a stop token."""
    cfg, params = hf.load_hf_dir(path)
    params = jax.device_put({**params, "lm_head": params["lm_head"] * scale})
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.generation_config.eos_token_id = None
    return cfg, params, model


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    made = {}

    def get(family):
        if family not in made:
            made[family] = _load(tiny_ckpt(family, num_kv_heads=2))
        return made[family]
    return get


def hf_greedy(model, prompt, n):
    """transformers' greedy continuation of one unpadded prompt."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def assert_hf_greedy(model, prompts, out, n=GREEDY.max_new_tokens):
    for i, p in enumerate(prompts):
        assert out.row(i)[0] == hf_greedy(model, p, n), f"row {i} (prompt of {len(p)} tokens)"


def prompts_of(lengths, vocab, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, n).tolist() for n in lengths]


# ------------------------------------------------------------------------------------------- the chunks

def test_chunk_starts():
    """Chunks of `chunk` slots, the last one ending at S (over the previous one's end when chunk does not divide S)."""
    assert pf.chunk_starts(48, 16) == [0, 16, 32]
    assert pf.chunk_starts(96, 20) == [0, 20, 40, 60, 76]
    assert pf.chunk_starts(16, 16) == pf.chunk_starts(10, 2048) == [0]
    with pytest.raises(ValueError, match="chunk"):
        pf.chunk_starts(16, 0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Sampler(decoder.ModelConfig("llama", 32, 16, 32, 1, 2, 1, 8), prefill_chunk=0)


def test_default_chunk_keeps_short_prompts_in_one_pass(models):
    """A prompt bucket within the chunk lowers to the one-pass program (no chunk loop); a longer one to a loop."""
    cfg, params, _ = models("qwen3")
    cfg = _dense(cfg)
    sp = SamplingParams(max_new_tokens=16, temperature=0.7)
    sd = jax.ShapeDtypeStruct

    def whiles(chunk, S):
        f = Sampler(cfg, prefill_chunk=chunk).programs.prefill(sp, S + 16, 16)
        text = f.lower(params, None, jnp.int32(0), sd((0,), jnp.int32), sd((1, S), jnp.int32), sd((1, S), bool),
                       sd((1,), jnp.int32), sd((1,), jnp.int32), sd((1,), jnp.int32), sd((1,), jnp.int32),
                       jax.random.PRNGKey(0), None).as_text()
        return text.count("stablehlo.while")

    for S in (256, pf.PREFILL_CHUNK):
        assert whiles(pf.PREFILL_CHUNK, S) == whiles(10 ** 6, S)
    assert whiles(64, 256) == whiles(10 ** 6, 256) + 1


# ------------------------------------------------------------------------------ greedy parity with transformers

@pytest.mark.parametrize("family,chunk", [("qwen3", 16), ("llama", 24), ("qwen2", 20)])
def test_greedy_matches_transformers_in_chunks(models, family, chunk):
    """Prompts of 5 to 83 tokens (one repeated), prefilled in chunks that split them mid-way: transformers'
    greedy tokens, and the unchunked sampler's tokens and log-probs from as many compiled programs."""
    cfg, params, model = models(family)
    prompts = prompts_of(LENGTHS, cfg.vocab_size) + prompts_of(LENGTHS[:1], cfg.vocab_size)
    s = Sampler(cfg, pad_id=PAD, prefill_chunk=chunk, share_prefix=False, prefix_cache_tokens=0)
    out = s.generate(params, prompts, jax.random.PRNGKey(0), GREEDY)
    assert len(pf.chunk_starts(length_bucket(max(LENGTHS)), chunk)) >= 4
    assert_hf_greedy(model, prompts, out)
    plain = Sampler(cfg, pad_id=PAD, share_prefix=False, prefix_cache_tokens=0)
    ref = plain.generate(params, prompts, jax.random.PRNGKey(0), GREEDY)
    compiled = lambda x: {k: f._cache_size() for k, f in x.programs.fns.items()}
    assert compiled(s) == compiled(plain)  # the chunk loop runs inside the same programs
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_shared_prefix_in_chunks_matches_transformers(models):
    """Prompts sharing a 70-token prefix (64 slots prefilled once, in chunks of 20) with own parts of 1 to 17
    tokens (their rest, 24 slots, in two chunks): transformers' greedy tokens."""
    cfg, params, model = models("qwen3")
    rng = np.random.RandomState(3)
    shared = rng.randint(0, cfg.vocab_size, 70).tolist()
    prompts = [shared + rng.randint(0, cfg.vocab_size, n).tolist() for n in (1, 9, 17, 4)]
    s = Sampler(cfg, pad_id=PAD, prefill_chunk=20, prefix_cache_tokens=0)
    out = s.generate(params, prompts, jax.random.PRNGKey(0), GREEDY)
    assert s.stats["prefill_tokens"] == s.stats["prompt_tokens"] - 3 * 64  # the prefix ran once
    assert_hf_greedy(model, prompts, out)


@pytest.mark.parametrize("paged", [False, True])
def test_prefix_cache_hit_and_refills_in_chunks_match_transformers(models, paged):
    """Two calls through 4 decode rows (so later prompts refill finished rows), in chunks of 20: the second
    call's prompts extend the first's prompts and completions, load those blocks from the prefix cache and
    prefill the rest in chunks. Dense and paged (8-slot blocks) caches: transformers' greedy tokens."""
    cfg, params, model = models("llama")
    prompts = prompts_of((37, 53, 21, 70, 5, 45), cfg.vocab_size, seed=1)
    limits = [12, 3, 12, 5, 12, 2]
    s = Sampler(cfg, pad_id=PAD, prefill_chunk=20, max_batch=4, min_batch=1, paged=paged, kv_block=8)
    a = s.generate(params, prompts, jax.random.PRNGKey(0), GREEDY, max_new_tokens=limits)
    assert s.stats["refills"] >= 1
    for i, p in enumerate(prompts):
        assert a.row(i)[0] == hf_greedy(model, p, limits[i]), i
    ext = [p + a.row(i)[0] + [5, 6, 7] for i, p in enumerate(prompts)]
    b = s.generate(params, ext, jax.random.PRNGKey(0), GREEDY)
    assert s.stats["cached_tokens"] >= sum(len(p) // 16 * 16 for p in prompts) and s.stats["refills"] >= 1
    assert len(pf.chunk_starts(length_bucket(max(len(p) for p in ext) - 16), 20)) > 1  # rests span chunks
    assert_hf_greedy(model, ext, b)


def test_embedded_model_in_chunks_matches_transformers(smollm, chat_prompts, smollm_hf_export):
    """The embedded SmolLM2 on six chat prompts of 32-39 tokens, in chunks of 10 tokens (the shared system prompt's
    24 slots prefilled once in three, each prompt's 16-slot rest in two): transformers' greedy generate on the
    same weights, token for token."""
    tok = smollm.tokenizer
    stops = tuple(tok.eos_token_ids)
    prompts = [p for p in chat_prompts if len(p) > 16][:6]
    C = shared_prefix_len(prompts)
    assert len(pf.chunk_starts(C, 10)) == 3 and len(pf.chunk_starts(length_bucket(max(map(len, prompts)) - C), 10)) == 2
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, stop_ids=stops)
    s = Sampler(smollm.cfg, pad_id=tok.pad_id, prefill_chunk=10)
    out = s.generate(jax.device_put(smollm.params), prompts, jax.random.PRNGKey(0), sp)
    assert s.stats["prefill_tokens"] < s.stats["prompt_tokens"]  # the shared system prompt ran once
    tokens, mask, _ = left_pad(prompts, tok.pad_id)
    with torch.no_grad():
        gen = smollm_hf_export.generate(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                                        max_new_tokens=24, do_sample=False, eos_token_id=list(stops),
                                        pad_token_id=tok.pad_id)
    for i, ref in enumerate(gen[:, tokens.shape[1]:].tolist()):
        n = next((k + 1 for k, t in enumerate(ref) if t in stops), len(ref))
        assert out.row(i)[0] == ref[:n], f"row {i}: {tok.decode(out.row(i)[0])!r} != {tok.decode(ref[:n])!r}"


# ------------------------------------------------------------------------------------- sampled log-probs

def test_sampled_logprobs_equal_teacher_forced_in_chunks(models):
    """Temperature 0.7 in chunks of 20: each sampled token's log-prob is transformers' teacher-forced one within
    1e-4, and the unchunked sampler draws the same tokens for the same key."""
    cfg, params, model = models("qwen3")
    prompts = prompts_of(LENGTHS, cfg.vocab_size, seed=2)
    sp = SamplingParams(max_new_tokens=16, temperature=0.7)
    key = jax.random.PRNGKey(7)
    out = Sampler(cfg, pad_id=PAD, prefill_chunk=20).generate(params, prompts, key, sp)
    for i, (tf_lp, _) in enumerate(teacher_forced_logp(model, prompts, out, 0.7)):
        np.testing.assert_allclose(out.row(i)[1], tf_lp, atol=1e-4, rtol=0, err_msg=f"row {i}")
    ref = Sampler(cfg, pad_id=PAD).generate(params, prompts, key, sp)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------ rows prefilled

def test_one_prompt_is_prefilled_as_one_row(models):
    """The distinct prompts are prefilled at their own bucketed count (1 and 3 here, not min_batch's 8), then
    copied to the decode batch (8 rows: min_batch) as before."""
    cfg, params, model = models("qwen3")
    s = Sampler(cfg, pad_id=PAD)
    seen = []
    build = s.programs.prefill

    def spy(*a):
        f = build(*a)

        def g(*args):
            state = f(*args)
            seen.append((args[4].shape[0], state.active.shape[0]))
            return state
        return g

    s.programs.prefill = spy
    p = prompts_of((30, 12, 7), cfg.vocab_size, seed=5)
    one = s.generate(params, [p[0]] * 4, jax.random.PRNGKey(0), GREEDY)
    s.generate(params, p, jax.random.PRNGKey(0), GREEDY)
    assert seen == [(1, 8), (3, 8)]
    assert all(one.row(i)[0] == hf_greedy(model, p[0], 12) for i in range(4))


# ------------------------------------------------------------------------------------------------ memory

def _prefill_memory(cfg, S, chunk, Tn=16):
    """XLA's memory analysis of the sampler's prefill program for one prompt of S slots."""
    params = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.PRNGKey(0)))
    sd = jax.ShapeDtypeStruct
    f = Sampler(cfg, prefill_chunk=chunk, min_batch=1).programs.prefill(SamplingParams(Tn, temperature=0.7), S + Tn, Tn)
    return f.lower(params, None, jnp.int32(0), sd((0,), jnp.int32), sd((1, S), jnp.int32), sd((1, S), bool),
                   sd((1,), jnp.int32), sd((1,), jnp.int32), sd((1,), jnp.int32), sd((1,), jnp.int32),
                   jax.random.PRNGKey(0), None).compile().memory_analysis()


LONG = decoder.ModelConfig(family="qwen3", vocab_size=TINY["vocab_size"], hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)


def test_chunked_prefill_memory_grows_linearly():
    """XLA's own figures, dense attention: the prefill of a 2k- and an 8k-slot prompt in chunks of 512 tokens
    needs at most 4.5x the temporaries for 4x the tokens (a chunk's scores are [1, heads, 512, prompt]); in one
    pass it needs about 16x. generate_bytes bounds the prefill's temporaries and outputs from above, within 1.5x."""
    cfg = _dense(LONG)
    short, long = (_prefill_memory(cfg, S, 512) for S in (2048, 8192))
    assert long.temp_size_in_bytes <= 4.5 * short.temp_size_in_bytes, (short.temp_size_in_bytes, long.temp_size_in_bytes)
    whole = [_prefill_memory(cfg, S, 10 ** 6).temp_size_in_bytes for S in (2048, 8192)]
    assert whole[1] > 12 * whole[0]
    for S, ma in ((2048, short), (8192, long)):
        est = pf.generate_bytes(cfg, [S], 16, chunk=512, weight_bytes=0)
        xla = ma.temp_size_in_bytes + ma.output_size_in_bytes
        assert xla <= est["kv_cache"] + est["transient"] <= 1.5 * xla, (S, xla, est)


def test_generate_bytes_parts():
    """The estimate's parts: the KV cache is linear in prompt + new tokens and in rows, the transient linear in
    the chunk; fitting_chunk finds the largest power-of-two chunk that fits."""
    cfg = LONG
    a = pf.generate_bytes(cfg, [8192], 16, chunk=512, weight_bytes=10)
    b = pf.generate_bytes(cfg, [8192], 16, chunk=1024, weight_bytes=10)
    assert a["weights"] == 10 and a["kv_cache"] == b["kv_cache"] and 1.9 < b["transient"] / a["transient"] < 2.1
    slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 + 1
    assert a["kv_cache"] == 2 * (8192 + 16) * slot  # the prefill row and its decode copy
    four = pf.generate_bytes(cfg, [8192] * 4, 16, chunk=512, distinct=1)
    assert four["kv_cache"] == (1 + 4) * (8192 + 16) * slot
    assert a["total"] == a["weights"] + a["kv_cache"] + a["transient"]
    assert pf.generate_bytes(cfg, [100], 16)["weights"] == cfg.num_params() * 4
    fits = pf.fitting_chunk(cfg, [8192], 16, a["total"], weight_bytes=10)
    assert fits == 512 and pf.fitting_chunk(cfg, [8192], 16, a["kv_cache"], weight_bytes=10) == 0


def test_host_available_bytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:    800 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert pf.host_available_bytes(str(meminfo), str(cg)) == 800 * 1024
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("100\n")
    assert pf.host_available_bytes(str(meminfo), str(cg)) == 800 * 1024  # no cgroup limit
    (cg / "memory.max").write_text("1000\n")
    assert pf.host_available_bytes(str(meminfo), str(cg)) == 900
    assert pf.host_available_bytes(str(tmp_path / "none"), str(tmp_path / "none")) is None
    assert pf.available_bytes() > 0


# -------------------------------------------------------------------------------------------------- mesh

MESH_DRIVER = r"""
import json, jax, numpy as np
from marl_jax.generate.sampler import Sampler, SamplingParams
from marl_jax.models import decoder, sharding
from marl_jax.models.decoder import ModelConfig
CFG = ModelConfig(family="qwen2", vocab_size=322, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
params = decoder.init_params(CFG, jax.random.PRNGKey(0))
params = {**params, "lm_head": params["lm_head"] * 20.0}
rng = np.random.RandomState(0)
shared = rng.randint(0, 322, 40).tolist()
prompts = [shared + rng.randint(0, 322, rng.randint(1, 30)).tolist() for _ in range(12)]
limits = np.where(np.arange(12) % 4 == 0, 12, rng.randint(1, 5, 12)).tolist()
sp, key = SamplingParams(max_new_tokens=12, temperature=0.0), jax.random.PRNGKey(1)
def run(mesh, base, **kw):
    s = Sampler(CFG, mesh=mesh, max_batch=8, kv_block=8, **kw)
    a = s.generate(base, prompts, key, sp, max_new_tokens=limits)
    b = s.generate(base, [p + a.row(i)[0] + [5, 6] for i, p in enumerate(prompts)], key, sp)
    return a.tokens.tolist(), b.tokens.tolist(), s.stats["cached_tokens"]
ref = run(None, params)
mesh = sharding.make_mesh(2, 2, fsdp=2)
base = sharding.shard_params(params, mesh)
out = {}
for paged in (False, True):
    a, b, cached = run(mesh, base, paged=paged, prefill_chunk=12)
    out["paged" if paged else "dense"] = dict(same=a == ref[0], same_extended=b == ref[1], cached=cached)
print("RESULT " + json.dumps(out))
"""


def test_chunked_prefill_on_a_mesh():
    """8 fake CPU devices, a 2x2x2 (data, fsdp, model) mesh, chunks of 12 (a shared prefix, rests, a second call
    loading the prefix cache, refills), dense and paged: one device's unchunked greedy tokens."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", MESH_DRIVER], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    for name, r in report.items():
        assert r["same"] and r["same_extended"] and r["cached"] > 0, (name, r)


# --------------------------------------------------------------------------------- python -m marl_jax.generate

@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    """A tiny Qwen3 checkpoint with a 32k context (2 layers, hidden 64), its LM head scaled, and a tokenizer."""
    out = tmp_path_factory.mktemp("tiny-qwen3-32k")
    cfg = transformers.Qwen3Config(**{**TINY, "num_hidden_layers": 2, "max_position_embeddings": 32768},
                                   tie_word_embeddings=False, rope_theta=1e6)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(out)
    save_tiny_tokenizer(out)
    return out


WORDS = "the quick brown fox jumps over lazy dog what is answer hello world there one two three four five".split()


def _long_text(n_words, seed=0):
    rng = np.random.RandomState(seed)
    return " ".join(rng.choice(WORDS, n_words))


def _cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "marl_jax.generate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_long_prompt_matches_transformers(long_ckpt, tmp_path):
    """A prompt of about 3,300 tokens through --prompt_file in chunks of 1000: transformers' greedy tokens (the
    same check at 16,000 tokens, about 30 s with the reference, is run by hand)."""
    from marl_jax.models.tokenizer import Tokenizer

    path = tmp_path / "prompt.txt"
    path.write_text(_long_text(1500))
    ids = Tokenizer.from_hf_dir(long_ckpt).encode(path.read_text())
    assert len(ids) > 2000
    proc = _cli(f"--model={long_ckpt}", f"--prompt_file={path}", "--max_new_tokens=16", "--prefill_chunk=1000",
                "--ids")
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = [int(t) for t in proc.stdout.split()]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(long_ckpt), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ref = hf_greedy(model, ids, 16)
    eos = set(Tokenizer.from_hf_dir(long_ckpt).eos_token_ids)
    n = next((k + 1 for k, t in enumerate(ref) if t in eos), len(ref))  # the CLI stops on the tokenizer's eos
    assert got == ref[:n]


def test_cli_refuses_a_prompt_that_cannot_fit(long_ckpt, tmp_path):
    """Over the memory given (--memory_gb), and over any machine's (a 220k-token prompt in one chunk: half a
    terabyte of scores): a one-paragraph refusal naming the estimate and the knobs, exit status 1, no traceback, before
    anything runs."""
    path = tmp_path / "prompt.txt"
    path.write_text(_long_text(3000))
    proc = _cli(f"--model={long_ckpt}", f"--prompt_file={path}", "--memory_gb=0.02", timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    msg = proc.stderr
    assert "refusing a prompt of" in msg and "GiB" in msg and "0.02 GiB is available" in msg, msg
    assert "--prefill_chunk=" in msg and "--max_new_tokens" in msg and "rollout.prefill_chunk" in msg, msg
    assert proc.stdout == ""

    path.write_text(_long_text(100000))
    proc = _cli(f"--model={long_ckpt}", f"--prompt_file={path}", "--prefill_chunk=1000000", timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "refusing a prompt of" in proc.stderr and "--prefill_chunk" in proc.stderr, proc.stderr
    assert "RESOURCE_EXHAUSTED" not in proc.stderr
