"""Command-line tools as a user runs them: `python -m marl_jax.generate` and `python -m marl_jax.models.parity`,
and every entry point's answer to a mistake on its command line (marl_jax/cli.py).

The subprocesses are independent, so they all start together (module fixture) and each test waits for its own.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from marl_jax.generate.sampler import Sampler, SamplingParams
from marl_jax.models.loading import load_model
from marl_jax.models.parity import compare_logits

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY_PROMPTS = ("the quick brown fox", "What is 2 + 2?")


@pytest.fixture(scope="module")
def tiny_dir(tiny_ckpt):
    return tiny_ckpt("llama", tie=True, num_kv_heads=2, tokenizer=True)


@pytest.fixture(scope="module")
def disagreeing_dir(tiny_ckpt, tmp_path_factory):
    """A checkpoint transformers reads differently from marl_jax: its config asks for a GELU MLP."""
    src = tiny_ckpt("llama", tie=True, num_kv_heads=2)
    out = tmp_path_factory.mktemp("gelu")
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def runs(tiny_dir, disagreeing_dir, tmp_path_factory):
    """Start every CLI run at once; runs(name) -> (returncode, stdout, stderr)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MARL_JAX_CACHE": str(tmp_path_factory.mktemp("xla-cache"))}
    gen = [sys.executable, "-m", "marl_jax.generate"]
    parity = [sys.executable, "-m", "marl_jax.models.parity"]
    commands = {
        "tiny": gen + [f"--model={tiny_dir}", *(f"--prompt={p}" for p in TINY_PROMPTS), "--max_new_tokens=8"],
        "tiny_paged": gen + [f"--model={tiny_dir}", *(f"--prompt={p}" for p in TINY_PROMPTS), "--max_new_tokens=8",
                             "--paged"],
        "chat": gen + ["--model=smollm2-135m-instruct", "--chat", "--prompt=What is the capital of France?",
                       "--max_new_tokens=12"],
        "parity_ok": parity + [f"--hf_dir={tiny_dir}"],
        "parity_bad": parity + [f"--hf_dir={disagreeing_dir}"],
        "no_prompt": gen + [f"--model={tiny_dir}"],
    }
    procs = {name: subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, cmd in commands.items()}
    done: dict[str, tuple[int, str, str]] = {}

    def result(name: str) -> tuple[int, str, str]:
        if name not in done:
            out, err = procs[name].communicate(timeout=600)
            done[name] = (procs[name].returncode, out, err)
        return done[name]

    yield result
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_generate_on_hf_folder_prints_the_greedy_completions(runs, tiny_dir):
    rc, out, err = runs("tiny")
    assert rc == 0, err[-3000:]
    # What the library itself generates for the same request.
    m = load_model(str(tiny_dir))
    tok = m.tokenizer
    prompts = [tok.encode(p) for p in TINY_PROMPTS]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, stop_ids=tuple(tok.eos_token_ids))
    res = Sampler(m.cfg, pad_id=tok.pad_id).generate(jax.device_put(m.params), prompts, jax.random.PRNGKey(0), sp)
    pos = 0
    for i, p in enumerate(TINY_PROMPTS):
        header = f"--- [{i}] {p!r}"
        text = tok.decode(res.row(i)[0], skip_special_tokens=True)
        pos = out.index(header, pos) + len(header)
        assert out[pos:].startswith("\n" + text), (text, out)
    n = int(re.search(r"\[(\d+) tokens in [\d.]+s", err).group(1))
    assert n == int(res.lengths.sum()) and n > 0


def test_generate_paged_prints_the_same_completions(runs):
    rc, out, err = runs("tiny_paged")
    assert rc == 0, err[-3000:]
    assert out == runs("tiny")[1]


def test_generate_chat_on_embedded_model(runs):
    rc, out, err = runs("chat")
    assert rc == 0, err[-3000:]
    text = out.strip()
    assert text and "<|im_" not in text and "assistant" not in text.split()[0].lower()
    assert "Paris" in text, text  # the chat template really framed a question the model could answer


def test_generate_usage_errors(runs):
    rc, _, err = runs("no_prompt")
    assert rc == 2 and err.strip() == "marl_jax.generate: give at least one --prompt=... or --prompt_file=...", err


