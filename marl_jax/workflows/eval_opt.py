"""Evaluator-Optimizer: a generator answers, an evaluator judges, the generator revises.

Round r (0-based): generator turn r, then evaluator turn r, who sees the problem and the whole
conversation so far (every attempt and every earlier review) and ends with a boxed Correct or
Incorrect (no verdict counts as Incorrect). On Correct, or after the episode's last round, the
episode stops; otherwise generator turn r+1 sees the same conversation including the latest review
and writes a new solution with a different approach. The final answer is the last generator output,
so a math episode makes at most 3 generator + 3 evaluator calls.

How the conversation reaches each call (`conversation`):
- "quoted" (the default): every call is one user message that quotes the problem and the history so
  far (attempts and reviews) before the round's instruction.
- "chat": each role keeps one multi-turn chat. The generator's round r is its round r-1 chat, its
  own attempt as the assistant turn, and a user turn with the review and the instruction to revise;
  the evaluator's is its previous chat, its own review as the assistant turn, and a user turn with
  the new attempt. Every prompt then starts with the role's previous prompt + completion token for
  token, so the sampler's prefix cache loads nearly all of it instead of prefilling it again (the
  quoted form can reuse only up to the end of the earlier history). Where a chat template renders
  a past assistant turn differently from the generation prompt (Qwen3 drops the empty think block),
  reuse stops at that point but rows stay correct.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

from marl_jax.tasks.base import Score, Task
from marl_jax.workflows.base import EpisodeState, Part, Request, Row, Splice, Stage, Workflow
from marl_jax.workflows.parsing import parse_verdict

__all__ = ["EvalOpt", "DEFAULT_MAX_ITERATIONS"]

# The reference's round limits per task kind.
DEFAULT_MAX_ITERATIONS = {"math": 3, "code": 2}
CONVERSATIONS = ("quoted", "chat")


@dataclasses.dataclass(frozen=True)
class EvalOpt(Workflow):
    """max_iterations: rounds per episode; None = 3 on math, 2 on code. conversation: "quoted" or "chat"
    (see the module docstring)."""

    max_iterations: int | None = None
    conversation: str = "quoted"

    name: ClassVar[str] = "eval_opt"
    roles: ClassVar[tuple[str, ...]] = ("generator", "evaluator")

    def __post_init__(self):
        if self.max_iterations is not None and (
                isinstance(self.max_iterations, bool) or not isinstance(self.max_iterations, int)
                or self.max_iterations < 1):
            raise ValueError(f"max_iterations must be an int >= 1 or None; got {self.max_iterations!r}")
        if self.conversation not in CONVERSATIONS:
            raise ValueError(f"conversation must be one of {CONVERSATIONS}; got {self.conversation!r}")

    def iterations_for(self, kind: str) -> int:
        if self.max_iterations is not None:
            return self.max_iterations
        if kind not in DEFAULT_MAX_ITERATIONS:
            raise ValueError(f"no default max_iterations for task kind {kind!r}; set max_iterations")
        return DEFAULT_MAX_ITERATIONS[kind]

    def plan(self, tasks: Sequence[Task]) -> tuple[Stage, ...]:
        rounds = max(self.iterations_for(t.kind) for t in tasks)
        stages = []
        for r in range(rounds):
            stages += [Stage(f"generate_{r}", "generator", 1), Stage(f"evaluate_{r}", "evaluator", 1)]
        return tuple(stages)

    def _history(self, ep: EpisodeState) -> list[Part]:
        """Attempts and reviews so far, interleaved, each quoted as spliced tokens."""
        gens, evals = ep.rows_of("generator"), ep.rows_of("evaluator")
        parts: list[Part] = []
        for k, g in enumerate(gens):
            parts += self.fragment(ep, "eval_opt", "attempt", k=k + 1, solution=Splice.of(g))
            if k < len(evals):
                parts += self.fragment(ep, "eval_opt", "review", k=k + 1,
                                       review=Splice.of(evals[k]))
        return parts

    def _chat(self, ep: EpisodeState, role: str, r: int) -> tuple:
        """Round r's multi-turn chat for role: its round-0 prompt, then per later round its own
        completion (assistant) and a user turn with the other role's latest output."""
        gens, evals = ep.rows_of("generator"), ep.rows_of("evaluator")
        q = ep.task.question
        if role == "generator":
            msgs = list(self.chat(ep, "eval_opt", "generator", question=q))
            for j in range(r):
                msgs.append(("assistant", (Splice.of(gens[j]),)))
                msgs.append(("user", tuple(self.fragment(ep, "eval_opt", "generator_followup", j=j + 1,
                                                         k=j + 2, review=Splice.of(evals[j])))))
            return tuple(msgs)
        first = self.fragment(ep, "eval_opt", "attempt", k=1, solution=Splice.of(gens[0]))
        msgs = list(self.chat(ep, "eval_opt", "evaluator", question=q, history=first, k=1))
        for j in range(1, r + 1):
            msgs.append(("assistant", (Splice.of(evals[j - 1]),)))
            msgs.append(("user", tuple(self.fragment(ep, "eval_opt", "evaluator_followup", k=j + 1,
                                                     solution=Splice.of(gens[j])))))
        return tuple(msgs)

    def requests(self, stage: Stage, ep: EpisodeState) -> list[Request]:
        r = int(stage.name.rsplit("_", 1)[1])
        n_gen, n_eval = len(ep.rows_of("generator")), len(ep.rows_of("evaluator"))
        if r >= self.iterations_for(ep.task.kind) or ep.state.get("stopped"):
            return []
        if stage.role == "generator":
            if n_gen != r or n_eval != r:
                return []
            if self.conversation == "chat":
                msgs = self._chat(ep, "generator", r)
            elif r == 0:
                msgs = self.chat(ep, "eval_opt", "generator", question=ep.task.question)
            else:
                msgs = self.chat(ep, "eval_opt", "generator_revise", question=ep.task.question,
                                 history=self._history(ep), k=r + 1)
            return [Request(msgs, {"round": r})]
        if n_gen != r + 1 or n_eval != r:
            return []
        if self.conversation == "chat":
            msgs = self._chat(ep, "evaluator", r)
        else:
            msgs = self.chat(ep, "eval_opt", "evaluator", question=ep.task.question,
                             history=self._history(ep), k=r + 1)
        return [Request(msgs, {"round": r, "judges_attempt": r + 1})]

    def consume(self, stage: Stage, ep: EpisodeState, rows: list[Row]) -> None:
        if stage.role != "evaluator":
            return
        for row in rows:
            verdict = parse_verdict(row.text)
            row.info["verdict"] = {True: "Correct", False: "Incorrect", None: None}[verdict]
            if verdict:
                ep.state["stopped"] = "correct"

    def graded_rows(self, ep: EpisodeState) -> list[Row]:
        return ep.rows_of("generator")

    def final_row(self, ep: EpisodeState) -> Row:
        return ep.rows_of("generator")[-1]

    def _verdict_matches(self, ep: EpisodeState) -> list[bool]:
        gens = ep.rows_of("generator")
        # Evaluator turn k judges generator turn k; no verdict counts as Incorrect.
        return [(e.info.get("verdict") == "Correct") == bool(gens[k].correct)
                for k, e in enumerate(ep.rows_of("evaluator"))]

    def per_agent_rewards(self, ep: EpisodeState, final: Score) -> list[float | None]:
        matches = self._verdict_matches(ep)
        out: list[float | None] = []
        for row in ep.rows:
            if row.role == "generator":
                out.append(float(row.score.reward) if row.score is not None else 0.0)
            else:
                out.append(float(matches[row.call_index]))
        return out

    def outcomes(self, ep: EpisodeState, final: Score) -> tuple[dict, dict]:
        gen_ok = [float(bool(g.correct)) for g in ep.rows_of("generator")]
        verdicts = [e.info.get("verdict") for e in ep.rows_of("evaluator")]
        matches = [float(m) for m in self._verdict_matches(ep)]
        stopped_correct = ep.state.get("stopped") == "correct"
        details = {
            "generator_correct": gen_ok,
            "verdicts": verdicts,
            "verdict_matches": matches,
            "iterations": len(gen_ok),
            "stop": "correct_verdict" if stopped_correct else "max_iterations",
            "role_correct": {"generator": gen_ok, "evaluator": matches},
        }
        metrics = {
            "iterations": float(len(gen_ok)),
            "stopped_on_correct": float(stopped_correct),
            "first_attempt_correct": gen_ok[0],
            "no_verdict": float(sum(v is None for v in verdicts)) / max(len(verdicts), 1),
        }
        return details, metrics
