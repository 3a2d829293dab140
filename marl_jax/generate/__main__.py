"""Generate text with a model: `python -m marl_jax.generate --model=smollm2-135m-instruct --prompt="..." --chat`."""
from __future__ import annotations

import sys
import time

from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "HF checkpoint folder, .gguf file or embedded model name.")
flags.DEFINE_multi_string("prompt", None, "Prompt text (repeat the flag for a batch).")
flags.DEFINE_integer("max_new_tokens", 128, "Maximum new tokens per prompt.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
flags.DEFINE_integer("top_k", 0, "Top-k sampling; 0 = off.")
flags.DEFINE_bool("chat", False, "Wrap each prompt as a user turn with the model's chat template.")
flags.DEFINE_string("system", None, "System message (with --chat).")
flags.DEFINE_integer("seed", 0, "PRNG seed.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
flags.DEFINE_bool("paged", False, "Paged KV cache (blocks held only where rows have tokens; same output).")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; pass text with --prompt=...")
    if not FLAGS.prompt:
        raise app.UsageError("give at least one --prompt=...")
    import jax
    import jax.numpy as jnp

    from marl_jax.jax_setup import enable_compilation_cache

    enable_compilation_cache()

    from marl_jax.generate.sampler import Sampler, SamplingParams
    from marl_jax.models.loading import load_model

    t0 = time.perf_counter()
    m = load_model(FLAGS.model)
    dtype = jnp.bfloat16 if FLAGS.dtype == "bfloat16" else jnp.float32
    params = jax.device_put(m.params)
    tok = m.tokenizer
    prompts = []
    for text in FLAGS.prompt:
        if FLAGS.chat:
            msgs = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else []) + \
                   [{"role": "user", "content": text}]
            prompts.append(tok.encode_chat(msgs, add_generation_prompt=True))
        else:
            prompts.append(tok.encode(text))
    sp = SamplingParams(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                        top_k=FLAGS.top_k, stop_ids=tuple(tok.eos_token_ids))
    sampler = Sampler(m.cfg, dtype=dtype, pad_id=tok.pad_id, paged=FLAGS.paged)
    out = sampler.generate(params, prompts, jax.random.PRNGKey(FLAGS.seed), sp)
    for i in range(len(prompts)):
        ids, _ = out.row(i)
        if len(FLAGS.prompt) > 1:
            print(f"--- [{i}] {FLAGS.prompt[i]!r}")
        print(tok.decode(ids, skip_special_tokens=True))
    n = int(out.lengths.sum())
    print(f"[{n} tokens in {time.perf_counter() - t0:.1f}s incl. load and compile]", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
