"""Run on 8 fake CPU devices (XLA_FLAGS set by the caller, tests/test_sharding.py): every mesh against one
device, for the forward pass, greedy sampling and one GRPO update step (Shared / Isolated x LoRA / full).
Prints one line `RESULT {json}`."""
from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from marl_jax.generate.sampler import Sampler, SamplingParams
from marl_jax.models import decoder, sharding
from marl_jax.models.decoder import ModelConfig
from marl_jax.policy.lora import PolicySpec, init_trainable
from marl_jax.rl import optim
from marl_jax.rl.batch import make_batch, make_groups
from marl_jax.rl.update import UpdateConfig, init_state, make_train_step, pack_batch, pack_shapes

FWD_MESHES = ((2, 1, 4), (4, 1, 2))  # forward only: a vocabulary of 322 splits over 2 but not 4
UPDATE_MESHES = ((8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2))
# Each (policy, mode) on the meshes that test it: Shared LoRA (the default) on all of them, the others on
# a mesh with every axis and one with fsdp alone or with model (each case compiles its item programs: minutes).
UPDATE_CASES = {("shared", "lora"): UPDATE_MESHES, ("isolated", "lora"): ((2, 2, 2),),
                ("shared", "full"): ((1, 8, 1), (2, 2, 2)), ("isolated", "full"): ((1, 4, 2),)}

# vocab 322 = 2 * 161: split on a model axis of 2, not of 4. Every other dimension divides 8.
CFG = ModelConfig(family="qwen2", vocab_size=322, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)


def flat(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def max_diff(a, b) -> float:
    """Largest |x - y| / max(1, |x|) over the leaves: absolute for values up to 1, relative above (metrics
    such as summed token KL reach hundreds)."""
    return max(float((np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))
                      / np.maximum(1.0, np.abs(np.asarray(x, np.float64)))).max())
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


class Row:
    def __init__(self, rng, role, call_index):
        self.prompt_tokens = rng.randint(1, CFG.vocab_size, rng.randint(3, 12)).tolist()
        self.completion_tokens = rng.randint(1, CFG.vocab_size, rng.randint(2, 9)).tolist()
        self.logprobs = (-rng.uniform(0.5, 4.0, len(self.completion_tokens))).tolist()
        self.role, self.call_index, self.trained = role, call_index, True


def update_case(params, policy: str, mode: str, mesh, seeds=(7,), **ucfg):
    """One update step per seed's batch (the next step from the last state), on one device or the mesh; the
    last step's new state and metrics, the state before it, the base, the step function and the item
    shapes the batches used."""
    roles = ["gen", "judge", "agg"]
    mapping = {r: (0 if policy == "shared" else i) for i, r in enumerate(roles)}
    S = max(mapping.values()) + 1
    spec = PolicySpec(mode=mode, rank=4, alpha=8.0, num_slots=S)
    tr = init_trainable(spec, CFG, params, jax.random.PRNGKey(1))
    # Slots differ and LoRA's B is non-zero, so every parameter gets a gradient.
    tr = jax.tree_util.tree_map(lambda x: x + 0.02 * jax.random.normal(jax.random.PRNGKey(2), x.shape), tr)
    groups = make_groups(roles, mapping, {"gen": 2})
    # AdamW's first step is lr * g / (|g| + eps): float32 reduction order (which the mesh changes) moves a
    # near-zero gradient element's step by up to lr, so a small lr keeps the comparison at 1e-5.
    tx = optim.per_slot(optim.make_optimizer(lr=1e-4, weight_decay=0.01, grad_clip=1.0))
    uc = UpdateConfig(micro_batch=8, remat="full", **ucfg)
    step = make_train_step(CFG, spec, uc, tx, num_groups=len(groups.names),
                           group_slot=groups.slot, group_role=[roles.index(r) for r in groups.role],
                           num_roles=len(roles), role_slot=[mapping[r] for r in roles], mesh=mesh)
    state = init_state(tr, tx)
    base = params
    if mesh is not None:
        state = jax.device_put(state, sharding.tree_shardings(state, mesh))
        base = sharding.shard_params(params, mesh)
    kinds = set()
    for seed in seeds:
        rng = np.random.RandomState(seed)
        rows = [Row(rng, r, i % 2) for r, n in (("gen", 12), ("judge", 6), ("agg", 5)) for i in range(n)]
        advs = rng.randn(len(rows)).astype(np.float32)
        batch = make_batch(rows, advs, role_to_slot=mapping, num_slots=S, groups=groups, micro_batch=8)
        if uc.packing:  # every live item's program key: packed shape and completion window
            packed = pack_batch(batch, 8, grid=uc.length_grid)
            shapes = pack_shapes(batch.tokens.shape[2], 8, grid=uc.length_grid)
            live = np.asarray(packed.length)[:, ::8] > 0
            kinds |= {(shapes[k], batch.targets.shape[2]) for k in np.asarray(packed.pack_shape)[:, ::8][live]}
        prev = state
        state, metrics = step(state, base, jax.tree_util.tree_map(jnp.asarray, batch))
    return state, metrics, prev, base, step, kinds


