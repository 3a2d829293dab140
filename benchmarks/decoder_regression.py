"""The decoder against an earlier commit's decoder, same weights, same process, interleaved timings.

    python benchmarks/decoder_regression.py [--ref_commit=c3224e3] [--reps=8]

The reference is the module as it was at --ref_commit (default: the last plain-function decoder, before
the Flax modules), read with `git show` and imported beside the current one. Both run the embedded
SmolLM2-135M in float32: a prefill of 64 prompts x 48 tokens, one batch-64 decode step over a 176-slot
cache, and a remat=full forward + backward over 8 x 48 tokens. Calls alternate (ref, current, ref, ...)
so load on the machine hits both alike; prints medians and `ratio=<current / ref>` per program (below
1 is faster). Outputs are compared too: a regression in numbers would show here before in any test.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def load_ref(commit: str):
    src = subprocess.run(["git", "show", f"{commit}:marl_jax/models/decoder.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "decoder_ref.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("decoder_ref", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["decoder_ref"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref_commit", default="c3224e3")
    p.add_argument("--reps", type=int, default=8)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.models import decoder as cur
    from marl_jax.models.loading import load_model

    ref = load_ref(args.ref_commit)
    m = load_model("smollm2-135m-instruct")
    cfg, rcfg = m.cfg, ref.ModelConfig(**m.cfg.__dict__)
    params = jax.device_put(m.params)
    B, P, T = 64, 48, 48 + 128
    tok = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (B, P)))
    pos = jnp.broadcast_to(jnp.arange(P), (B, P))
    valid = jnp.ones((B, P), bool)

    def programs(mod, c):
        prefill = jax.jit(lambda p, t: mod.forward_cached(p, c, t, pos, mod.init_cache(c, B, T), jnp.int32(0), valid,
                                                          last_only=True, window=P))
        decode = jax.jit(lambda p, cache, t: mod.forward_cached(p, c, t[:, None], jnp.full((B, 1), P), cache,
                                                                jnp.int32(P), jnp.ones((B, 1), bool), window=T))
        grad = jax.jit(jax.grad(lambda p, t: mod.forward(p, c, t, remat="full").mean()))
        return prefill, decode, grad

    progs = {"ref": programs(ref, rcfg), "current": programs(cur, cfg)}
    cache = progs["ref"][0](params, tok)[1]

    def run(name):
        prefill, decode, grad = progs[name]
        times, outs = [], []
        for fn, a in ((prefill, (params, tok)), (decode, (params, cache, tok[:, 0])), (grad, (params, tok[:8]))):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - t0)
            outs.append(out)
        return times, outs

    _, ref_out = run("ref")  # compile both
    _, cur_out = run("current")
    diff = max(float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
               for x, y in zip(ref_out, cur_out) for a, b in zip(jax.tree_util.tree_leaves(x),
                                                                 jax.tree_util.tree_leaves(y)))
    times = {"ref": [], "current": []}
    for _ in range(args.reps):
        for name in ("ref", "current"):
            times[name].append(run(name)[0])
    med = {k: np.median(np.asarray(v), axis=0) for k, v in times.items()}
    # XLA's own count of the compiled programs' work: independent of the machine's load.
    args_of = ((params, tok), (params, cache, tok[:, 0]), (params, tok[:8]))
    cost = {k: [fn.lower(*a).compile().cost_analysis() for fn, a in zip(progs[k], args_of)] for k in progs}
    print(f"reference: decoder.py at {args.ref_commit}; outputs max |diff| {diff:.3g}")
    for i, what in enumerate(("prefill 64 x 48", "decode step, batch 64", "forward+backward 8 x 48, remat=full")):
        c_ref, c_cur = cost["ref"][i], cost["current"][i]
        print(f"{what}: ref {med['ref'][i] * 1e3:.1f} ms, current {med['current'][i] * 1e3:.1f} ms, "
              f"XLA flops ref {c_ref.get('flops', 0):.4g} current {c_cur.get('flops', 0):.4g}, "
              f"bytes accessed ref {c_ref.get('bytes accessed', 0):.4g} current {c_cur.get('bytes accessed', 0):.4g}, "
              f"ratio={med['current'][i] / med['ref'][i]:.3f}")


if __name__ == "__main__":
    main()
