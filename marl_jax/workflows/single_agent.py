"""Single agent (the control): one call answers the task; reward = its correctness."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

from marl_jax.tasks.base import Score, Task
from marl_jax.workflows.base import EpisodeState, Request, Row, Stage, Workflow

__all__ = ["SingleAgent"]


@dataclasses.dataclass(frozen=True)
class SingleAgent(Workflow):
    """One generator call per episode.

    role: the role name its rows carry ("generator" by default; "solver" reads better in some logs).
    """

    role: str = "generator"

    name: ClassVar[str] = "single_agent"

    def __post_init__(self):
        if not isinstance(self.role, str) or not self.role:
            raise ValueError(f"role must be a non-empty string; got {self.role!r}")

    @property
    def roles(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.role,)

    def plan(self, tasks: Sequence[Task]) -> tuple[Stage, ...]:
        return (Stage("generate", self.role, 1),)

    def requests(self, stage: Stage, ep: EpisodeState) -> list[Request]:
        return [Request(self.chat(ep, "single_agent", "generator", question=ep.task.question), {})]

    def graded_rows(self, ep: EpisodeState) -> list[Row]:
        return ep.rows_of(self.role)

    def final_row(self, ep: EpisodeState) -> Row:
        return ep.rows_of(self.role)[-1]

    def per_agent_rewards(self, ep: EpisodeState, final: Score) -> list[float | None]:
        return [float(final.reward) for _ in ep.rows]

    def outcomes(self, ep: EpisodeState, final: Score) -> tuple[dict, dict]:
        return {"role_correct": {self.role: [float(final.reward)]}}, {}
