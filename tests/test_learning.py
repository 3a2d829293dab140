"""GRPO learns: a tiny random model on a tiny task goes from near chance to >= 0.9, under both policies.

The task: the prompt names a digit, the answer is that digit (graded by the last number in the
output). A 2-layer character-level model starts near chance; the Voting workflow (two generators and
an aggregator) is trained end to end through the real trainer (rollout, rewards, advantages, jitted
update, validation), once with one shared slot and once with a slot per role.
"""
from __future__ import annotations

import pytest

from marl_jax.models.tiny import char_tokenizer, tiny_model
from marl_jax.tasks.base import Task
from marl_jax.train.loop import Trainer


ALPHABET = "0123456789:\n="
# A minimal chat format ("<question>=") keeps prompts a few tokens long, so a 2-layer model can learn fast.
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def tiny_tokenizer():
    tok = char_tokenizer(ALPHABET)
    tok.chat_template = TEMPLATE
    return tok


def digit_tasks(n: int) -> list[Task]:
    return [Task(f"digit/{i}", "math", str(i % 10), str(i % 10)) for i in range(n)]


def learning_config(policy: str, prompt_dir: str):
    from marl_jax.configs import voting

    c = voting.get_config()
    c.policy = policy
    c.workflow_options.n_votes = 2
    c.workflow_options.prompt_dir = prompt_dir
    c.task.update(extraction="last_number", size=200, val_size=20)
    c.num_tasks = 20
    c.rollout.group_size = 8
    c.rollout.temperature = 1.0
    c.rollout.max_new_tokens.generator = 1
    c.rollout.max_new_tokens.aggregator = 1
    c.trainable.update(mode="full")
    c.optim.update(lr=1e-2, grad_clip=1.0, weight_decay=0.0)
    c.grpo.update(micro_batch=128, diagnostics_every=10)
    # No warm-up (compiling every update shape first): these runs are not about compiling (test_compile_once
    # and the multi-host driver turn it on)
    c.train.update(steps=60, val_every=10, ckpt_every=60, val_temperature=0.0, tensorboard=False, plots=False,
                   warmup=False)
    return c


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["shared", "isolated"])
def test_grpo_lifts_success_from_chance_to_090(policy, prompt_dir, tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model(tok, layers=2, hidden=64, seed=1)
    trainer = Trainer(learning_config(policy, prompt_dir), str(tmp_path), model=model, tasks=digit_tasks(220),
                      progress=False)
    assert trainer.rt.spec.num_slots == (1 if policy == "shared" else 2)
    out = trainer.run()
    from marl_jax.train.metrics import read_metrics

    val = {r["step"]: r["val/success"] for r in read_metrics(str(tmp_path)) if "val/success" in r}
    assert val[0] <= 0.3, f"base model should be near chance, got {val[0]}"
    assert max(v for s, v in val.items() if s > 0) >= 0.9, f"validation success by step: {val}"
    assert "val/success" in out["table"]
