"""Run a workflow over a batch: B tasks x G episodes, one sampler call per stage.

Credit (credit=...):
- "broadcast" (default): every row of an episode gets the episode's final 0/1.
- "per_agent": the workflow's own rule. Voting: generators their own correctness, the aggregator the
  correctness of its pick. Eval-Opt: generator turns their own correctness, evaluator turn k 1 when its
  verdict (no verdict = Incorrect) matches the correctness of generator turn k. Orch-Workers: only the
  synthesizer is credited (the final 0/1); orchestrator and worker rows get reward 0 and
  trained=False. Their groups are then all-zero, so GRPO gives them advantage 0 whatever the grouping;
  the update may drop trained=False rows (saves compute) or keep them as zero-advantage rows (the
  reference keeps them, which only scales down the shared-policy loss mean).

GRPO group keys: (task_id, role), pooling every call of the role over the G episodes of the task; with
group_by_call_index, (task_id, role, call_index). The default comes from the workflow (Voting: by
index on math, pooled on code; others: pooled) and run_episodes can override it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

from marl_jax.policy.slots import check_mapping, role_to_slot as _role_to_slot
from marl_jax.tasks.base import Score, Task
from marl_jax.tasks.grading import grade as _grade, grade_many
from marl_jax.workflows.base import (Completion, Episode, EpisodeState, Row, Sampler, Tokenizer,
                                     Workflow, render_prompt)

__all__ = [
    "CREDIT_MODES",
    "RolloutResult",
    "run_episodes",
    "assign_credit",
    "assign_group_keys",
    "compute_metrics",
    "format_transcript",
    "rows_to_jsonl",
]

CREDIT_MODES = ("broadcast", "per_agent")


@dataclasses.dataclass
class RolloutResult:
    """rows: every call, grouped by episode in call order; episodes: B*G, task-major.

    timing (seconds): sampler (inside sample calls), glue (prompt rendering, encoding, parsing),
    reward (grading), total, and sampler/<stage> per stage.
    """

    rows: list[Row]
    episodes: list[Episode]
    metrics: dict[str, float]
    timing: dict[str, float]


def _resolve_max_new_tokens(max_new_tokens: int | Mapping[str, int], roles: Sequence[str]) -> dict:
    if isinstance(max_new_tokens, Mapping):
        missing = [r for r in roles if r not in max_new_tokens]
        if missing:
            raise ValueError(f"max_new_tokens has no entry for role(s) {missing}; "
                             f"workflow roles: {list(roles)}")
        out = dict(max_new_tokens)
    else:
        out = {r: max_new_tokens for r in roles}
    for r, n in out.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens for role {r!r} must be an int >= 1; got {n!r}")
    return out


def _check_completion(c: Any, stage: str, i: int) -> Completion:
    tokens, logprobs, finished = c
    # Samplers may hand back numpy/jax arrays: store plain Python ints and floats.
    tokens = tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]
    logprobs = logprobs.tolist() if hasattr(logprobs, "tolist") else [float(x) for x in logprobs]
    if len(tokens) != len(logprobs):
        raise ValueError(f"sampler stage {stage!r} row {i}: {len(tokens)} tokens but "
                         f"{len(logprobs)} logprobs")
    if finished and not len(tokens):
        raise ValueError(f"sampler stage {stage!r} row {i}: finished=True needs the stop token "
                         "as the last completion token, but the completion is empty")
    return Completion(tokens, logprobs, bool(finished))


def assign_group_keys(rows: Sequence[Row], by_call_index: bool) -> None:
    """Set row.group_key to (task_id, role) or (task_id, role, call_index)."""
    for r in rows:
        r.group_key = (r.task_id, r.role, r.call_index) if by_call_index else (r.task_id, r.role)


def assign_credit(workflow: Workflow, ep: EpisodeState, final: Score, credit: str) -> None:
    """Set reward and trained on every row of one graded episode (see the module docstring)."""
    if credit == "broadcast":
        for r in ep.rows:
            r.reward, r.trained = float(final.reward), True
        return
    if credit != "per_agent":
        raise ValueError(f"unknown credit mode {credit!r}; valid: {', '.join(CREDIT_MODES)}")
    rewards = workflow.per_agent_rewards(ep, final)
    if len(rewards) != len(ep.rows):
        raise RuntimeError(f"{workflow.name}.per_agent_rewards gave {len(rewards)} rewards for "
                           f"{len(ep.rows)} rows")
    for r, w in zip(ep.rows, rewards):
        r.reward, r.trained = (0.0, False) if w is None else (float(w), True)


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not (isinstance(x, float) and math.isnan(x))]
    return float(sum(xs) / len(xs)) if xs else float("nan")


def compute_metrics(episodes: Sequence[Episode], roles: Sequence[str]) -> dict[str, float]:
    """Batch metrics: success, per-role accuracy/calls/lengths, workflow extras, solve fractions.

    success: mean final 0/1. <role>/accuracy: mean over that role's judged calls (generators and
    workers: own correctness; aggregator: its pick; evaluator: verdict matches). <role>/calls: calls
    per episode. <role>/response_len, <role>/prompt_len: mean tokens per call; <role>/truncated:
    fraction of calls that hit max_new_tokens. Workflow extras (any_correct, iterations, items, ...)
    are means of the per-episode values (NaN entries skipped). solve_none / solve_all /
    solve_partial: fractions of tasks whose G final answers are all wrong / all right / mixed.
    """
    m: dict[str, float] = {}
    if not episodes:
        return m
    m["success"] = _mean([e.success for e in episodes])
    m["episodes"] = float(len(episodes))
    for role in roles:
        rows = [r for e in episodes for r in e.rows if r.role == role]
        m[f"{role}/calls"] = len(rows) / len(episodes)
        if rows:
            m[f"{role}/response_len"] = _mean([len(r.completion_tokens) for r in rows])
            m[f"{role}/prompt_len"] = _mean([len(r.prompt_tokens) for r in rows])
            m[f"{role}/truncated"] = _mean([float(not r.finished) for r in rows])
        judged = [x for e in episodes for x in e.outcomes.get("role_correct", {}).get(role, [])]
        if judged:
            m[f"{role}/accuracy"] = _mean(judged)
    extras = defaultdict(list)
    for e in episodes:
        for k, v in e.metrics.items():
            extras[k].append(float(v))
    for k, vs in extras.items():
        m[k] = _mean(vs)
    by_task = defaultdict(list)
    for e in episodes:
        by_task[e.task.task_id].append(e.success)
    groups = list(by_task.values())
    m["solve_none"] = _mean([float(all(s == 0 for s in g)) for g in groups])
    m["solve_all"] = _mean([float(all(s == 1 for s in g)) for g in groups])
    m["solve_partial"] = 1.0 - m["solve_none"] - m["solve_all"]
    return m


def check_context(limit: int | None, stage, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """A prompt plus its completion must fit the model's positions (its max_position_embeddings);
    past them the sampler would run on positions the model never saw."""
    if not limit or not prompts:
        return
    longest = max(len(p) for p in prompts)
    if longest + int(max_new_tokens) > limit:
        raise ValueError(
            f"role {stage.role!r} (stage {stage.name!r}): a prompt of {longest} tokens plus "
            f"max_new_tokens={max_new_tokens} exceeds the model's context of {limit} tokens "
            f"(max_position_embeddings). Lower --config.rollout.max_new_tokens.{stage.role}, shorten the prompts "
            "(--config.workflow_options.prompt_dir=compact, shorter task questions, fewer workflow iterations) "
            "or use a model with a longer context")


def run_episodes(
    workflow: Workflow,
    tasks: Sequence[Task],
    group_size: int,
    sample: Sampler,
    tokenizer: Tokenizer,
    *,
    role_to_slot: Mapping[str, int] | str,
    credit: str = "broadcast",
    grade_fn: Callable[[Task, str], Score] = _grade,
    max_new_tokens: int | Mapping[str, int] = 1024,
    group_by_call_index: bool | None = None,
    episode_id_offset: int = 0,
    grade_workers: int = 8,
) -> RolloutResult:
    """Run group_size episodes of workflow on each task and grade, credit and group their rows.

    sample(slot, prompts, max_new_tokens, stage) is called once per stage that has work, with every
    active episode's prompts for that stage. role_to_slot: a role->slot mapping, or "shared" /
    "isolated" to build one from workflow.roles. grade_fn(task, text) -> Score (bind options with
    functools.partial). group_by_call_index: None = the workflow's default per task kind.
    Episode ids are episode_id_offset + b * group_size + g.
    """
    t_start = time.perf_counter()
    if credit not in CREDIT_MODES:
        raise ValueError(f"unknown credit mode {credit!r}; valid: {', '.join(CREDIT_MODES)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1; got {group_size!r}")
    if not tasks:
        raise ValueError("run_episodes needs at least one task")
    roles = tuple(workflow.roles)
    slots = check_mapping(_role_to_slot(roles, role_to_slot) if isinstance(role_to_slot, str)
                          else role_to_slot, roles)
    mnt = _resolve_max_new_tokens(max_new_tokens, roles)

    eps = [EpisodeState(task=t, episode_id=episode_id_offset + b * group_size + g, episode_index=g)
           for b, t in enumerate(tasks) for g in range(group_size)]
    timing: dict[str, float] = defaultdict(float)

    for stage in workflow.plan(tasks):
        t0 = time.perf_counter()
        batch = []  # (episode, request, prompt tokens, prompt text)
        rendered: dict = {}  # identical prompts (voters, the G episodes' first calls) render once
        for ep in eps:
            reqs = workflow.requests(stage, ep)
            if len(reqs) > stage.max_calls:
                raise RuntimeError(f"{workflow.name} stage {stage.name!r} made {len(reqs)} calls "
                                   f"for one episode; its declared maximum is {stage.max_calls}")
            for req in reqs:
                if req.messages not in rendered:
                    rendered[req.messages] = render_prompt(tokenizer, req.messages)
                toks, text = rendered[req.messages]
                batch.append((ep, req, list(toks), text))
        timing["glue_s"] += time.perf_counter() - t0
        if not batch:
            continue
        slot = slots[stage.role]
        check_context(getattr(sample, "max_context", None), stage, [b[2] for b in batch], mnt[stage.role])
        t0 = time.perf_counter()
        comps = list(sample(slot, [b[2] for b in batch], mnt[stage.role], stage.name))
        dt = time.perf_counter() - t0
        timing["sampler_s"] += dt
        timing[f"sampler/{stage.name}_s"] += dt
        if len(comps) != len(batch):
            raise ValueError(f"sampler returned {len(comps)} completions for {len(batch)} prompts "
                             f"in stage {stage.name!r}")
        t0 = time.perf_counter()
        new_rows = defaultdict(list)
        for i, ((ep, req, toks, ptext), c) in enumerate(zip(batch, comps)):
            c = _check_completion(c, stage.name, i)
            row = Row(prompt_tokens=toks, completion_tokens=c.tokens, logprobs=c.logprobs,
                      role=stage.role, slot=slot, task_id=ep.task.task_id,
                      episode_id=ep.episode_id, episode_index=ep.episode_index,
                      call_index=len(ep.rows_of(stage.role)), stage=stage.name,
                      finished=c.finished, text=tokenizer.decode(c.tokens, skip_special_tokens=True),
                      prompt_text=ptext, info=dict(req.info))
            ep.rows.append(row)
            new_rows[id(ep)].append(row)
        for ep in eps:
            if id(ep) in new_rows:
                workflow.consume(stage, ep, new_rows[id(ep)])
        timing["glue_s"] += time.perf_counter() - t0

    # Grade every candidate answer of every episode in one batch (code in parallel).
    t0 = time.perf_counter()
    to_grade = [(ep, r) for ep in eps for r in workflow.graded_rows(ep)]
    scores = grade_many([ep.task for ep, _ in to_grade], [r.text for _, r in to_grade],
                        grade_fn=grade_fn, max_workers=grade_workers)
    for (_, r), s in zip(to_grade, scores):
        r.score = s
    timing["reward_s"] += time.perf_counter() - t0

    t0 = time.perf_counter()
    episodes = []
    for ep in eps:
        final_row = workflow.final_row(ep)
        if final_row.score is None:
            raise RuntimeError(f"{workflow.name}: the final row is not among graded_rows")
        final = final_row.score
        assign_credit(workflow, ep, final, credit)
        by_index = (group_by_call_index if group_by_call_index is not None
                    else workflow.groups_by_call_index(ep.task.kind))
        assign_group_keys(ep.rows, by_index)
        details, ep_metrics = workflow.outcomes(ep, final)
        details.setdefault("calls", {role: len(ep.rows_of(role)) for role in roles})
        episodes.append(Episode(task=ep.task, episode_id=ep.episode_id,
                                episode_index=ep.episode_index, rows=ep.rows,
                                final_text=final_row.text, score=final,
                                final_row_index=next(i for i, r in enumerate(ep.rows)
                                                     if r is final_row),
                                outcomes=details, metrics=ep_metrics))
    rows = [r for e in episodes for r in e.rows]
    metrics = compute_metrics(episodes, roles)
    timing["glue_s"] += time.perf_counter() - t0
    timing["total_s"] = time.perf_counter() - t_start
    return RolloutResult(rows=rows, episodes=episodes, metrics=metrics, timing=dict(timing))


def _clip(text: str, max_chars: int | None) -> str:
    if max_chars is None or len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} chars ...]\n{text[-half:]}"


def format_transcript(episode: Episode, max_chars: int | None = None) -> str:
    """A readable printout: task, every call (role, slot, prompt, output, parsed info, reward,
    group key) in order, and the final answer with its score. max_chars clips long texts."""
    t = episode.task
    bar = "=" * 78
    lines = [bar, f"task {t.task_id} ({t.kind})  episode {episode.episode_id} "
             f"(#{episode.episode_index} of its group)", bar]
    for i, r in enumerate(episode.rows):
        mark = "  <- final answer" if i == episode.final_row_index else ""
        lines.append(f"--- [{r.stage}] {r.role} call {r.call_index}  slot {r.slot}  "
                     f"reward {r.reward:g}{'' if r.trained else ' (not trained)'}  "
                     f"group {r.group_key}{mark}")
        lines.append(f">>> prompt ({len(r.prompt_tokens)} tokens)")
        lines.append(_clip(r.prompt_text, max_chars))
        lines.append(f"<<< output ({len(r.completion_tokens)} tokens"
                     f"{'' if r.finished else ', truncated'})")
        lines.append(_clip(r.text, max_chars))
        if r.info:
            lines.append(f"parsed: {json.dumps(r.info, ensure_ascii=False)}")
        if r.score is not None:
            lines.append(f"graded: reward {r.score.reward:g}  extracted {r.score.extracted!r}")
    lines.append(bar)
    s = episode.score
    lines.append(f"final: reward {s.reward:g}  extracted {s.extracted!r}  partial {s.partial:g}"
                 f"{'  ' + s.info if s.info else ''}")
    lines.append(f"answer: {t.answer!r}" if t.kind == "math" else "answer: <tests>")
    outcomes = {k: v for k, v in episode.outcomes.items() if k != "role_correct"}
    lines.append(f"outcomes: {json.dumps(outcomes, ensure_ascii=False, default=str)}")
    return "\n".join(lines)


def _row_record(r: Row) -> dict:
    d = dataclasses.asdict(r)
    d["group_key"] = list(r.group_key)
    d["score"] = None if r.score is None else dataclasses.asdict(r.score)
    return d


def rows_to_jsonl(rows: Sequence[Row], path: str) -> None:
    """Write one JSON object per row (every Row field; group_key as a list)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(_row_record(r), ensure_ascii=False, default=str) + "\n")
