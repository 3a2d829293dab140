"""One process of a tiny-model training on a CPU 'cluster' (used by test_multihost).

    python tests/multihost_driver.py <process_id> <num_processes> <port> <workdir> <prompt_dir> <local_devices>

num_processes=1 runs without jax.distributed (the single-host reference on the same global mesh).
"""
import json
import os
import sys

pid, nproc, port, workdir, prompt_dir, local = sys.argv[1:7]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local} --xla_cpu_multi_thread_eigen=false"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(REPO, "configs"), REPO]

import jax  # noqa: E402

if int(nproc) > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=int(nproc),
                               process_id=int(pid))

from test_learning import digit_tasks, learning_config, tiny_tokenizer  # noqa: E402

from marl_jax.models.tiny import tiny_model  # noqa: E402
from marl_jax.train.loop import Trainer  # noqa: E402

c = learning_config("isolated", prompt_dir)
# Fewer rows than the learning runs (64 a stage, one batch): the warm-up's set, compiled one program at a time on
# each of three processes sharing two cores in CI, stays small.
c.num_tasks, c.rollout.max_batch = 4, 64
# With the warm-up: its compiles must run in the same order on both processes (Trainer.warmup)
c.train.update(steps=2, val_every=2, ckpt_every=2, plots=False, tensorboard=False, warmup=True)
Trainer(c, workdir, model=tiny_model(tiny_tokenizer(), seed=1), tasks=digit_tasks(220), progress=False).run()
print(json.dumps({"process": jax.process_index(), "devices": len(jax.devices()),
                  "local_devices": len(jax.local_devices())}), flush=True)
