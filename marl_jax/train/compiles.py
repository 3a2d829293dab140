"""Seconds XLA spends compiling, from jax's own compile events, counted per part of a step.

One process-wide listener (jax.monitoring) adds every `/jax/core/compile/backend_compile_duration` event to
the part that is running (`part("update")` around the update call; "other" outside any part: the sampler,
validation, checkpoints). That event times XLA's compile of one program, or its retrieval from the persistent
compilation cache (marl_jax.jax_setup.enable_compilation_cache) when jax finds it there: a cache hit is not
free (reading and loading the executable; 0.1-1 s for an update item on CPU), so it counts in `seconds` too,
and jax's `/jax/compilation_cache/cache_hits` event lets the hits be counted apart (`cache_hits`, and
`cached_s`, their retrieval seconds from `/jax/compilation_cache/cache_retrieval_time_sec`).

Tracing and lowering to StableHLO (the jaxpr_trace and jaxpr_to_mlir_module events) happen before XLA
compiles and are not counted: a program that is compiled is also traced, so `seconds == 0` still means nothing
was traced for a new shape.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_RETRIEVAL_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"


@dataclasses.dataclass
class Counts:
    seconds: float = 0.0  # XLA compile (or persistent-cache retrieval) seconds
    programs: int = 0  # programs compiled or retrieved
    cache_hits: int = 0  # of those, retrieved from the persistent compilation cache
    cached_s: float = 0.0  # seconds those retrievals took

    def __sub__(self, o: "Counts") -> "Counts":
        return Counts(self.seconds - o.seconds, self.programs - o.programs, self.cache_hits - o.cache_hits,
                      self.cached_s - o.cached_s)


_lock = threading.Lock()
_totals: dict[str, Counts] = {}
_current = ["other"]  # the part compiles are counted to now
_registered = [False]


def _add(part: str, **kw) -> None:
    with _lock:
        c = _totals.setdefault(part, Counts())
        for k, v in kw.items():
            setattr(c, k, getattr(c, k) + v)


def _on_duration(event: str, seconds: float, **_) -> None:
    if event == COMPILE_EVENT:
        _add(_current[0], seconds=seconds, programs=1)
    elif event == CACHE_RETRIEVAL_EVENT:
        _add(_current[0], cached_s=seconds)


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT:
        _add(_current[0], cache_hits=1)


def install() -> None:
    """Register the listeners (once per process; later calls do nothing)."""
    with _lock:
        if _registered[0]:
            return
        _registered[0] = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


@contextlib.contextmanager
def part(name: str):
    """Count the compiles inside the block to `name` (restored after it: parts nest)."""
    install()
    prev, _current[0] = _current[0], name
    try:
        yield
    finally:
        _current[0] = prev


def snapshot() -> dict[str, Counts]:
    """The counts so far, per part (a copy)."""
    install()
    with _lock:
        return {k: dataclasses.replace(v) for k, v in _totals.items()}


def since(before: dict[str, Counts]) -> dict[str, Counts]:
    """Counts per part since `before` (a snapshot), with "all" their sum."""
    now = snapshot()
    out = {k: v - before.get(k, Counts()) for k, v in now.items()}
    total = Counts()
    for v in out.values():
        total = Counts(total.seconds + v.seconds, total.programs + v.programs, total.cache_hits + v.cache_hits,
                       total.cached_s + v.cached_s)
    out["all"] = total
    return out


RECORD_KEYS = ("compile_s", "compile_programs", "compile_cache_hits", "compile_cached_s", "update_compile_s",
               "update_compile_programs")


def record(before: dict[str, Counts], prefix: str = "") -> dict[str, float]:
    """A metrics record's compile keys since `before`: <prefix>compile_s (every part), compile_programs,
    compile_cache_hits, compile_cached_s, and update_compile_s / update_compile_programs (the update's part)."""
    d = since(before)
    a, u = d["all"], d.get("update", Counts())
    return {f"{prefix}compile_s": a.seconds, f"{prefix}compile_programs": a.programs,
            f"{prefix}compile_cache_hits": a.cache_hits, f"{prefix}compile_cached_s": a.cached_s,
            f"{prefix}update_compile_s": u.seconds, f"{prefix}update_compile_programs": u.programs}
