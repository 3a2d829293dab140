"""Shared-Policy vs Isolated-Policy through the real runtime: same parameters, same rows; different
parameters in one slot change only the rows of the role routed to it.

A tiny random decoder with the embedded SmolLM2 tokenizer keeps the real prompts, chat template, token
splicing and jitted sampler while staying fast. Its LoRA B matrices are made non-zero, so the
adapters really change what is sampled (with B = 0 every slot would equal the base model and the
comparisons could not fail).
"""
from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.models.decoder import ModelConfig, init_params
from marl_jax.models.embedded import embedded_gguf_path
from marl_jax.models.loading import LoadedModel
from marl_jax.models.tokenizer import Tokenizer
from marl_jax.rollout import make_policy_sampler, rollout
from marl_jax.tasks.base import Task
from marl_jax.train.build import build

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = [Task(f"t{i}", "math", f"What is {a} + {b}?", str(a + b)) for i, (a, b) in
         enumerate([(2, 3), (4, 4), (7, 1)])]


def _config(workflow: str, policy: str):
    spec = importlib.util.spec_from_file_location(f"_cfg_{workflow}", os.path.join(REPO, "configs", f"{workflow}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("")
    c.policy = policy
    c.num_tasks = 2
    c.rollout.group_size = 2
    for r in c.rollout.max_new_tokens:
        c.rollout.max_new_tokens[r] = 8
    c.trainable.update(rank=4, alpha=8.0)
    c.task.val_size = 1
    return c


@pytest.fixture(scope="module")
def tiny_model() -> LoadedModel:
    tok = Tokenizer.from_gguf(embedded_gguf_path("smollm2-135m-instruct"))
    cfg = ModelConfig(family="llama", vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    params = jax.tree_util.tree_map(np.asarray, init_params(cfg, jax.random.key(0)))
    return LoadedModel(cfg, params, tok, "tiny-random")


def _with_random_b(trainable, seed):
    """Every slot's LoRA B drawn at random (A keeps its init): slots differ from the base model."""
    rng = np.random.default_rng(seed)  # numpy: no per-op compilation
    return {name: {"a": ab["a"], "b": jnp.asarray(rng.normal(size=ab["b"].shape), jnp.float32)}
            for name, ab in sorted(trainable.items())}


def _copy_slot0(trainable, num_slots):
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x[:1], (num_slots,) + x.shape[1:]), trainable)


def _perturb_slot(trainable, slot, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for name, ab in sorted(trainable.items()):
        b = np.array(ab["b"])
        b[slot] += rng.normal(size=b.shape[1:])
        out[name] = {"a": ab["a"], "b": jnp.asarray(b)}
    return out


def _same_row(a, b):
    assert a.role == b.role and a.stage == b.stage and a.call_index == b.call_index
    assert a.task_id == b.task_id and a.episode_id == b.episode_id
    assert a.prompt_tokens == b.prompt_tokens
    assert a.completion_tokens == b.completion_tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
    assert a.finished == b.finished and a.text == b.text
    assert a.group_key == b.group_key
    assert a.reward == b.reward and a.trained == b.trained


@pytest.fixture(scope="module", params=["voting", "orch_workers"])
def runs(request, tiny_model):
    """SP run, IP run with every slot = the SP slot, and IP runs with one slot perturbed."""
    wf = request.param
    rt_sp = build(_config(wf, "shared"), model=tiny_model, tasks=TASKS)
    rt_ip = build(_config(wf, "isolated"), model=tiny_model, tasks=TASKS)
    tasks = rt_sp.train_tasks[:2]
    assert [t.task_id for t in rt_ip.train_tasks[:2]] == [t.task_id for t in tasks]
    key = jax.random.key(7)
    t_sp = _with_random_b(rt_sp.init_trainable(jax.random.key(1)), seed=2)
    n_ip = rt_ip.spec.num_slots
    t_ip = _copy_slot0(t_sp, n_ip)
    res = {"sp": rollout(rt_sp, tasks, make_policy_sampler(rt_sp, t_sp, key)),
           "ip": rollout(rt_ip, tasks, make_policy_sampler(rt_ip, t_ip, key))}
    for role, slot in rt_ip.role_to_slot.items():
        if slot > 0:  # slot 0 is perturbed by neither: the comparison's control is the IP run itself
            res[role] = rollout(rt_ip, tasks, make_policy_sampler(rt_ip, _perturb_slot(t_ip, slot, seed=3), key))
    return wf, rt_ip, res


def test_shared_and_isolated_with_identical_slots_give_identical_rows(runs):
    wf, rt_ip, res = runs
    sp, ip = res["sp"], res["ip"]
    assert rt_ip.spec.num_slots == len(rt_ip.roles) > 1
    assert len(sp.rows) == len(ip.rows) > 0
    assert {r.role for r in ip.rows} == set(rt_ip.roles)  # every role ran
    for a, b in zip(sp.rows, ip.rows):
        _same_row(a, b)
        assert a.slot == 0
        assert b.slot == rt_ip.roles.index(b.role)  # IP: the i-th role samples from slot i
    assert sp.metrics["success"] == ip.metrics["success"]


def test_perturbing_one_isolated_slot_changes_only_its_role(runs):
    wf, rt_ip, res = runs
    ip, roles = res["ip"], rt_ip.roles
    for role in roles[1:]:
        pert = res[role]
        upstream = roles[: roles.index(role)]  # roles that run before it see nothing it wrote
        base_rows = [r for r in ip.rows if r.role in upstream]
        pert_rows = [r for r in pert.rows if r.role in upstream]
        assert len(base_rows) == len(pert_rows) > 0
        for a, b in zip(base_rows, pert_rows):
            _same_row(a, b)
        base_mine = [r for r in ip.rows if r.role == role]
        pert_mine = [r for r in pert.rows if r.role == role]
        assert len(base_mine) == len(pert_mine) > 0
        mine = list(zip(base_mine, pert_mine))
        for a, b in mine:
            # Same input (upstream unchanged), different parameters: every completion's log-probs move.
            assert a.prompt_tokens == b.prompt_tokens
            assert b.slot == roles.index(role)
            n = min(len(a.logprobs), len(b.logprobs))
            assert a.completion_tokens != b.completion_tokens or \
                np.max(np.abs(np.subtract(a.logprobs[:n], b.logprobs[:n]))) > 1e-3
        assert any(a.completion_tokens != b.completion_tokens for a, b in mine)
