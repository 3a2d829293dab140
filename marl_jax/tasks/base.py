"""The task record every data source produces and every workflow consumes."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Task:
    """One problem.

    kind: "math" (answer is the ground-truth string) or "code" (answer is a test spec, see
    marl_jax.tasks.code). meta holds source-specific extras (entry point, difficulty, ...).
    """

    task_id: str
    kind: str
    question: str
    answer: Any
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Score:
    """Outcome of grading one final answer: reward is 0/1; partial is a metric only."""

    reward: float
    extracted: str | None = None
    partial: float = 0.0
    info: str = ""