def _metrics(out: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"^(max_abs_logit_diff|mean_kl|greedy_agreement)=(\S+)$", out, re.M)}


def test_parity_cli_passes_on_a_tiny_checkpoint(runs):
    rc, out, err = runs("parity_ok")
    assert rc == 0, (out, err[-3000:])
    m = _metrics(out)
    assert set(m) == {"max_abs_logit_diff", "mean_kl", "greedy_agreement"}
    assert 0 <= m["max_abs_logit_diff"] <= 1e-4 and abs(m["mean_kl"]) <= 1e-8 and m["greedy_agreement"] == 1.0
    assert "PASS" in out


def test_parity_cli_fails_when_models_disagree(runs):
    """The GELU checkpoint: marl_jax either refuses it (an error naming hidden_act) or loads it and parity
    reports the disagreement; either way the exit status is 1."""
    rc, out, err = runs("parity_bad")
    assert rc == 1, (out, err[-3000:])
    m = _metrics(out)
    if m:
        assert m["max_abs_logit_diff"] > 1e-3 and "FAIL" in out
    else:
        assert "hidden_act" in err, err[-3000:]


def test_compare_logits_hand_worked():
    """Two positions compared, one masked out (its huge difference must not count)."""
    ref = np.array([[[0.0, 0.0], [5.0, 1.0], [100.0, -100.0]]])
    ours = np.array([[[0.0, math.log(3.0)], [5.0, 1.5], [-100.0, 100.0]]])
    valid = np.array([[True, True, False]])
    r = compare_logits(ref, ours, valid)
    assert r.max_abs_diff == pytest.approx(math.log(3.0))
    # KL(ref || ours): position 0 is 0.5 * log(4/3) (p = [1/2, 1/2] vs q = [1/4, 3/4]); position 1 by hand.
    p1 = np.exp([5.0, 1.0]) / np.exp([5.0, 1.0]).sum()
    q1 = np.exp([5.0, 1.5]) / np.exp([5.0, 1.5]).sum()
    kl1 = float(np.sum(p1 * np.log(p1 / q1)))
    assert r.mean_kl == pytest.approx((0.5 * math.log(4 / 3) + kl1) / 2, rel=1e-9)
    assert r.greedy_agreement == 0.5  # position 0: argmax 0 vs 1; position 1: both 0
    assert not r.ok(atol=1e-4) and not r.ok(atol=2.0) and r.ok(atol=2.0, min_agreement=0.5)


# ---- mistakes on the command line: one line naming the key and the fix, exit status 2, no traceback ----

def _user_env() -> dict[str, str]:
    """A user's shell: no JAX_PLATFORMS (the tools choose the platforms, so a backend probe would show), no
    MARL_JAX_TRACEBACK."""
    return {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "MARL_JAX_TRACEBACK")}


