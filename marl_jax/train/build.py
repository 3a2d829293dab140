"""From a validated config to the runtime pieces shared by the trainer and the rollout CLI."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.config import kv_dtype, paged_kv, validate
from marl_jax.generate.sampler import Sampler
from marl_jax.models import sharding
from marl_jax.models.loading import LoadedModel, load_model, with_param_dtype
from marl_jax.policy.lora import PolicySpec, init_trainable, parse_targets
from marl_jax.policy.slots import role_to_slot
from marl_jax.tasks.base import Task
from marl_jax.workflows import make_workflow


@dataclasses.dataclass
class Runtime:
    config: Any
    model: LoadedModel
    base: Any  # frozen params on device
    mesh: Any
    rules: Any  # logical axis rules (marl_jax.models.sharding)
    workflow: Any
    roles: tuple[str, ...]
    role_to_slot: dict[str, int]
    spec: PolicySpec
    sampler: Sampler
    train_tasks: list[Task]
    val_tasks: list[Task]
    grade_fn: Any
    dtype: Any

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def init_trainable(self, key):
        return self.place(init_trainable(self.spec, self.model.cfg, self.base, key))

    def place(self, tree):
        """Put a parameter-like tree (trainable weights, a train state) into its sharding on the mesh."""
        return tree if self.mesh is None else jax.device_put(tree, sharding.tree_shardings(tree, self.mesh, self.rules))

    def max_new_tokens(self) -> dict[str, int]:
        return {r: int(self.config.rollout.max_new_tokens.get(r, 256)) for r in self.roles}

    def group_by_call_index(self):
        v = str(self.config.rollout.group_by_call_index).lower()
        return None if v == "auto" else v == "true"


def load_tasks(tc) -> list[Task]:
    if tc.source == "reasoning_gym":
        from marl_jax.tasks.math import reasoning_gym_tasks
        return reasoning_gym_tasks(tc.name, tc.size + tc.val_size, seed=0, **dict(tc.difficulty))
    if tc.source == "file":
        from marl_jax.tasks.math import load_math_file
        return load_math_file(tc.path, question_key=tc.question_key, answer_key=tc.answer_key,
                              id_key=tc.id_key or None, limit=tc.size + tc.val_size)
    if tc.source == "humaneval":
        from marl_jax.tasks.code import load_humaneval
        return load_humaneval()[: tc.size + tc.val_size]
    from marl_jax.tasks.code import load_code_jsonl
    return load_code_jsonl(tc.path, question_key=tc.question_key, tests_key=tc.tests_key,
                           id_key=tc.id_key or None, limit=tc.size + tc.val_size)


def split(tasks: list[Task], val_size: int, seed: int = 42) -> tuple[list[Task], list[Task]]:
    """Deterministic held-out split (fixed seed, as the reference's 90/10 split)."""
    if len(tasks) <= val_size:
        raise ValueError(f"only {len(tasks)} tasks but task.val_size={val_size}; lower --config.task.val_size "
                         "or raise --config.task.size")
    order = np.random.RandomState(seed).permutation(len(tasks))
    val = [tasks[i] for i in sorted(order[:val_size])]
    train = [tasks[i] for i in sorted(order[val_size:])]
    return train, val


def make_grade_fn(tc):
    from marl_jax.tasks.grading import grade
    return functools.partial(grade, math_mode=tc.extraction, code_timeout_s=tc.code_timeout_s)


def build(config, *, model: LoadedModel | None = None, tasks: list[Task] | None = None) -> Runtime:
    """`model` / `tasks` may be injected (tests, notebooks); otherwise they come from the config."""
    validate(config)
    dtype = jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32
    rules = sharding.parse_rules(config.mesh.rules)
    mesh = None
    if len(jax.devices()) > 1:
        mesh = sharding.make_mesh(config.mesh.data, config.mesh.model, fsdp=config.mesh.fsdp)
    # Each weight goes straight into its sharding as it is read (no host copy of the whole model), held in
    # model.param_dtype (the frozen base only: what is trained is float32, see policy.lora.init_trainable).
    param_dtype = config.model.get("param_dtype", "auto")
    model = (with_param_dtype(model, param_dtype) if model is not None
             else load_model(config.model.name, dtype=param_dtype, mesh=mesh, rules=rules))
    model = model._replace(cfg=dataclasses.replace(model.cfg, attention=config.model.get("attention", "auto")))
    base = sharding.shard_params(model.params, mesh, rules) if mesh is not None else jax.device_put(model.params)
    opts = {k: v for k, v in dict(config.workflow_options).items()}
    workflow = make_workflow(config.workflow, **opts)
    roles = tuple(workflow.roles)
    mapping = role_to_slot(roles, config.policy)
    spec = PolicySpec(mode=config.trainable.mode, rank=config.trainable.rank, alpha=config.trainable.alpha,
                      targets=parse_targets(config.trainable.targets), num_slots=max(mapping.values()) + 1)
    sampler = Sampler(model.cfg, dtype=dtype, max_batch=config.rollout.max_batch, pad_id=model.tokenizer.pad_id,
                      spec=spec, mesh=mesh, rules=rules, paged=paged_kv(config, jax.default_backend()),
                      kv_block=int(config.rollout.kv_block),
                      compaction_buckets=int(config.rollout.compaction_buckets),
                      compaction_patience=int(config.rollout.compaction_patience),
                      prefill_chunk=int(config.rollout.prefill_chunk),
                      kv_budget_bytes=int(float(config.rollout.get("kv_budget_gb", 0.0)) * 2**30),
                      max_batched_tokens=int(config.rollout.get("max_batched_tokens", 0)),
                      kv_dtype=jnp.dtype(kv_dtype(config)))
    all_tasks = tasks if tasks is not None else load_tasks(config.task)
    train, val = split(list(all_tasks), config.task.val_size)
    return Runtime(config, model, base, mesh, rules, workflow, roles, mapping, spec, sampler, train, val,
                   make_grade_fn(config.task), dtype)
