"""Runs a short tiny-model training into a workdir (used by test_resume as a separate, killable process)."""
import json
import os
import sys

# One XLA:CPU thread: multi-threaded reductions may sum in a load-dependent order (differences of
# ~1e-7 between two runs on a busy machine), which would hide what this test checks: the resume logic.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))

from test_learning import digit_tasks, learning_config, tiny_tokenizer  # noqa: E402

from marl_jax.jax_setup import enable_compilation_cache  # noqa: E402
from marl_jax.models.tiny import tiny_model  # noqa: E402
from marl_jax.train.loop import Trainer  # noqa: E402


def main(workdir: str, prompt_dir: str, policy: str, steps: int, levers: str = ""):
    enable_compilation_cache()
    c = learning_config(policy, prompt_dir)
    c.train.update(steps=steps, val_every=2, ckpt_every=2, warmup=False)  # not about compiling
    c.grpo.diagnostics_every = 1
    for kv in filter(None, levers.split(",")):  # e.g. "damping=0.3,damping_window=4"
        k, v = kv.split("=")
        c.levers[k] = type(c.levers[k])(v)
    Trainer(c, workdir, model=tiny_model(tiny_tokenizer(), seed=1), tasks=digit_tasks(220), progress=False).run()
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:6])
