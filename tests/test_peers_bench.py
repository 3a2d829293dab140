"""benchmarks/peers.py: the settings both sides are built from, the prompt token-id check, --help; and, where
the peers extra (trl) is installed, a --small run of both sides."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "peers.py"
_spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("workload", bench.WORKLOADS)
@pytest.mark.parametrize("small", [False, True])
def test_both_sides_get_the_same_settings(workload, small):
    from marl_jax.config import validate

    s = bench.workload_settings(workload, small)
    mc = validate(bench.marl_config(s))
    tk = bench.trl_kwargs(s, "/tmp/unused", steps=3)
    pairs = bench.paired_settings(mc, tk, bench.lora_kwargs(s))
    assert [(k, a, b) for k, a, b in pairs if a != b] == []
    # the table carries the settings themselves, not two copies of one wrong value
    got = {k: a for k, a, _ in pairs}
    assert got["prompts per step"] == s.prompts and got["completions per prompt"] == s.group_size
    assert got["max new tokens"] == s.max_new_tokens and got["learning rate"] == s.lr == 1e-5
    assert got["LoRA rank"] == s.rank and got["LoRA alpha"] == s.alpha
    assert len(got["LoRA targets"]) == 7  # every linear layer of a decoder block
    assert got["KL coefficient"] == 0.0 and got["compute dtype"] == "float32"
    assert tk["gradient_accumulation_steps"] * tk["per_device_train_batch_size"] == s.rows
    assert not tk["shuffle_dataset"] and tk["eval_strategy"] == "no" and tk["save_strategy"] == "no"


def test_workloads_and_overrides():
    short, long = bench.workload_settings("short"), bench.workload_settings("longtail")
    assert (short.prompts, short.group_size, short.max_new_tokens) == (8, 8, 64)
    assert long.max_new_tokens == 512 and long.prompt_dir == "" and short.prompt_dir == "compact"
    # long rows: both sides recompute activations in the backward pass, each its own way
    assert (short.remat, short.trl_checkpointing, long.remat, long.trl_checkpointing) == ("dots", False, "auto", True)
    assert bench.marl_config(long).grpo.remat == "auto" and bench.trl_kwargs(long, "", 1)["gradient_checkpointing"]
    assert any("grpo.remat=auto" in d for d in bench.implementation_differences(long))
    small = bench.workload_settings("longtail", small=True)
    assert small.rows < long.rows and small.max_new_tokens < long.max_new_tokens
    assert bench.workload_settings("short", max_new_tokens=32, prompts=None).max_new_tokens == 32
    with pytest.raises(ValueError, match="multiple of micro_batch"):
        bench.workload_settings("short", prompts=3, group_size=3)
    with pytest.raises(ValueError, match="workload"):
        bench.workload_settings("medium")


def test_every_marl_jax_aggregation_maps_to_its_trl_loss_type():
    from marl_jax.rl.loss import AGG_MODES

    assert set(bench.LOSS_TYPE) == set(AGG_MODES)
    for agg, loss_type in bench.LOSS_TYPE.items():
        s = bench.workload_settings("short", small=True, agg=agg)
        assert bench.trl_kwargs(s, "/tmp/unused", 1)["loss_type"] == loss_type


def test_a_changed_setting_shows_as_a_difference():
    s = bench.workload_settings("short", small=True)
    tk = dict(bench.trl_kwargs(s, "/tmp/unused", 1), temperature=1.0, loss_type="dapo")
    lk = dict(bench.lora_kwargs(s), r=16)
    differ = {k for k, a, b in bench.paired_settings(bench.marl_config(s), tk, lk) if a != b}
    assert differ == {"temperature", "loss aggregation (TRL loss_type)", "LoRA rank"}


def test_prompt_difference():
    a = [[1, 2, 3], [4, 5]]
    assert bench.prompt_difference(a, [[1, 2, 3], [4, 5]]) == ""
    assert "prompt 1 differs at token 1" in bench.prompt_difference(a, [[1, 2, 3], [4, 6]])
    assert "2 prompts against 1" in bench.prompt_difference(a, [[1, 2, 3]])
    # unordered: the same prompts the same number of times, in any order
    assert bench.prompt_difference([[1], [2], [2]], [[2], [1], [2]], ordered=False) == ""
    assert "counted differently" in bench.prompt_difference([[1], [2], [2]], [[2], [1], [1]], ordered=False)


@pytest.mark.parametrize("workload", bench.WORKLOADS)
def test_marl_jax_prompt_ids_equal_transformers_chat_template(smollm, tmp_path, workload):
    """What TRL tokenizes (transformers' apply_chat_template on the exported tokenizer) is what marl_jax samples
    from (the rollout's render_prompt), for the workload's chat messages."""
    import transformers

    s = bench.workload_settings(workload)
    tasks, batches = bench.step_tasks(s, steps=2)
    assert [len(b) for b in batches] == [s.prompts, s.prompts] and batches[0][0] is not batches[1][0]
    wf = bench._workflow(s)
    flat = [t for b in batches for t in b]
    mine = [bench.marl_prompt_ids(wf, smollm.tokenizer, t) for t in flat]
    chats = [bench.chat_messages(wf, t) for t in flat]
    assert [m["role"] for m in chats[0]] == ["system", "user"] and flat[0].question in chats[0][-1]["content"]
    assert mine == [smollm.tokenizer.encode_chat(c) for c in chats]
    smollm.tokenizer.save_hf_dir(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    theirs = tok.apply_chat_template(conversation=chats, add_generation_prompt=True, tokenize=True,
                                     return_dict=True, enable_thinking=False)["input_ids"]
    assert bench.prompt_difference(mine, theirs) == ""


def test_update_flops_follow_the_train_step_rule(smollm):
    import jax

    from marl_jax.policy.lora import PolicySpec

    spec = PolicySpec(rank=8, alpha=16.0, num_slots=1)
    one = bench.update_flops(smollm.cfg, spec, [(40, 24)])
    assert bench.update_flops(smollm.cfg, spec, [(40, 24)] * 3) == pytest.approx(3 * one)
    assert bench.update_flops(smollm.cfg, spec, []) == 0.0
    # frozen base: forward 2 + backward 2 FLOPs per weight per token, about 4 x params x tokens
    n = sum(x.size for x in jax.tree_util.tree_leaves(smollm.params))
    assert 0.5 < one / (4 * n * 64) < 2.0


def test_warm_steps_are_the_later_steps_that_compiled_little():
    """speedup_warm takes marl_jax's later steps whose compiling was at most a tenth of the step, whole (compile
    seconds overlap earlier work on the same cores, so they are not subtracted)."""
    rec = lambda step, compile_s: bench.StepRecord(step_s=step, sample_s=step / 2, generate_s=step / 3, gen_tokens=10,
                                                   prompts=[], lengths=[], reward=0.0, compile_s=compile_s)
    st = bench.summarize([rec(40.0, 30.0), rec(24.0, 18.0), rec(14.0, 1.4), rec(15.0, 2.0), rec(13.0, 0.0)])
    assert st["warm"] == [14.0, 13.0]
    assert st["step_s"] == 14.5  # the steady figure still counts every later step


def test_help_runs_without_loading_anything():
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for flag in ("--workload", "--steps", "--small", "--sides", "--threads"):
        assert flag in p.stdout
    assert 'pip install -e ".[peers]"' in p.stdout


def test_bad_flags_are_argument_errors():
    for bad in (["--steps=0"], ["--group_size=1"], ["--prompts=3", "--group_size=3"], ["--workload=x"]):
        p = subprocess.run([sys.executable, str(SCRIPT), *bad], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, (bad, p.stderr)


def test_small_run_of_both_sides():
    """Runs TRL and marl_jax; only where the peers extra is installed (CI does not install it)."""
    pytest.importorskip("trl", reason="the peers extra is not installed: pip install -e \".[peers]\"")
    p = subprocess.run([sys.executable, str(SCRIPT), "--small", "--workload=short"], cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert "prompt token ids: identical on both sides" in out
    assert "DIFFERS" not in out
    assert out.count("steady ") == 2 and "marl_jax update: useful" in out and "TRL update: useful" in out
    line = [x for x in out.splitlines() if x.startswith("speedup=")]
    assert len(line) == 1 and float(line[0].split()[0].split("=")[1]) > 0
