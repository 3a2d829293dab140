"""Orchestrator-Workers: an orchestrator writes items, one worker per item, a synthesizer answers.

Variants:
- "strategies" (default, the final paper version): the orchestrator proposes up to max_items
  distinct solution strategies; each worker solves the FULL task with one strategy; the synthesizer
  sees the problem, every strategy and every worker's solution, and writes the final answer.
- "decompose" (older): the orchestrator splits the task into subtasks; workers see only their
  subtask, NOT the original problem; the synthesizer sees the problem, the subtasks and the results.

Items are parsed with marl_jax.workflows.parsing.parse_items ("SUBTASK k:" / "STRATEGY k:" markers,
then a numbered list, then long lines, else the whole output; at most max_items). An item is a
sub-span of the orchestrator's output, so it is quoted as text (re-encoded) in worker and
synthesizer prompts; whole worker outputs are quoted as spliced tokens.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

from marl_jax.tasks.base import Score, Task
from marl_jax.workflows.base import EpisodeState, Part, Request, Row, Splice, Stage, Workflow
from marl_jax.workflows.parsing import parse_items

__all__ = ["OrchWorkers", "VARIANTS"]

VARIANTS = ("strategies", "decompose")


@dataclasses.dataclass(frozen=True)
class OrchWorkers(Workflow):
    """variant: "strategies" | "decompose"; max_items: most items (= worker calls) per episode.

    grade_workers: also grade worker outputs (strategies only, where each solves the full task) for
    the worker accuracy metric; their rows still get no per-agent credit.
    """

    variant: str = "strategies"
    max_items: int = 3
    grade_workers: bool = True

    name: ClassVar[str] = "orch_workers"
    roles: ClassVar[tuple[str, ...]] = ("orchestrator", "worker", "synthesizer")

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown orch_workers variant {self.variant!r}; valid: {VARIANTS}")
        if isinstance(self.max_items, bool) or not isinstance(self.max_items, int) or self.max_items < 1:
            raise ValueError(f"max_items must be an int >= 1; got {self.max_items!r}")

    def plan(self, tasks: Sequence[Task]) -> tuple[Stage, ...]:
        return (Stage("orchestrate", "orchestrator", 1), Stage("work", "worker", self.max_items),
                Stage("synthesize", "synthesizer", 1))

    def requests(self, stage: Stage, ep: EpisodeState) -> list[Request]:
        q = ep.task.question
        if stage.role == "orchestrator":
            return [Request(self.chat(ep, "orch_workers", self.variant, "orchestrator", question=q,
                                      max_items=self.max_items), {})]
        items = ep.state["items"]
        if stage.role == "worker":
            out = []
            for k, item in enumerate(items):
                # Decompose workers get their subtask only; strategy workers get the full problem.
                fields = {"item": item, "k": k + 1}
                if self.variant == "strategies":
                    fields["question"] = q
                out.append(Request(self.chat(ep, "orch_workers", self.variant, "worker", **fields),
                                   {"item": item}))
            return out
        reports: list[Part] = []
        for k, (item, w) in enumerate(zip(items, ep.rows_of("worker"))):
            reports += self.fragment(ep, "orch_workers", self.variant, "report", k=k + 1, item=item,
                                     output=Splice.of(w))
        return [Request(self.chat(ep, "orch_workers", self.variant, "synthesizer", question=q,
                                  reports=reports, n=len(items)), {})]

    def consume(self, stage: Stage, ep: EpisodeState, rows: list[Row]) -> None:
        if stage.role != "orchestrator":
            return
        (row,) = rows
        items, method = parse_items(row.text, self.max_items)
        row.info.update(items=items, items_method=method)
        ep.state["items"] = items

    def graded_rows(self, ep: EpisodeState) -> list[Row]:
        rows = ep.rows_of("synthesizer")
        if self.variant == "strategies" and self.grade_workers:
            rows = ep.rows_of("worker") + rows
        return rows

    def final_row(self, ep: EpisodeState) -> Row:
        return ep.rows_of("synthesizer")[-1]

    def per_agent_rewards(self, ep: EpisodeState, final: Score) -> list[float | None]:
        # Only the synthesizer is credited; orchestrator and worker rows get no learning signal.
        return [float(final.reward) if r.role == "synthesizer" else None for r in ep.rows]

    def outcomes(self, ep: EpisodeState, final: Score) -> tuple[dict, dict]:
        orch = ep.rows_of("orchestrator")[0]
        calls = {role: len(ep.rows_of(role)) for role in self.roles}
        role_correct = {"synthesizer": [float(final.reward)]}
        details = {"items": len(ep.state["items"]), "items_method": orch.info["items_method"],
                   "calls": calls}
        if self.variant == "strategies" and self.grade_workers:
            worker_ok = [float(bool(w.correct)) for w in ep.rows_of("worker")]
            role_correct["worker"] = worker_ok
            details["worker_correct"] = worker_ok
            details["any_worker_correct"] = float(any(worker_ok))
        details["role_correct"] = role_correct
        metrics = {"items": float(len(ep.state["items"])),
                   "items_fallback": float(orch.info["items_method"] != "marker")}
        if "any_worker_correct" in details:
            metrics["any_correct"] = details["any_worker_correct"]
        return details, metrics
