"""Multi-agent workflows as static dataflow over a batched sampler.

make_workflow(name, **cfg) builds one of WORKFLOWS; run_episodes (rollout.py) executes it.
"""
from __future__ import annotations

from typing import Any

from marl_jax.workflows.base import (Completion, Episode, EpisodeState, Request, Row, Sampler,
                                     Splice, Stage, Tokenizer, TranscriptEntry, Workflow, fill,
                                     load_prompts, render_prompt)
from marl_jax.workflows.eval_opt import EvalOpt
from marl_jax.workflows.orch_workers import OrchWorkers
from marl_jax.workflows.rollout import (CREDIT_MODES, RolloutResult, assign_credit,
                                        assign_group_keys, compute_metrics, format_transcript,
                                        rows_to_jsonl, run_episodes)
from marl_jax.workflows.single_agent import SingleAgent
from marl_jax.workflows.voting import Voting

__all__ = [
    "WORKFLOWS", "make_workflow", "SingleAgent", "EvalOpt", "Voting", "OrchWorkers",
    "Completion", "Row", "Episode", "EpisodeState", "Request", "Sampler", "Splice", "Stage",
    "Tokenizer", "TranscriptEntry", "Workflow", "fill", "load_prompts", "render_prompt",
    "CREDIT_MODES", "RolloutResult", "run_episodes", "assign_credit", "assign_group_keys",
    "compute_metrics", "format_transcript", "rows_to_jsonl",
]

WORKFLOWS: dict[str, type[Workflow]] = {
    "single_agent": SingleAgent,
    "eval_opt": EvalOpt,
    "voting": Voting,
    "orch_workers": OrchWorkers,
}


def make_workflow(name: str, **cfg: Any) -> Workflow:
    """Build a workflow by name with its config fields, e.g. make_workflow("voting", n_votes=3)."""
    if name not in WORKFLOWS:
        raise ValueError(f"unknown workflow {name!r}; valid: {', '.join(WORKFLOWS)}")
    cls = WORKFLOWS[name]
    unknown = sorted(set(cfg) - set(cls.config_keys()))
    if unknown:
        raise ValueError(f"workflow {name!r} has no option(s) {unknown}; its options: "
                         f"{list(cls.config_keys())}")
    return cls(**cfg)
