"""The training loop: rollout -> rewards -> GRPO advantages -> jitted update, with validation,
checkpoints, metrics, cliff detection and an end-of-run summary.

Everything random is keyed by (seed, step), and the data iterator's state is checkpointed, so a run
resumed from its last checkpoint produces the metrics it would have produced uninterrupted
(wall-clock fields aside).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models.sharding import to_device, to_host
from marl_jax.policy.sampling import PolicySampler
from marl_jax.rl import levers as levers_lib, optim
from marl_jax.rl.advantages import grpo_advantages, group_outcomes
from marl_jax.rl.batch import make_batch, make_groups
from marl_jax.rl.update import TrainState, UpdateConfig, init_state, make_train_step
from marl_jax.tasks.data import task_batches
from marl_jax.train import compiles
from marl_jax.train.build import Runtime, build
from marl_jax.train.checkpoint import Checkpointer, ConfigChangedError, RESUMABLE_KEYS, config_changes
from marl_jax.train.cliff import CliffMonitor, detect_cliff
from marl_jax.train.metrics import MetricsWriter, metrics_path, read_metrics
from marl_jax.train.rundir import RunDir
from marl_jax.workflows.base import parallel_copies  # noqa: F401 (importable from here as well)
from marl_jax.workflows.rollout import run_episodes

# Metrics that depend on wall-clock time (excluded when comparing resumed runs).
# Step-record keys that depend on the machine or on cache state (the sampler's, from PolicySampler.summary):
# not compared between runs that should otherwise agree.
TIMING_KEYS = ("tokens_per_s", "step_s", "sampler_s", "glue_s", "reward_s", "update_s", "sample_prefill_s",
               "sample_decode_s", "sample_row_use", "sample_cached_frac", "sample_peak_kv_mib",
               # compiles depend on what the process (and the persistent cache) compiled before
               *compiles.RECORD_KEYS, *(f"val/{k}" for k in compiles.RECORD_KEYS), "warmup_s", "warmup_programs",
               "warmup_compile_s")


def _host(x):
    return to_host(x)


def update_record(m: dict, roles, role_to_slot, copies) -> dict[str, float]:
    """Flatten the update's metrics into named scalars (see marl_jax.train.metrics for names)."""
    out = {"loss": float(_host(m["loss"])), "finite": bool(_host(m["finite"]))}
    if int(_host(m.get("misaligned_rows", 0))):
        raise ValueError("per-group gradients need a group-aligned batch: build it with "
                         "make_batch(..., align_groups=True)")
    if "role_grad_norm" in m:
        norm, share = _host(m["role_grad_norm"]), _host(m["role_grad_share"])
        nshare, align, cos = _host(m["role_grad_norm_share"]), _host(m["role_copy_alignment"]), _host(m["role_grad_cos"])
        for k, r in enumerate(roles):
            out[f"grad/{r}/norm"] = float(norm[k])
            out[f"grad/{r}/share"] = float(share[k])
            out[f"grad/{r}/norm_share"] = float(nshare[k])
            if copies.get(r, 1) > 1:
                out[f"grad/{r}/copy_alignment"] = float(align[k])
            for j in range(k + 1, len(roles)):
                if role_to_slot[r] == role_to_slot[roles[j]]:
                    out[f"grad/cos/{r}~{roles[j]}"] = float(cos[k, j])
    if "role_stats" in m:
        st = {k: _host(v) for k, v in m["role_stats"].items()}
        for k, r in enumerate(roles):
            tok = max(float(st["tokens"][k]), 1.0)
            if st["rows"][k] == 0:
                continue
            out[f"{r}/clip_frac"] = float(st["clip"][k]) / tok
            out[f"{r}/approx_kl"] = float(st["approx_kl"][k]) / tok
            if "entropy" in st:
                out[f"{r}/entropy"] = float(st["entropy"][k]) / tok
            if "kl" in st:
                out[f"{r}/kl"] = float(st["kl"][k]) / tok
            if "logp_gap_abs" in st:  # the sampler's log-probs against the trainer's for the same tokens
                out[f"logp_gap/{r}/mean_abs"] = float(st["logp_gap_abs"][k]) / tok
                out[f"logp_gap/{r}/k3"] = float(st["logp_gap_k3"][k]) / tok
            if "tis_capped" in st:
                out[f"logp_gap/{r}/tis_capped_frac"] = float(st["tis_capped"][k]) / tok
    if "levers" in m:
        out.update(levers_lib.records(m["levers"], roles))
    slot_norm = _host(m["slot_grad_norm"])
    for s, v in enumerate(slot_norm):
        out[f"grad/slot{s}/norm"] = float(v)
    return out