_PY = sys.executable
_VOTING = "--config=configs/voting.py"
# (command, the tool's name on the line, what the line must say: the key or flag and its fix)
MISTAKES = {
    "unknown_config_key": ([_PY, "launch/run.py", _VOTING, "--config.polcy=shared"], "run.py",
                           ["unknown config key 'polcy'", "did you mean --config.policy?", "keys of --config: "]),
    "unknown_nested_key": ([_PY, "-m", "marl_jax.plan", _VOTING, "--config.rollout.max_new_token.generator=3"],
                           "marl_jax.plan",
                           ["'max_new_token'", "did you mean --config.rollout.max_new_tokens.generator?"]),
    "wrong_type": ([_PY, "launch/run.py", _VOTING, "--config.optim.lr=abc"], "run.py",
                   ["--config.optim.lr=abc", "--config.optim.lr takes a float"]),
    "not_a_value": ([_PY, "launch/run.py", _VOTING, "--config.rollout.max_new_tokens=3"], "run.py",
                    ["is a group of keys (aggregator, generator)",
                     "set one of them, e.g. --config.rollout.max_new_tokens."]),
    "validate_errors": ([_PY, "launch/run.py", _VOTING, "--config.policy=foo", "--config.optim.lr=-1"], "run.py",
                        ["--config.policy='foo' is not one of ['shared', 'isolated']",
                         "; --config.optim.lr must be > 0, got -1.0"]),
    "unknown_flag": ([_PY, "launch/run.py", _VOTING, "--workdirr=runs/x"], "run.py",
                     ["unknown flag --workdirr", "did you mean --workdir?"]),
    "misspelt_config_flag": ([_PY, "-m", "marl_jax.rollout", _VOTING, "--confg.policy=shared"], "marl_jax.rollout",
                             ["unknown flag --confg.policy", "did you mean --config.policy?"]),
    "no_config_file": ([_PY, "launch/run.py", "--config=configs/votnig.py"], "run.py",
                       ["no config file 'configs/votnig.py'", "--config=configs/<workflow>.py"]),
    "bad_config_argument": ([_PY, "launch/run.py", "--config=configs/voting.py:qwen3,math"], "run.py",
                            ["config argument 'qwen3,math'", "e.g. configs/voting.py:qwen3-1.7b,math"]),
    "missing_config": ([_PY, "launch/run.py"], "run.py", ["--config is required", "configs/<workflow>.py"]),
    "generate_max_new_tokens": ([_PY, "-m", "marl_jax.generate", "--prompt=hi", "--max_new_tokens=0"],
                                "marl_jax.generate", ["--max_new_tokens=0: 0 is not a positive integer",
                                                      "Maximum new tokens per prompt"]),
    "generate_top_p": ([_PY, "-m", "marl_jax.generate", "--prompt=hi", "--top_p=0"], "marl_jax.generate",
                       ["--top_p=0", "must be in (0, 1]"]),
    "rollout_flag_type": ([_PY, "-m", "marl_jax.rollout", _VOTING, "--seed=x"], "marl_jax.rollout",
                          ["--seed=x", "--seed: PRNG seed"]),
    "sweep_matrix_key": ([_PY, "launch/sweep.py", "--matrix=configs/matrix.py:cpu-small", "--root=unused",
                          "--print_commands", "--matrix.seed=1"], "sweep.py", ["did you mean --matrix.seeds?"]),
    "report_required": ([_PY, "launch/report.py"], "report.py", ["--root is required"]),
    "parity_required": ([_PY, "-m", "marl_jax.models.parity"], "marl_jax.models.parity", ["--hf_dir is required"]),
    "export_argparse": ([_PY, "-m", "marl_jax.export", "--out=unused"], "python -m marl_jax.export",
                        ["the following arguments are required: --workdir"]),
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_a_command_line_mistake_is_one_line_naming_the_fix(case):
    """Before anything loads: exit status 2, nothing on stdout, one line on stderr (`<tool>: ...`) that names the
    key or flag and the fix, no traceback, and no backend-probe noise."""
    cmd, prog, wanted = MISTAKES[case]
    p = subprocess.run(cmd, cwd=REPO, env=_user_env(), capture_output=True, text=True, timeout=120)
    err = p.stderr
    assert p.returncode == 2, (p.returncode, err[-3000:])
    assert "Traceback" not in err and "Unable to initialize backend" not in p.stdout + err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prog + ": "), err
    for w in wanted:
        assert w in lines[0], (w, lines[0])
    assert p.stdout == ""


def test_a_cli_run_on_cpu_prints_no_backend_probe(tiny_dir, tmp_path):
    """A whole generate run on a CPU machine as a user starts it (no JAX_PLATFORMS; libtpu may be installed):
    neither JAX's "Unable to initialize backend 'tpu'" (absl's default INFO level would pass it on) nor libtpu's
    own messages."""
    p = subprocess.run([_PY, "-m", "marl_jax.generate", f"--model={tiny_dir}", "--prompt=hi", "--max_new_tokens=2"],
                       cwd=REPO, env={**_user_env(), "MARL_JAX_CACHE": str(tmp_path)}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "Unable to initialize backend" not in out, p.stderr[-3000:]
    from marl_jax.jax_setup import tpu_present

    if not tpu_present():  # where a TPU may be, JAX opens it, as it should
        assert "libtpu" not in out and "TPU" not in out, p.stderr[-3000:]
