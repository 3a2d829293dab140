"""Generate text with a model: `python -m marl_jax.generate --model=smollm2-135m-instruct --prompt="..." --chat`.

Before anything goes to the device, the call's memory is estimated (marl_jax.generate.prefill.generate_bytes:
weights, the KV cache of prompt + new tokens, one prefill chunk) and a call that would not fit is refused
with the knobs that shrink it."""
from __future__ import annotations

import sys
import time

from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "HF checkpoint folder, .gguf file or embedded model name.")
flags.DEFINE_multi_string("prompt", None, "Prompt text (repeat the flag for a batch).")
flags.DEFINE_multi_string("prompt_file", None, "A file whose text is one prompt (for prompts too long for "
                          "the command line; repeatable, after the --prompt ones).")
# Bounds are checked as the flags are parsed: a bad value ends in one line naming the flag (marl_jax.cli).
flags.DEFINE_integer("max_new_tokens", 128, "Maximum new tokens per prompt.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.", lower_bound=0.0)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1]; 1 = off.", upper_bound=1.0)
flags.register_validator("top_p", lambda p: p > 0.0, "--top_p must be in (0, 1] (1 = off)")
flags.DEFINE_integer("top_k", 0, "Top-k sampling; 0 = off.", lower_bound=0)
flags.DEFINE_bool("chat", False, "Wrap each prompt as a user turn with the model's chat template.")
flags.DEFINE_string("system", None, "System message (with --chat).")
flags.DEFINE_integer("seed", 0, "PRNG seed.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
flags.DEFINE_bool("paged", False, "Paged KV cache (blocks held only where rows have tokens; same output).")
flags.DEFINE_float("kv_budget_gb", 0.0, "Fix the paged KV pool at this many GiB: rows beyond it wait or are "
                   "preempted and recomputed (same output); 0 = no budget.", lower_bound=0.0)
# The default is marl_jax.generate.prefill.PREFILL_CHUNK (and rollout.prefill_chunk's), kept literal so that
# --help does not import JAX.
flags.DEFINE_integer("prefill_chunk", 2048, "Prompts are prefilled in chunks of at most this many tokens "
                     "(rollout.prefill_chunk in configs): prefill memory grows with it, the output does not change.",
                     lower_bound=1)
flags.DEFINE_float("memory_gb", 0.0, "Memory the call may use, in GiB; 0 = what the device (on CPU: the host) "
                   "has free now.", lower_bound=0.0)
flags.DEFINE_bool("ids", False, "Print the generated token ids (space-separated) instead of their text.")
FLAGS = flags.FLAGS

GIB = 2 ** 30


def refusal(est: dict, available: int, n_prompt: int, new_tokens: int, chunk: int, fits: int) -> str:
    """The message for a call whose estimate `est` (generate_bytes) exceeds `available` bytes."""
    g = lambda b: f"{b / GIB:.2f} GiB"
    if fits:
        fix = (f"lower --prefill_chunk (--prefill_chunk={fits} fits; rollout.prefill_chunk in a config), "
               f"--max_new_tokens or the prompt")
    else:
        fix = ("the KV cache and weights alone do not fit at any --prefill_chunk: lower --max_new_tokens or the "
               "prompt, or use --dtype=bfloat16")
    return (f"marl_jax.generate: refusing a prompt of {n_prompt} tokens + {new_tokens} new tokens: it needs about "
            f"{g(est['total'])} (weights {g(est['weights'])}, KV cache {g(est['kv_cache'])}, prefill chunk of "
            f"{chunk} tokens and decode step {g(est['transient'])}) but {g(available)} is available. To fit, {fix}; "
            f"--memory_gb sets the memory to plan for.")


def _resource_exhausted(e: BaseException) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; pass text with --prompt=...")
    texts = list(FLAGS.prompt or [])
    for path in FLAGS.prompt_file or []:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    if not texts:
        raise app.UsageError("give at least one --prompt=... or --prompt_file=...")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.jax_setup import enable_compilation_cache

    enable_compilation_cache()

    from marl_jax.generate.prefill import available_bytes, fitting_chunk, generate_bytes
    from marl_jax.generate.sampler import Sampler, SamplingParams
    from marl_jax.models.loading import load_model

    t0 = time.perf_counter()
    m = load_model(FLAGS.model)
    dtype = jnp.bfloat16 if FLAGS.dtype == "bfloat16" else jnp.float32
    tok = m.tokenizer
    prompts = []
    for text in texts:
        if FLAGS.chat:
            msgs = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else []) + \
                   [{"role": "user", "content": text}]
            prompts.append(tok.encode_chat(msgs, add_generation_prompt=True))
        else:
            prompts.append(tok.encode(text))
    if any(len(p) == 0 for p in prompts):
        sys.exit("marl_jax.generate: a prompt encodes to no tokens; give it some text (or use --chat)")
    # The estimate, before the weights go to the device: the call is refused rather than failing inside XLA.
    lens = [len(p) for p in prompts]
    est_kw = dict(distinct=len({tuple(p) for p in prompts}), min_batch=1, dtype_bytes=jnp.dtype(dtype).itemsize,
                  weight_bytes=sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(m.params)))
    est = generate_bytes(m.cfg, lens, FLAGS.max_new_tokens, chunk=FLAGS.prefill_chunk, **est_kw)
    available = int(FLAGS.memory_gb * GIB) if FLAGS.memory_gb else available_bytes()
    if available is not None and est["total"] > available:
        fits = fitting_chunk(m.cfg, lens, FLAGS.max_new_tokens, available, **est_kw)
        sys.exit(refusal(est, available, max(lens), FLAGS.max_new_tokens, min(FLAGS.prefill_chunk, max(lens)), fits))
    params = jax.device_put(m.params)
    sp = SamplingParams(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                        top_k=FLAGS.top_k, stop_ids=tuple(tok.eos_token_ids))
    # min_batch=1: a single prompt decodes as one row (no training programs to share shapes with here).
    sampler = Sampler(m.cfg, dtype=dtype, pad_id=tok.pad_id, paged=FLAGS.paged, prefill_chunk=FLAGS.prefill_chunk,
                      min_batch=1, kv_budget_bytes=int(FLAGS.kv_budget_gb * 2**30))
    try:
        out = sampler.generate(params, prompts, jax.random.PRNGKey(FLAGS.seed), sp)
    except Exception as e:  # the estimate was short: still no raw XLA traceback
        if isinstance(e, ValueError) and "KV budget" in str(e):
            sys.exit(str(e).replace("--config.rollout.", "--"))
        if not _resource_exhausted(e):
            raise
        sys.exit(f"marl_jax.generate: out of memory after an estimate of {est['total'] / GIB:.2f} GiB "
                 f"({str(e).splitlines()[0][:200]}); lower --prefill_chunk, --max_new_tokens or the prompt")
    for i in range(len(prompts)):
        ids, _ = out.row(i)
        if len(texts) > 1:
            label = FLAGS.prompt[i] if i < len(FLAGS.prompt or []) else FLAGS.prompt_file[i - len(FLAGS.prompt or [])]
            print(f"--- [{i}] {label!r}")
        print(" ".join(map(str, ids)) if FLAGS.ids else tok.decode(ids, skip_special_tokens=True))
    n = int(out.lengths.sum())
    print(f"[{n} tokens in {time.perf_counter() - t0:.1f}s incl. load and compile; prompt {max(lens)} tokens, "
          f"estimated peak {est['total'] / GIB:.2f} GiB]", file=sys.stderr)


if __name__ == "__main__":
    from marl_jax.cli import run

    run(main, "marl_jax.generate")