def validate_policy(rt: Runtime, trainable, key, step: int, workdir: str | None = None) -> dict[str, float]:
    """pass@1 of the final answer on the held-out split: the mean over train.val_samples episodes per
    task (sampled at train.val_temperature). With a workdir, each task's mean success is appended to
    <workdir>/val_tasks.jsonl (paired comparisons between runs on the same tasks)."""
    c = rt.config
    n = int(c.train.get("val_samples", 1))
    compiled_before = compiles.snapshot()
    sample = PolicySampler(rt.sampler, rt.base, trainable, key, temperature=c.train.val_temperature,
                           top_p=c.rollout.top_p, top_k=c.rollout.top_k, stop_ids=tuple(rt.tokenizer.eos_token_ids))
    res = run_episodes(rt.workflow, rt.val_tasks, n, sample, rt.tokenizer, role_to_slot=rt.role_to_slot,
                       credit="broadcast", grade_fn=rt.grade_fn, max_new_tokens=rt.max_new_tokens())
    if workdir is not None and jax.process_index() == 0:
        per_task: dict[str, list[float]] = {}
        for e in res.episodes:
            per_task.setdefault(str(e.task.task_id), []).append(float(e.success))
        with open(os.path.join(workdir, "val_tasks.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "samples": n, "temperature": float(c.train.val_temperature),
                                "success": {t: float(np.mean(v)) for t, v in per_task.items()}}) + "\n")
    rec = {"step": step}
    for k, v in res.metrics.items():
        if k == "success" or k.endswith("/accuracy") or k in ("any_correct", "iterations", "items"):
            rec[f"val/{k}"] = float(v)
    rec.update(compiles.record(compiled_before, prefix="val/"))
    return rec


