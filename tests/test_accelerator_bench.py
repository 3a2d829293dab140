"""benchmarks/accelerator.py --small runs on CPU and prints the JSON lines the README's table is built from."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_accelerator_benchmark_small(tmp_path):
    out = tmp_path / "bench.jsonl"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "accelerator.py"), "--small", "--reps=1",
                        f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert recs == [json.loads(line) for line in out.read_text().splitlines()]
    by = {}
    for r in recs:
        by.setdefault(r["bench"], []).append(r)
    assert by["device"][0]["matmul_bf16_flops"] > 0 and by["device"][0]["copy_bytes_per_s"] > 0
    checks = {r["check"]: r for r in by["attention"] if "check" in r}
    assert set(checks) == {"dense", "blockwise"}  # no kernel on CPU
    for r in checks.values():  # bfloat16 against float32: errors of bfloat16's size, not of a wrong mask
        assert 0 < r["out_rel_err"] < 0.03 and max(r["dq_rel_err"], r["dk_rel_err"], r["dv_rel_err"]) < 0.03
    timed_ = {r["impl"]: r for r in by["attention"] if "impl" in r}
    assert set(timed_) == {"dense", "blockwise"} and all(r["tokens"] == 512 for r in timed_.values())
    assert timed_["blockwise"]["temp_gib"] < timed_["dense"]["temp_gib"]  # no [T, T] scores
    dec = by["decode"]
    assert [(r["batch"], r["path"]) for r in dec] == [(8, "dense"), (8, "paged"), (16, "dense"), (16, "paged")]
    for r in dec:
        assert r["steps"] == r["new_tokens"] - 1  # no stop ids: every row decodes to its limit
        assert 0 < r["roofline_step_s"] and 0 < r["roofline_fraction"]
        assert r["roofline_fraction"] == r["roofline_step_s"] / r["step_s"]
    hf = by["decode_hf"]  # transformers' generate on the same shapes, beside the sampler's default path
    assert [r["batch"] for r in hf] == [8, 16]
    for r in hf:
        assert r["step_s"] > 0 and r["vs_path"] == "dense" and r["speedup_vs_hf"] > 0
    upd = {r["policy"]: r for r in by["update"]}
    assert set(upd) == {"shared", "isolated"} and upd["isolated"]["slots"] == 3
    for r in upd.values():
        assert r["rows"] == 6 and 0 < r["mfu"] < r["hfu_with_recompute"] and r["step_s"] > 0
    e2e = by["e2e"][0]
    if "skipped" not in e2e:
        assert e2e["workflow"] == "orch_workers"
        assert e2e["sampler_s"] > 0 and e2e["update_s"] > 0 and e2e["reward_s"] >= 0
        assert e2e["sampler_s"] + e2e["update_s"] <= e2e["step_s"] * 1.01
        # After the trainer's warm-up only the first step compiles (each stage's shared-prefix prefill)
        assert len(e2e["steps_s"]) == 2 and e2e["warmup_programs"] > 0 and e2e["steps_compile_programs"][1:] == [0]
        assert e2e["plan_chip"] == "H100-80GB" and 0 < e2e["plan_update_s"] < e2e["plan_step_s"]
    assert by["total"][0]["wall_s"] > 0
