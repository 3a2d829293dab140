"""Grade a final answer against its task, dispatching on the task kind.

The graders live in marl_jax.tasks.math and marl_jax.tasks.code and are imported lazily, so a
math-only run never imports the code sandbox (and vice versa).

Threading: code grading runs programs in subprocesses and waits on them, so grade_many spreads it
over a thread pool. Math grading stays in the calling thread: math-verify enforces its timeouts with
signal.alarm, which only works in the main thread.
"""
from __future__ import annotations

import concurrent.futures
import functools
import importlib
from typing import Any, Callable, Sequence

from marl_jax.tasks.base import Score, Task

__all__ = ["KINDS", "grade", "grade_many"]

KINDS = ("math", "code")

GradeFn = Callable[[Task, str], Score]


def grade(task: Task, text: str, *, math_mode: str = "boxed", code_timeout_s: float = 3.0) -> Score:
    """Score one output text for one task (reward 0/1; partial is a metric only).

    math: marl_jax.tasks.math.score(text, task.answer, mode=math_mode).
    code: marl_jax.tasks.code.score(text, task.answer, timeout_s=code_timeout_s).
    """
    if task.kind == "math":
        mod = importlib.import_module("marl_jax.tasks.math")
        return mod.score(text, task.answer, mode=math_mode)
    if task.kind == "code":
        mod = importlib.import_module("marl_jax.tasks.code")
        return mod.score(text, task.answer, timeout_s=code_timeout_s)
    raise ValueError(
        f"task {task.task_id!r} has kind {task.kind!r}; grade() knows {', '.join(KINDS)}")


def grade_many(
    tasks: Sequence[Task],
    texts: Sequence[str],
    *,
    grade_fn: GradeFn | None = None,
    max_workers: int = 8,
    **grade_kwargs: Any,
) -> list[Score]:
    """Grade texts[i] against tasks[i]; results in input order.

    grade_fn(task, text) defaults to grade with grade_kwargs (math_mode, code_timeout_s); pass either a
    grade_fn or keyword options, not both. Code tasks run on up to max_workers threads, math tasks in
    the calling thread.
    """
    if len(tasks) != len(texts):
        raise ValueError(f"grade_many got {len(tasks)} tasks but {len(texts)} texts")
    if grade_fn is not None and grade_kwargs:
        raise ValueError(
            f"pass options {sorted(grade_kwargs)} either to grade_fn (functools.partial) or here, "
            "not both")
    fn: GradeFn = grade_fn or functools.partial(grade, **grade_kwargs)
    out: list[Score | None] = [None] * len(tasks)
    parallel = [i for i, t in enumerate(tasks) if t.kind == "code"]
    futures = {}
    pool = None
    if parallel and max_workers > 1:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(max_workers, len(parallel)))
        futures = {pool.submit(fn, tasks[i], texts[i]): i for i in parallel}
    try:
        submitted = set(futures.values())
        for i, t in enumerate(tasks):
            if i not in submitted:
                out[i] = fn(t, texts[i])
        for fut, i in futures.items():
            out[i] = fut.result()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    for i, s in enumerate(out):
        if not isinstance(s, Score):
            raise TypeError(f"grade function returned {type(s).__name__} for task "
                            f"{tasks[i].task_id!r}; expected marl_jax.tasks.base.Score")
    return out  # type: ignore[return-value]
