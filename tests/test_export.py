"""`python -m marl_jax.export`: exported folders give transformers (and PEFT) the logits of our forward pass.

A run folder is made the way the trainer leaves one (config.json + an orbax checkpoint whose state holds
the slot-stacked trainable parameters), with random, non-zero LoRA B so every adapter changes the output.
The reference is our decoder.forward on the base weights with that slot's adapters applied un-merged.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from marl_jax import export
from marl_jax.configs import get_config
from marl_jax.models import decoder
from marl_jax.models.loading import load_model
from marl_jax.policy.lora import init_trainable
from marl_jax.train.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATOL = 1e-4


def make_run(workdir, model_dir, policy: str, *, step: int = 3, seed: int = 0):
    """A voting run folder over model_dir with random adapters in every slot; returns (config, trainable)."""
    c = get_config("voting")
    c.model.name = str(model_dir)
    c.policy = policy
    c.trainable.update(rank=4, alpha=8.0)  # scale 2: a wrong scale in the export would show
    loaded = load_model(str(model_dir))
    roles = export.workflow_roles(c)
    spec, _ = export.policy_spec(c, roles)
    t = init_trainable(spec, loaded.cfg, loaded.params, jax.random.PRNGKey(seed))
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 2 * len(t)))
    # Distinct adapters per slot (the trainer's start has B = 0 and all slots equal: nothing to tell apart).
    t = {n: {"a": jax.random.normal(next(keys), ab["a"].shape) * 0.1,
             "b": jax.random.normal(next(keys), ab["b"].shape) * 0.1} for n, ab in t.items()}
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(c.to_dict(), f, default=list)
    with Checkpointer(workdir) as ck:
        ck.save(step, {"trainable": jax.device_get(t), "step": np.int32(step), "skipped": np.int32(0)})
    return c, spec, loaded, t


def ours(loaded, spec, trainable, slot, tokens):
    lora = jax.tree_util.tree_map(lambda x: x[slot], trainable)
    return np.asarray(decoder.forward(jax.tree_util.tree_map(np.asarray, loaded.params), loaded.cfg,
                                      tokens, lora=lora, lora_scale=spec.scale))


def hf_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens))).logits.float().numpy()


def _tokens(vocab, seed=0):
    return np.random.RandomState(seed).randint(0, vocab, size=(2, 11))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_isolated_export_loads_in_transformers_with_our_logits(family, tiny_ckpt, tmp_path, torch_threads):
    transformers = pytest.importorskip("transformers")
    import torch

    model_dir = tiny_ckpt(family, tokenizer=True)
    run = tmp_path / "run"
    c, spec, loaded, t = make_run(run, model_dir, "isolated")
    m = export.export_run(str(run), str(tmp_path / "out"))
    assert m["step"] == 3 and m["roles"] == {"generator": "generator", "aggregator": "aggregator"}
    tokens = _tokens(loaded.cfg.vocab_size)
    with torch_threads():
        per_role = {}
        for role, slot in (("generator", 0), ("aggregator", 1)):
            folder = tmp_path / "out" / role
            for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                      "chat_template.jinja", "generation_config.json"):
                assert (folder / f).is_file(), f
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            got, want = hf_logits(hf, tokens), ours(loaded, spec, t, slot, tokens)
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
            per_role[role] = got
    # The two roles' adapters differ, so their exports must too (each folder holds its own slot).
    assert np.abs(per_role["generator"] - per_role["aggregator"]).max() > 1e-2


def test_shared_policy_exports_one_folder_for_every_role(tiny_ckpt, tmp_path, torch_threads):
    transformers = pytest.importorskip("transformers")
    import torch

    model_dir = tiny_ckpt("qwen3", tokenizer=True)
    c, spec, loaded, t = make_run(tmp_path / "run", model_dir, "shared")
    m = export.export_run(str(tmp_path / "run"), str(tmp_path / "out"), role="aggregator")
    assert m["roles"] == {"aggregator": "shared"}
    m = export.export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    assert m["roles"] == {"generator": "shared", "aggregator": "shared"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["roles.json", "shared"]
    tokens = _tokens(loaded.cfg.vocab_size, 1)
    with torch_threads():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / "shared"),
                                                               dtype=torch.float32).eval()
        np.testing.assert_allclose(hf_logits(hf, tokens), ours(loaded, spec, t, 0, tokens), atol=ATOL, rtol=0)


# Not qwen2: transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer whatever tokenizer_config
# says, which re-splits digits; right for real Qwen checkpoints, wrong for this tiny BPE.
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_exported_tokenizer_and_chat_template_match_ours(family, tiny_ckpt, tmp_path):
    transformers = pytest.importorskip("transformers")
    model_dir = tiny_ckpt(family, tokenizer=True)
    _, _, loaded, _ = make_run(tmp_path / "run", model_dir, "shared")
    export.export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out" / "shared"))
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    want = loaded.tokenizer.encode_chat(messages, add_generation_prompt=True)
    got = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    got = got["input_ids"] if isinstance(got, dict) or hasattr(got, "keys") else got
    assert list(got) == want
    gen = json.loads((tmp_path / "out" / "shared" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == list(loaded.tokenizer.eos_token_ids)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_adapter_on_the_base_gives_our_logits(family, tiny_ckpt, tmp_path, torch_threads):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import torch

    model_dir = tiny_ckpt(family, tokenizer=True)
    _, spec, loaded, t = make_run(tmp_path / "run", model_dir, "isolated")
    out = tmp_path / "out"
    export.export_run(str(tmp_path / "run"), str(out), role="aggregator", adapter=True)
    cfg = json.loads((out / "aggregator-adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                    "up_proj", "down_proj"])
    tokens = _tokens(loaded.cfg.vocab_size, 2)
    with torch_threads():
        base = transformers.AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"],
                                                                 dtype=torch.float32).eval()
        np.testing.assert_allclose(hf_logits(base, tokens), ours(loaded, spec, jax.tree_util.tree_map(
            np.zeros_like, t), 1, tokens), atol=ATOL, rtol=0)  # the base folder is the un-adapted model
        model = peft.PeftModel.from_pretrained(base, str(out / "aggregator-adapter")).eval()
        np.testing.assert_allclose(hf_logits(model, tokens), ours(loaded, spec, t, 1, tokens), atol=ATOL, rtol=0)


def test_cli_exports_and_names_the_fix_for_a_wrong_role(tiny_ckpt, tmp_path):
    model_dir = tiny_ckpt("qwen3", tokenizer=True)
    make_run(tmp_path / "run", model_dir, "isolated", step=5)
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "marl_jax.export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'out'}"]
    p = subprocess.run(cmd + ["--role=generator", "--step=5"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "out" / "generator" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "out" / "roles.json").read_text())["step"] == 5
    p = subprocess.run(cmd + ["--role=critic"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2
    assert "--role='critic' is not a role of the voting workflow" in p.stderr and "generator" in p.stderr
    p = subprocess.run(cmd + ["--step=99"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and "99" in p.stderr
