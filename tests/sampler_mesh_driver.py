"""Run on 8 fake CPU devices (XLA_FLAGS set by the caller, tests/test_continuous.py): the sampler with continuous
batching, compaction and the prefix cache on several meshes against one device, greedy, with the dense and the
paged KV cache, and (on one mesh) under a KV budget small enough to preempt rows. Prints `RESULT {json}`."""
from __future__ import annotations

import json

import jax
import numpy as np

from marl_jax.generate.sampler import Sampler, SamplingParams
from marl_jax.models import decoder, sharding
from marl_jax.models.decoder import ModelConfig
from marl_jax.policy.lora import PolicySpec, init_trainable

MESHES = ((8, 1, 1), (2, 2, 2), (1, 4, 2))
CFG = ModelConfig(family="qwen2", vocab_size=322, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)


def main():
    params = decoder.init_params(CFG, jax.random.PRNGKey(0))
    params = {**params, "lm_head": params["lm_head"] * 20.0}  # peaked logits: greedy has no near-ties
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, CFG.vocab_size, rng.randint(10, 30)).tolist() for _ in range(20)]
    limits = np.where(np.arange(20) % 5 == 0, 16, rng.randint(1, 5, 20)).tolist()
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    key = jax.random.PRNGKey(1)
    lspec = PolicySpec(rank=4, alpha=8.0, num_slots=2)
    ltr = jax.tree_util.tree_map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(3), x.shape),
                                 init_trainable(lspec, CFG, params, jax.random.PRNGKey(4)))

    def run(mesh, base, tr, paged=False, budget=0):
        """Two calls, the second's prompts extending the first's prompts + completions; then a LoRA slot.
        budget: a KV budget of this many blocks per device (preemption; the bookkeeping checked every step)."""
        kw = dict(kv_budget_bytes=budget * Sampler(CFG, mesh=mesh, kv_block=8).block_bytes(), check_blocks=True)
        s = Sampler(CFG, mesh=mesh, max_batch=8, paged=paged, kv_block=8, **kw)
        a = s.generate(base, prompts, key, greedy, max_new_tokens=limits)
        refills = s.stats["refills"]
        ext = [p + a.row(i)[0] + [5, 6, 7] for i, p in enumerate(prompts)]
        b = s.generate(base, ext, key, greedy, max_new_tokens=limits)
        ls = Sampler(CFG, mesh=mesh, max_batch=8, spec=lspec, paged=paged, kv_block=8, **kw)
        c = ls.generate(base, prompts, key, greedy, max_new_tokens=limits, trainable=tr, slot=1)
        return a, b, c, refills, s.stats["cached_tokens"], s.stats.get("preemptions", 0) + ls.stats.get("preemptions", 0)

    ref = run(None, params, ltr)
    out = {"devices": len(jax.devices()), "meshes": {}}
    for data, fsdp, model in MESHES:
        mesh = sharding.make_mesh(data, model, fsdp=fsdp)
        sp, st = sharding.shard_params(params, mesh), jax.device_put(ltr, sharding.tree_shardings(ltr, mesh))
        kinds = [("", False, 0), ("-paged", True, 0)] + ([("-budget", True, 10)] if (data, fsdp, model) == (2, 2, 2)
                                                          else [])
        for name, paged, budget in kinds:
            a, b, c, refills, cached, preempted = run(mesh, sp, st, paged, budget)
            out["meshes"][f"{data}x{fsdp}x{model}" + name] = {
                "same": a.tokens.tolist() == ref[0].tokens.tolist(),
                "same_extended": b.tokens.tolist() == ref[1].tokens.tolist(),
                "lora_same": c.tokens.tolist() == ref[2].tokens.tolist(), "refills": refills, "cached_tokens": cached,
                "preemptions": preempted}
    out["paged_locality"] = paged_locality(params, prompts, greedy, key)
    print("RESULT " + json.dumps(out))


def paged_locality(params, prompts, greedy, key):
    """On a data-split mesh: how many shards of the paged pool one device holds, and the largest collective
    (elements) in the compiled decode program against the elements of one layer of the pool."""
    import re

    mesh = sharding.make_mesh(8, 1, fsdp=1)
    s = Sampler(CFG, mesh=mesh, max_batch=8, paged=True, kv_block=8)
    seen = {}
    build = s.programs.decode

    def spy(sp, P, window):
        f = build(sp, P, window)

        def g(*args):
            seen.setdefault("hlo", f.lower(*args).compile().as_text())
            res = f(*args)
            seen["k"] = res[0].cache.k
            return res
        return g

    s.programs.decode = spy
    s.generate(sharding.shard_params(params, mesh), prompts, key, greedy)
    k = seen["k"]
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for dims in re.findall(r"= \(?[a-z0-9]+\[([0-9,]*)\][^ ]* (?:all-gather|all-reduce|all-to-all|"
                                    r"collective-permute|reduce-scatter)", seen["hlo"])]
    # The pool is [Hkv, L, D, N, blk, hd]: D row shards; one layer's pool is everything but the layer axis.
    return {"pool_shards": k.shape[2], "shards_per_device": k.addressable_shards[0].data.shape[2],
            "largest_collective": max(sizes, default=0), "pool_layer_elems": int(np.prod(k.shape)) // k.shape[1]}


if __name__ == "__main__":
    main()
