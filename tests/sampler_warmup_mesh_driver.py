"""Run on 8 fake CPU devices (XLA_FLAGS set by the caller, tests/test_compile_once.py): Sampler.warmup on a mesh,
dense and paged, then calls under the same CallShape with long-tailed completions and prefix-cache hits; the
programs compiled after the warm-up and whether the tokens are a one-device sampler's. Prints `RESULT {json}`."""
from __future__ import annotations

import json
import sys

import jax
import numpy as np

from marl_jax.generate.sampler import Sampler, SamplingParams
from marl_jax.generate.types import CallShape
from marl_jax.models import decoder, sharding
from marl_jax.models.decoder import ModelConfig
from marl_jax.train import compiles

CFG = ModelConfig(family="qwen2", vocab_size=322, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)


def main(meshes):
    compiles.install()
    params = decoder.init_params(CFG, jax.random.PRNGKey(0))
    params = {**params, "lm_head": params["lm_head"] * 20.0}  # peaked logits: greedy has no near-ties
    sp = SamplingParams(max_new_tokens=16, temperature=0.0)
    shape = CallShape(rows=16, distinct=4, prompt=40)
    out = {"devices": len(jax.devices()), "runs": {}}
    for data, fsdp, model in meshes:
        mesh = sharding.make_mesh(data, model, fsdp=fsdp)
        sharded = sharding.shard_params(params, mesh)
        for paged in (False, True):
            s = Sampler(CFG, mesh=mesh, max_batch=16, min_batch=2, paged=paged, kv_block=8, prefix_cache_tokens=1024)
            ref = Sampler(CFG, max_batch=16, min_batch=2, prefix_cache_tokens=1024)
            warmed = s.warmup(sharded, sp, shape)
            rng = np.random.RandomState(3)
            heads = [rng.randint(0, CFG.vocab_size, rng.randint(6, 20)).tolist() for _ in range(4)]
            late, same, cached = [], True, 0
            for r in range(3):
                n = 16 - 4 * r
                tails = [rng.randint(0, CFG.vocab_size, 2).tolist() for _ in range(4)]
                prompts = [heads[i % 4] + tails[i % 4] for i in range(n)]
                limits = np.where(np.arange(n) % 6 == 2, 16, rng.randint(1, 6, n)).tolist()
                key = jax.random.PRNGKey(r)
                before = compiles.snapshot()
                got = s.generate(sharded, prompts, key, sp, max_new_tokens=limits, shape=shape)
                late.append(compiles.since(before)["all"].programs)
                cached += s.stats["cached_tokens"]
                want = ref.generate(params, prompts, key, sp, max_new_tokens=limits, shape=shape)
                same &= got.tokens.tolist() == want.tokens.tolist()
                heads = [prompts[i] + got.row(i)[0][:3] for i in range(4)]
            out["runs"][f"{data}x{fsdp}x{model}" + ("-paged" if paged else "")] = {
                "warmup_programs": warmed, "compiled_after": late, "same": same, "cached_tokens": cached}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main([tuple(int(x) for x in m.split("x")) for m in (sys.argv[1:] or ["2x2x2", "8x1x1"])])
