"""Voting: n_votes generator calls on the identical prompt, then an aggregator picks one.

The aggregator sees the problem and the solutions numbered 1..n_votes in call order and selects one
by writing its number boxed (fallbacks: the first digit 1..n_votes in its text, then solution 1). The
final answer is the selected generator's output; there is no majority vote.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

from marl_jax.tasks.base import Score, Task
from marl_jax.workflows.base import EpisodeState, Part, Request, Row, Splice, Stage, Workflow
from marl_jax.workflows.parsing import parse_selection

__all__ = ["Voting"]


@dataclasses.dataclass(frozen=True)
class Voting(Workflow):
    """n_votes: generator calls per episode (1..9, so a single digit can name each).

    GRPO grouping default (group_by_call_index=None): voters keyed by call index on math (n_votes
    groups of G), pooled on code (one group of n_votes*G), as the reference does.
    """

    n_votes: int = 3

    name: ClassVar[str] = "voting"
    roles: ClassVar[tuple[str, ...]] = ("generator", "aggregator")

    def __post_init__(self):
        if isinstance(self.n_votes, bool) or not isinstance(self.n_votes, int) or not 1 <= self.n_votes <= 9:
            raise ValueError(f"n_votes must be an int in 1..9; got {self.n_votes!r}")

    def default_group_by_call_index(self, kind: str) -> bool:
        return kind == "math"

    def plan(self, tasks: Sequence[Task]) -> tuple[Stage, ...]:
        return (Stage("generate", "generator", self.n_votes), Stage("aggregate", "aggregator", 1))

    def requests(self, stage: Stage, ep: EpisodeState) -> list[Request]:
        if stage.role == "generator":
            msgs = self.chat(ep, "voting", "generator", question=ep.task.question)
            return [Request(msgs, {"vote": k + 1}) for k in range(self.n_votes)]
        solutions: list[Part] = []
        for k, g in enumerate(ep.rows_of("generator")):
            solutions += self.fragment(ep, "voting", "solution", k=k + 1, solution=Splice.of(g))
        msgs = self.chat(ep, "voting", "aggregator", question=ep.task.question,
                         solutions=solutions, n=self.n_votes)
        return [Request(msgs, {})]

    def consume(self, stage: Stage, ep: EpisodeState, rows: list[Row]) -> None:
        if stage.role != "aggregator":
            return
        (row,) = rows
        index, method = parse_selection(row.text, len(ep.rows_of("generator")))
        row.info.update(selection=index + 1, selection_method=method)
        ep.state["selected"] = index

    def graded_rows(self, ep: EpisodeState) -> list[Row]:
        return ep.rows_of("generator")

    def final_row(self, ep: EpisodeState) -> Row:
        return ep.rows_of("generator")[ep.state["selected"]]

    def per_agent_rewards(self, ep: EpisodeState, final: Score) -> list[float | None]:
        # Generators: their own correctness; the aggregator: the correctness of its pick.
        return [float(r.score.reward) if r.role == "generator" else float(final.reward)
                for r in ep.rows]

    def outcomes(self, ep: EpisodeState, final: Score) -> tuple[dict, dict]:
        gen_ok = [float(bool(g.correct)) for g in ep.rows_of("generator")]
        agg = ep.rows_of("aggregator")[0]
        pick_ok = float(final.reward)
        details = {
            "generator_correct": gen_ok,
            "selection": agg.info["selection"],
            "selection_method": agg.info["selection_method"],
            "pick_correct": pick_ok,
            "any_correct": float(any(gen_ok)),
            "role_correct": {"generator": gen_ok, "aggregator": [pick_ok]},
        }
        metrics = {
            "any_correct": float(any(gen_ok)),
            "selection_fallback": float(agg.info["selection_method"] != "boxed"),
            # Did the aggregator pick a right answer whenever one was on offer?
            "pick_correct_given_any": pick_ok if any(gen_ok) else float("nan"),
        }
        return details, metrics