class Trainer:
    """Holds the runtime, the jitted step and the run's state; `run()` trains to config.train.steps."""

    def __init__(self, config, workdir: str, *, model=None, tasks=None, progress: bool = True,
                 allow_config_change: bool = False):
        self.c = config
        # A gs:// (or other URI) workdir: records in a local mirror synced to it, checkpoints straight to it.
        self.run_dir = RunDir(workdir)
        if jax.process_index() == 0:
            self.run_dir.pull()  # a resumed run continues the URI's records
        self.workdir = workdir = self.run_dir.local
        self.progress = progress
        # before anything is loaded or rewritten
        check_resume_config(workdir, config, allow_config_change, ckpt_dir=self.run_dir.uri)
        self.rt = rt = build(config, model=model, tasks=tasks)
        if jax.process_index() == 0:  # what the run was, for sweeps and reports
            with open(os.path.join(workdir, "config.json"), "w") as f:
                json.dump(_jsonable(config.to_dict()), f, indent=1, sort_keys=True)
        self.copies = parallel_copies(rt.workflow) if config.grpo.copy_alignment else {}
        self.groups = make_groups(rt.roles, rt.role_to_slot, self.copies)
        g = config.grpo
        self.kl_coef = {r: float(g.kl_coef.get(r, 0.0)) for r in rt.roles}
        self.ucfg = UpdateConfig(clip_low=g.clip_low, clip_high=g.clip_high, dual_clip=g.dual_clip or None, agg=g.agg,
                                 kl=any(v > 0 for v in self.kl_coef.values()),
                                 kl_estimator=levers_lib.kl_estimator(g.kl_estimator),
                                 entropy_coef=g.entropy_coef, old_logp=g.old_logp, micro_batch=g.micro_batch,
                                 max_len_norm=float(max(rt.max_new_tokens().values())),  # Dr. GRPO's constant
                                 diagnostics=g.diagnostics, metrics=g.metrics, remat=g.remat,
                                 remat_budget_gb=g.remat_budget_gb, packing=g.packing,
                                 share_prefix=int(g.share_prefix), unroll=bool(g.unroll),
                                 length_grid=int(g.length_grid),
                                 max_tokens_per_micro_batch=int(g.max_tokens_per_micro_batch),
                                 tis_cap=float(g.get("tis_cap", 0.0)), dtype=rt.dtype,
                                 temperature=float(config.rollout.temperature) or 1.0)
        o = config.optim
        self.tx = optim.per_slot(optim.make_optimizer(
            lr=o.lr, weight_decay=o.weight_decay, grad_clip=o.grad_clip, schedule=o.schedule,
            warmup_steps=o.warmup_steps, total_steps=max(config.train.steps, o.warmup_steps + 1),
            min_lr_ratio=o.min_lr_ratio))
        tables = dict(num_groups=len(self.groups.names), group_slot=self.groups.slot,
                      group_role=[rt.roles.index(r) for r in self.groups.role], num_roles=len(rt.roles),
                      role_slot=[rt.role_to_slot[r] for r in rt.roles])
        tables.update(mesh=rt.mesh, rules=rt.rules)  # shardings of the update program, from the rules
        self.tables = tables  # make_train_step's workflow tables (benchmarks build other updates from them)
        self.levers = lever_config(config, rt.roles, parallel_copies(rt.workflow))
        self.step_fn = make_train_step(rt.model.cfg, rt.spec, self.ucfg, self.tx, levers=self.levers, **tables)
        # Steps between diagnostics run the cheaper program (one backward pass instead of one per group).
        self.plain_step_fn = (make_train_step(rt.model.cfg, rt.spec, dataclasses.replace(self.ucfg, diagnostics=False),
                                              self.tx, **tables)
                              if g.diagnostics and g.diagnostics_every > 1 else self.step_fn)
        self.key = jax.random.PRNGKey(config.train.seed)
        self.state = rt.place(init_state(rt.init_trainable(jax.random.fold_in(self.key, 0)), self.tx))
        if self.levers.damps:  # each role's gradient EMA, checkpointed with the state
            self.state = self.state._replace(grad_ema=rt.place(levers_lib.init_ema(self.state.trainable,
                                                                                   len(rt.roles))))
        # One T and W for every batch: the update's programs then come from one set (rl.layout.update_shapes)
        from marl_jax.plan import call_shapes, update_lengths
        self.lengths = update_lengths(config)
        # And each stage's sampler call (plan.call_shapes): stage -> (role, generate.types.CallShape)
        self.call_shapes = call_shapes(config)
        self.data = task_batches(rt.train_tasks, batch_size=config.num_tasks, seed=config.train.seed)
        self.monitor = CliffMonitor(drop=config.train.cliff_drop, patience=config.train.cliff_patience)
        self.ckpt = Checkpointer(self.run_dir.uri, keep=config.train.keep_ckpts)
        self.start_step = 0
        latest = self.ckpt.latest_step()
        if latest is not None:
            state, meta = self.ckpt.restore(latest, template=self._ckpt_state())
            self.state = rt.place(TrainState(state["trainable"], state["opt_state"], jnp.asarray(state["step"]),
                                             jnp.asarray(state["skipped"]), state.get("grad_ema")))
            self.data.set_state(meta["data"])
            self.monitor.load_state(meta["cliff"])
            self.start_step = latest
        # One writer per run: on several hosts every process computes the same records; process 0 writes them.
        # Without a checkpoint the run starts at step 0, so the records of an earlier attempt that died before
        # its first checkpoint are dropped (kept, those steps would appear twice and the summary would refuse).
        restart = latest is None and os.path.isfile(metrics_path(workdir))
        self.writer = (MetricsWriter(workdir, tensorboard=config.train.tensorboard,
                                    resume_step=self.start_step if latest is not None else (-1 if restart else None))
                       if jax.process_index() == 0 else _NoWriter())

    def _ckpt_state(self):
        s = self.state
        out = {"trainable": s.trainable, "opt_state": s.opt_state, "step": s.step, "skipped": s.skipped}
        if s.grad_ema is not None:
            out["grad_ema"] = s.grad_ema
        return out

    def _save(self, step: int, best: float | None):
        meta = {"data": self.data.get_state(), "cliff": self.monitor.state(), "config": self.c.to_dict()}
        self.ckpt.save(step, jax.device_get(self._ckpt_state()), meta=_jsonable(meta), best_metric=best)
        self._sync()

    def _sync(self):
        """Copy the run's records to a gs:// workdir (no-op for a local one)."""
        if self.run_dir.remote and jax.process_index() == 0:
            self.writer.flush()
            self.run_dir.push()

    def rollout_sampler(self, key) -> PolicySampler:
        """The training rollouts' sampler: the config's sampling settings, each stage's call at its CallShape."""
        rt, c = self.rt, self.c
        return PolicySampler(rt.sampler, rt.base, self.state.trainable, key, temperature=c.rollout.temperature,
                             top_p=c.rollout.top_p, top_k=c.rollout.top_k, stop_ids=tuple(rt.tokenizer.eos_token_ids),
                             shapes={st: shape for st, (_, shape) in self.call_shapes.items()})

    def train_step(self, step: int) -> dict[str, Any]:
        rt, c = self.rt, self.c
        t0 = time.perf_counter()
        compiled_before = compiles.snapshot()
        tasks = next(self.data)
        sample = self.rollout_sampler(jax.random.fold_in(self.key, step + 1))
        res = run_episodes(rt.workflow, tasks, c.rollout.group_size, sample, rt.tokenizer,
                           role_to_slot=rt.role_to_slot, credit=c.rollout.credit, grade_fn=rt.grade_fn,
                           max_new_tokens=rt.max_new_tokens(), group_by_call_index=rt.group_by_call_index())
        rows = res.rows
        rewards = np.asarray([r.reward for r in rows], np.float32)
        keys = [r.group_key for r in rows]
        adv = grpo_advantages(rewards, keys, standardize=c.advantage.standardize, eps=c.advantage.eps)
        adv = np.where([r.trained for r in rows], adv, 0.0).astype(np.float32)
        batch = make_batch(rows, adv, role_to_slot=rt.role_to_slot, num_slots=rt.spec.num_slots, groups=self.groups,
                           micro_batch=c.grpo.micro_batch, pad_id=rt.tokenizer.pad_id, kl_coef=self.kl_coef,
                           agg=c.grpo.agg, keep_zero_advantage=self.ucfg.kl or self.ucfg.entropy_coef != 0.0,
                           align_groups=c.grpo.diagnostics, width=max(rt.max_new_tokens().values()),
                           seq_len=self.lengths[0])
        t1 = time.perf_counter()
        fn = self.step_fn if step % max(c.grpo.diagnostics_every, 1) == 0 else self.plain_step_fn
        with compiles.part("update"):  # its compiles counted apart from the sampler's (update_compile_s)
            self.state, m = fn(self.state, rt.base, to_device(batch))
            rec = {"step": step + 1, **{k: float(v) for k, v in res.metrics.items()}}
            rec.update(update_record(m, rt.roles, rt.role_to_slot, self.copies))
        rec["reward_mean"] = float(rewards.mean()) if len(rewards) else 0.0
        rec.update({k: float(v) for k, v in group_outcomes(rewards, keys).items()})
        rec["skipped_updates"] = int(_host(self.state.skipped))
        t2 = time.perf_counter()
        gen_tokens = sum(len(r.completion_tokens) for r in rows)
        rec.update(step_s=t2 - t0, update_s=t2 - t1, tokens_per_s=gen_tokens / max(t2 - t0, 1e-9),
                   **{k: float(v) for k, v in res.timing.items() if k in ("sampler_s", "glue_s", "reward_s")})
        rec.update(sample.summary())
        rec.update(compiles.record(compiled_before))
        return rec

    def warmup(self) -> dict[str, Any]:
        """Compile every update program the config allows (rl.update's step.warmup) and the rollouts' sampler
        programs (Sampler.warmup at each stage's CallShape) before the first step; what it took (warmup_s,
        warmup_programs, warmup_compile_s: logged with the process's first train step)."""
        t0, before = time.perf_counter(), compiles.snapshot()
        T, W = self.lengths
        # With several processes, one at a time: compiles from threads (finishing in any order on each process)
        # broke the two-process CPU run's gloo collectives (tests/test_multihost.py).
        workers = max(1, min(4, os.cpu_count() or 1)) if jax.process_count() == 1 else 1
        with compiles.part("update"):
            for fn in dict.fromkeys((self.step_fn, self.plain_step_fn)):
                fn.warmup(self.state, self.rt.base, T, W, workers=workers)
        self.rollout_sampler(self.key).warmup({st: role for st, (role, _) in self.call_shapes.items()},
                                              self.rt.role_to_slot, self.rt.max_new_tokens(), workers=workers)
        d = compiles.since(before)["all"]
        return {"warmup_s": time.perf_counter() - t0, "warmup_programs": d.programs, "warmup_compile_s": d.seconds}

    def run(self) -> dict[str, Any]:
        c, rt = self.c, self.rt
        steps = c.train.steps
        warm = self.warmup() if c.train.get("warmup", True) and self.start_step < steps else {}
        if self.start_step == 0:
            val = validate_policy(rt, self.state.trainable, jax.random.fold_in(self.key, 10 ** 6), 0, self.workdir)
            self.writer.write(val)
            self.monitor.update(0, val.get("val/success", 0.0))
        bar = _progress(self.start_step, steps, self.progress)
        stopped_on_cliff = None
        try:
            for step in range(self.start_step, steps):
                rec = self.train_step(step)
                rec.update(warm)
                warm = {}
                self.writer.write(rec)
                best = None
                if (step + 1) % c.train.val_every == 0 or step + 1 == steps:
                    val = validate_policy(rt, self.state.trainable,
                                          jax.random.fold_in(self.key, 10 ** 6 + step + 1), step + 1, self.workdir)
                    self.writer.write(val)
                    best = val.get("val/success", 0.0)
                    rec.update(val)
                    if self.monitor.update(step + 1, best) and c.train.stop_on_cliff:
                        stopped_on_cliff = step + 1
                if (step + 1) % c.train.ckpt_every == 0 or step + 1 == steps or stopped_on_cliff:
                    self._save(step + 1, best)
                bar.update(1)
                bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", acc=f"{rec.get('success', 0):.3f}",
                                val=f"{rec['val/success']:.3f}" if "val/success" in rec else "-",
                                tok_s=f"{rec['tokens_per_s']:.0f}", compile=f"{rec['compile_s']:.1f}s")
                if stopped_on_cliff:
                    break
        finally:
            bar.close()
            self.ckpt.wait()
            self.writer.close()
            self._sync()
        return self.finish(stopped_on_cliff)

    def finish(self, stopped_on_cliff=None) -> dict[str, Any]:
        from marl_jax.train.summary import summary_table, write_summary

        recs = read_metrics(self.workdir)
        # The last record of a step wins, as in the summary (a run directory written before restarts
        # truncated their records may repeat steps).
        val = sorted({r["step"]: r["val/success"] for r in recs if "val/success" in r}.items())
        cliff = detect_cliff([s for s, _ in val], [v for _, v in val], drop=self.c.train.cliff_drop) if val else None
        out = {"workdir": self.workdir, "cliff": cliff, "stopped_on_cliff": stopped_on_cliff}
        if stopped_on_cliff and self.c.train.restore_best_on_cliff and self.ckpt.best_step() is not None:
            best = self.ckpt.best_step()
            state, _ = self.ckpt.restore(best, template=self._ckpt_state())
            self.state = self.rt.place(TrainState(state["trainable"], state["opt_state"], jnp.asarray(state["step"]),
                                             jnp.asarray(state["skipped"]), state.get("grad_ema")))
            out["restored_step"] = best
        if jax.process_index() == 0:
            if self.c.train.plots:
                out["table"] = write_summary(self.workdir, list(self.rt.roles), drop=self.c.train.cliff_drop)
            else:
                out["table"] = summary_table(recs, list(self.rt.roles))
        self._sync()
        out["workdir"] = self.run_dir.uri
        self.ckpt.close()
        return out