def main():
    params = decoder.init_params(CFG, jax.random.PRNGKey(0))
    params = {**params, "lm_head": params["lm_head"] * 20.0}  # peaked logits: greedy has no near-ties
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, CFG.vocab_size, (8, 24))
    valid = np.ones_like(tokens, bool)
    for b in range(8):
        valid[b, : rng.randint(0, 12)] = False
    fwd = jax.jit(lambda p, t, v: decoder.forward(p, CFG, t, v))
    ref = np.asarray(fwd(params, tokens, valid))
    prompts = [rng.randint(0, CFG.vocab_size, rng.randint(1, 17)).tolist() for _ in range(11)]
    limits = [16, 3, 16, 2, 5, 16, 1, 4, 16, 2, 3]  # rows finish early: the sharded compaction runs too
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    key = jax.random.PRNGKey(1)
    shared = rng.randint(0, CFG.vocab_size, 20).tolist()  # prefilled once, then broadcast over the rows
    prefixed = [shared + p for p in prompts]
    # Isolated-Policy adapters: sampling slot 1 of a 2-slot LoRA tree.
    lspec = PolicySpec(rank=4, alpha=8.0, num_slots=2)
    ltr = jax.tree_util.tree_map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(3), x.shape),
                                 init_trainable(lspec, CFG, params, jax.random.PRNGKey(4)))
    g_ref = Sampler(CFG).generate(params, prompts, key, greedy, max_new_tokens=limits)
    gp_ref = Sampler(CFG).generate(params, prefixed, key, greedy, max_new_tokens=limits)
    gl_ref = Sampler(CFG, spec=lspec).generate(params, prompts, key, greedy, max_new_tokens=limits, trainable=ltr, slot=1)
    out = {"devices": len(jax.devices()), "logits_scale": float(np.abs(ref).max()), "forward": {}, "update": {},
           "bytes": {}}

    t0 = time.time()
    for data, fsdp, model in sorted(set(FWD_MESHES + UPDATE_MESHES)):
        name = f"{data}x{fsdp}x{model}"
        print(f"[{time.time() - t0:6.0f}s] forward and sampler on {name}", file=sys.stderr, flush=True)
        mesh = sharding.make_mesh(data, model, fsdp=fsdp)
        sharded = sharding.shard_params(params, mesh)
        res = {
            "logits_max_diff": float(np.abs(np.asarray(fwd(sharded, tokens, valid)) - ref).max()),
            "specs": {k: [a if a is None else (a if isinstance(a, str) else "+".join(a)) for a in x.sharding.spec]
                      for k, x in flat(sharded).items()},
            "shard_shapes": {k: list(x.addressable_shards[0].data.shape) for k, x in flat(sharded).items()},
            "full_shapes": {k: list(x.shape) for k, x in flat(sharded).items()},
        }
        out["forward"][name] = res
        if (data, fsdp, model) not in UPDATE_MESHES:
            continue
        s = Sampler(CFG, mesh=mesh)
        g = s.generate(sharded, prompts, key, greedy, max_new_tokens=limits)
        res["compactions"] = s.stats["compactions"]
        res["greedy_same"] = g.tokens.tolist() == g_ref.tokens.tolist() and g.lengths.tolist() == g_ref.lengths.tolist()
        gp = s.generate(sharded, prefixed, key, greedy, max_new_tokens=limits)
        res["prefix_shared"] = s.stats["prefill_tokens"] < s.stats["prompt_tokens"]
        res["prefixed_same"] = gp.tokens.tolist() == gp_ref.tokens.tolist()
        ls = Sampler(CFG, mesh=mesh, spec=lspec)
        gl = ls.generate(sharded, prompts, key, greedy, max_new_tokens=limits,
                         trainable=jax.device_put(ltr, sharding.tree_shardings(ltr, mesh)), slot=1)
        res["lora_slot_same"] = gl.tokens.tolist() == gl_ref.tokens.tolist()

    for (policy, mode), meshes in UPDATE_CASES.items():
        new1, m1, *_ = update_case(params, policy, mode, None)
        for data, fsdp, model in meshes:
            print(f"[{time.time() - t0:6.0f}s] update {policy}/{mode} on {data}x{fsdp}x{model}", file=sys.stderr,
                  flush=True)
            mesh = sharding.make_mesh(data, model, fsdp=fsdp)
            new, m, state, base, *_ = update_case(params, policy, mode, mesh)
            case = {
                "loss": [float(m1["loss"]), float(m["loss"])],
                "metrics_max_diff": max_diff(m1, m),
                "params_max_diff": max_diff(new1.trainable, new.trainable),
                "opt_max_diff": max_diff(new1.opt_state, new.opt_state),
                "misaligned": int(m["misaligned_rows"]),
                "out_specs_kept": all(x.sharding == y.sharding for x, y in zip(
                    jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(state))),
            }
            if mode == "full":
                case["bytes"] = {"base": sharding.bytes_per_device(base),
                                 "trainable": sharding.bytes_per_device(new.trainable),
                                 "opt_state": sharding.bytes_per_device(new.opt_state),
                                 "base_total": sum(x.nbytes for x in jax.tree_util.tree_leaves(base)),
                                 "trainable_total": sum(x.nbytes for x in jax.tree_util.tree_leaves(new.trainable)),
                                 "opt_total": sum(x.nbytes for x in jax.tree_util.tree_leaves(new.opt_state))}
            out["update"][f"{policy}/{mode}/{data}x{fsdp}x{model}"] = case

    # Packed, over two batches of other rows: the mesh's two steps against one device's, no item program compiled
    # twice for one shape, the new state in the shardings it went in with.
    mesh = sharding.make_mesh(2, 2, fsdp=2)
    print(f"[{time.time() - t0:6.0f}s] packed item programs over two batches on 2x2x2", file=sys.stderr, flush=True)
    items, mi, before, _, step, kinds = update_case(params, "shared", "lora", mesh, seeds=(7, 8), packing=True)
    one, m1, *_ = update_case(params, "shared", "lora", None, seeds=(7, 8), packing=True)
    out["programs"] = {
        "mesh_vs_one_device": max(max_diff(m1, mi), max_diff(one.trainable, items.trainable)),
        "item_programs": step.item_programs(), "item_shapes": len(kinds),
        "out_specs_kept": all(x.sharding == y.sharding for x, y in zip(
            jax.tree_util.tree_leaves(items), jax.tree_util.tree_leaves(before))),
        "grad_norms": np.asarray(mi["role_grad_norm"]).tolist(),
    }

    # Full training: per-device bytes as fsdp grows (data x fsdp = 8, model 1).
    for fsdp in (1, 2, 4, 8):
        mesh = sharding.make_mesh(8 // fsdp, 1, fsdp=fsdp)
        spec = PolicySpec(mode="full", num_slots=2)
        tr = init_trainable(spec, CFG, params, jax.random.PRNGKey(1))
        tx = optim.per_slot(optim.make_optimizer(lr=1e-3))
        state = jax.device_put(init_state(tr, tx), sharding.tree_shardings(init_state(tr, tx), mesh))
        out["bytes"][str(fsdp)] = {"base": sharding.bytes_per_device(sharding.shard_params(params, mesh)),
                                   "trainable": sharding.bytes_per_device(state.trainable),
                                   "opt_state": sharding.bytes_per_device(state.opt_state)}
    out["loading"] = loading(params)
    print("RESULT " + json.dumps(out))


def loading(params) -> dict:
    """A Hugging Face folder and the embedded GGUF loaded straight into their shardings, against the
    plain numpy load; the host's peak allocation while loading (tracemalloc: numpy buffers, not device ones)."""
    import tempfile
    import tracemalloc

    from marl_jax.models import hf
    from marl_jax.models.loading import load_model

    out = {}
    mesh = sharding.make_mesh(2, 2, fsdp=2)
    with tempfile.TemporaryDirectory() as d:
        hf.save_hf_dir(d, CFG, jax.tree_util.tree_map(np.asarray, params))
        ref = hf.load_hf_dir(d)[1]
        tracemalloc.start()
        _, placed = hf.load_hf_dir(d, mesh=mesh)
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        # On CPU devices may keep the host buffers they were made from (`held`): that is device memory here.
        out["hf"] = {"max_diff": max_diff(ref, placed), "peak": peak - held,
                     "total": sum(x.nbytes for x in jax.tree_util.tree_leaves(ref)),
                     "largest": max(x.nbytes for x in jax.tree_util.tree_leaves(ref)),
                     "shardings_ok": all(x.sharding == y for x, y in zip(
                         jax.tree_util.tree_leaves(placed),
                         jax.tree_util.tree_leaves(sharding.tree_shardings(placed, mesh))))}
    try:
        emb_ref = load_model("smollm2-135m-instruct")
    except FileNotFoundError:  # the embedded model's wheel is not installed
        return out
    tracemalloc.start()
    emb = load_model("smollm2-135m-instruct", mesh=mesh)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out["gguf"] = {"max_diff": max_diff(emb_ref.params, emb.params), "peak": peak - held, "held": held,
                   "total": sum(x.nbytes for x in jax.tree_util.tree_leaves(emb_ref.params)),
                   "largest": max(x.nbytes for x in jax.tree_util.tree_leaves(emb_ref.params)),
                   "wq_spec": [a for a in emb.params["layers"]["wq"].sharding.spec],
                   "wq_shard": list(emb.params["layers"]["wq"].addressable_shards[0].data.shape)}
    return out


if __name__ == "__main__":
    sys.exit(main())
