"""Export a trained run for serving: one Hugging Face folder per policy slot, LoRA merged in.

    python -m marl_jax.export --workdir=runs/x --out=export/x                  # every role's slot
    python -m marl_jax.export --workdir=runs/x --role=worker --step=30 --out=export/x
    python -m marl_jax.export --workdir=runs/x --out=export/x --adapter        # + PEFT adapters on the base

The run's config.json names the model, workflow, policy and LoRA settings; the checkpoint (latest, best
or a step number) gives the slot-stacked trainable parameters. Written under --out:

  <name>/          config.json, model.safetensors (float32, LoRA folded into the weights: exactly the
                   weights the policy computed with, also over a bfloat16 base), tokenizer.json,
                   tokenizer_config.json, chat_template.jinja, generation_config.json: loads in
                   transformers, vLLM and anything else that reads a Hugging Face folder.
  base/            (--adapter) the frozen base model in the same format, in the dtype it was held in
                   (model.param_dtype: a bfloat16 checkpoint stays bfloat16, the same values)
  <name>-adapter/  (--adapter) adapter_config.json + adapter_model.safetensors in PEFT's LoRA format:
                   PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("base"), "<name>-adapter")
  roles.json       which folder serves which role, the step, the policy

<name> is the role under Isolated-Policy; under Shared-Policy every role shares one slot, so one folder
named "shared" serves them all.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any, Sequence

import numpy as np

from marl_jax.policy.lora import PolicySpec

SHARED_NAME = "shared"
# marl_jax layer matrix -> the module path PEFT names inside model.layers.{i}.
PEFT_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                "w_down": "mlp.down_proj"}


def read_run_config(workdir: str | os.PathLike):
    """The ConfigDict a run was trained with (its workdir's config.json)."""
    import ml_collections

    path = pathlib.Path(workdir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --workdir must be a training run folder "
                                "(launch/run.py writes config.json there when it starts)")
    return ml_collections.ConfigDict(json.loads(path.read_text()))


def policy_spec(config, roles: Sequence[str]) -> tuple[PolicySpec, dict[str, int]]:
    from marl_jax.policy.lora import parse_targets
    from marl_jax.policy.slots import role_to_slot

    mapping = role_to_slot(roles, config.policy)
    t = config.trainable
    targets = parse_targets(t.targets if isinstance(t.targets, str) else tuple(t.targets))
    spec = PolicySpec(mode=t.mode, rank=int(t.rank), alpha=float(t.alpha), targets=targets,
                      num_slots=max(mapping.values()) + 1)
    return spec, mapping


def workflow_roles(config) -> tuple[str, ...]:
    from marl_jax.workflows import make_workflow

    return tuple(make_workflow(config.workflow, **dict(config.workflow_options)).roles)


def peft_state_dict(spec: PolicySpec, lora_one_slot: Any) -> dict[str, np.ndarray]:
    """One slot's adapters under PEFT's names: lora_A [r, in], lora_B [out, r] per layer and module.

    PEFT computes x A^T B^T (alpha / r), the same product as our x A B (alpha / r) with A [in, r], B [r, out].
    """
    sd = {}
    for name, ab in lora_one_slot.items():
        a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
        for i in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{i}.{PEFT_MODULES[name]}"
            sd[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            sd[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return sd


def adapter_config(spec: PolicySpec, base_model: str) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,  # our scale is alpha / r, PEFT's default
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "target_modules": sorted(PEFT_MODULES[n].split(".")[-1] for n in spec.target_names),
        "inference_mode": True,
    }


def write_peft_adapter(path: str | os.PathLike, spec: PolicySpec, lora_one_slot: Any,
                       base_model: str) -> pathlib.Path:
    """adapter_config.json + adapter_model.safetensors that PeftModel.from_pretrained loads."""
    from safetensors.numpy import save_file

    if spec.mode != "lora":
        raise ValueError("--adapter needs a LoRA run (trainable.mode=lora); a full fine-tune has no adapter, "
                         "export it without --adapter")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(adapter_config(spec, base_model), indent=2))
    save_file(peft_state_dict(spec, lora_one_slot), str(path / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return path


def write_model_folder(path: str | os.PathLike, cfg, params: Any, tokenizer, dtype=np.float32) -> pathlib.Path:
    """save_hf_dir (tensors in `dtype`) plus what servers read besides: the chat template as a file and the
    stop tokens."""
    from marl_jax.models.hf import save_hf_dir

    path = save_hf_dir(path, cfg, params, tokenizer=tokenizer, dtype=dtype)
    if tokenizer.chat_template:
        (path / "chat_template.jinja").write_text(tokenizer.chat_template, encoding="utf-8")
    gen = {"eos_token_id": list(tokenizer.eos_token_ids), "pad_token_id": tokenizer.pad_id}
    if tokenizer.bos_id is not None:
        gen["bos_token_id"] = tokenizer.bos_id
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return path


def export_run(workdir: str, out: str, *, step: str = "latest", role: str | None = None, adapter: bool = False,
               model: str | None = None) -> dict[str, Any]:
    """Write the folders described in the module docstring; returns what roles.json holds."""
    import jax

    from marl_jax.models.hf import tree_dtype
    from marl_jax.models.loading import load_model
    from marl_jax.policy.lora import init_trainable, merge_lora
    from marl_jax.rollout import load_trainable

    config = read_run_config(workdir)
    roles = workflow_roles(config)
    spec, mapping = policy_spec(config, roles)
    if role is not None and role not in mapping:
        raise ValueError(f"--role={role!r} is not a role of the {config.workflow} workflow; "
                         f"its roles are {list(roles)} (or pass --all)")
    # The base as the run held it (trained weights are float32 either way; merging is done in float32).
    loaded = load_model(model or config.model.name, dtype=config.model.get("param_dtype", "auto"))
    template = jax.eval_shape(lambda: init_trainable(spec, loaded.cfg, loaded.params, jax.random.PRNGKey(0)))
    template = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), template)
    trainable, n = load_trainable(workdir, str(step), template)
    trainable = jax.tree_util.tree_map(np.asarray, trainable)

    def name_of(r: str) -> str:
        return SHARED_NAME if config.policy == "shared" else r

    wanted = [role] if role is not None else list(dict.fromkeys(roles))
    slots = {name_of(r): mapping[r] for r in wanted}
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if adapter and spec.mode != "lora":
        raise ValueError("--adapter needs a LoRA run (trainable.mode=lora); a full fine-tune has no adapter, "
                         "export it without --adapter")
    base_dir = None
    if adapter:
        base_dir = write_model_folder(out_dir / "base", loaded.cfg, loaded.params, loaded.tokenizer,
                                      dtype=tree_dtype(loaded.params))
    for name, slot in slots.items():
        merged = jax.tree_util.tree_map(np.asarray, merge_lora(spec, loaded.params, trainable, slot))
        write_model_folder(out_dir / name, loaded.cfg, merged, loaded.tokenizer)
        if adapter:
            one = jax.tree_util.tree_map(lambda x: x[slot], trainable)
            write_peft_adapter(out_dir / f"{name}-adapter", spec, one, str(base_dir.resolve()))
    manifest = {"workdir": os.path.abspath(workdir), "step": n, "policy": config.policy,
                "workflow": config.workflow, "model": model or config.model.name,
                "roles": {r: name_of(r) for r in wanted}, "slots": slots,
                "adapters": {name: f"{name}-adapter" for name in slots} if adapter else {},
                "base": "base" if adapter else None}
    (out_dir / "roles.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    from marl_jax.cli import ArgumentParser  # a mistake: one line, exit status 2

    p = ArgumentParser(prog="python -m marl_jax.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="the training run folder (config.json + checkpoints/)")
    p.add_argument("--out", required=True, help="folder to write the exports into")
    p.add_argument("--step", default="latest", help="latest, best or a step number")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--role", default=None, help="export only this role's slot")
    who.add_argument("--all", action="store_true", help="export every role's slot (the default)")
    p.add_argument("--adapter", action="store_true", help="also write PEFT adapters and the base model")
    p.add_argument("--model", default=None, help="the base model, if it moved since training "
                                                 "(default: the run's config.model.name)")
    args = p.parse_args(argv)
    try:
        m = export_run(args.workdir, args.out, step=args.step, role=args.role, adapter=args.adapter, model=args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    for r, name in m["roles"].items():
        print(f"{r}: {os.path.join(args.out, name)}" + (f" (adapter {os.path.join(args.out, name)}-adapter)"
                                                        if args.adapter else ""))
    print(f"step {m['step']} of {args.workdir}; manifest {os.path.join(args.out, 'roles.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