def lever_config(config, roles, copies: dict[str, int]) -> levers_lib.LeverConfig:
    """The update's levers from config.levers (absent in older configs: all off)."""
    lv = config.get("levers")
    if lv is None:
        return levers_lib.LeverConfig()
    weights = lv.get("balance_weights") or {}
    return levers_lib.LeverConfig(
        damping=float(lv.damping), damping_window=int(lv.damping_window), fanout=lv.fanout, balance=lv.balance,
        balance_weights=tuple(float(weights.get(r, 1.0)) for r in roles), balance_cap=float(lv.balance_cap),
        copies=tuple(int(copies.get(r, 1)) for r in roles))


def check_resume_config(workdir: str, config, allow_change: bool = False,
                        ckpt_dir: str | None = None) -> list[tuple[str, object, object]]:
    """Refuse to resume a checkpoint under another config (mixing two experiments in one run's curves).

    Only RESUMABLE_KEYS (step counts, logging) may differ, unless allow_change; returns the differences.
    ckpt_dir: where the checkpoints are, if not in workdir (a gs:// run's URI; workdir is its mirror).
    """
    ckpt = Checkpointer(ckpt_dir or workdir, read_only=True)
    try:
        step = ckpt.latest_step()
        if step is None:
            return []
        saved = ckpt.restore_meta(step).get("config")
    finally:
        ckpt.close()
    if saved is None and os.path.isfile(os.path.join(workdir, "config.json")):
        with open(os.path.join(workdir, "config.json")) as f:
            saved = json.load(f)
    if saved is None:
        return []
    changes = config_changes(saved, _jsonable(config.to_dict()))
    # A key the checkpoint's code did not have, set to its default now, is that code's behaviour: no change.
    from marl_jax.config import base_config
    from marl_jax.train.checkpoint import flat_config
    defaults = flat_config(json.loads(json.dumps(_jsonable(
        base_config(config.workflow, tuple(config.grpo.kl_coef.keys())).to_dict()))))
    changes = [(k, a, b) for k, a, b in changes if not (a == "<absent>" and k in defaults and defaults[k] == b)]
    if changes and not allow_change:
        shown = "\n".join(f"  {k}: {a!r} in the checkpoint, {b!r} now" for k, a, b in changes)
        raise ConfigChangedError(
            f"{workdir} holds checkpoint step {step} of a run with another config; resuming it would mix two "
            f"experiments. Differing keys:\n{shown}\nRun with the checkpoint's values, use a new --workdir, or pass "
            f"--allow_config_change to resume anyway (only {', '.join(RESUMABLE_KEYS)} may change freely).")
    if changes and jax.process_index() == 0:
        print(f"resuming {workdir} at step {step} with a changed config: "
              + ", ".join(f"{k}={b!r} (was {a!r})" for k, a, b in changes))
    return changes


class _NoWriter:
    def write(self, record):
        pass

    def flush(self):
        pass

    def close(self):
        pass


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return x


def _progress(start: int, total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)


def train(config, workdir: str, **kw) -> dict[str, Any]:
    return Trainer(config, workdir, **kw).run()
