"""The sampler's shared types: what a caller asks for (SamplingParams), what it gets (SampleOutput), and the
state the decode programs carry (DecodeState). A leaf module."""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


class CallShape(NamedTuple):
    """What a call's compiled shapes are sized for, from the config (marl_jax.plan.workload's stage): at most
    `rows` rows, `distinct` distinct prompts, prompts of at most `prompt` tokens. A call within it runs programs
    from one fixed set (Sampler.warmup compiles it); a call beyond it still runs, compiling what it needs."""
    rows: int
    distinct: int
    prompt: int


class SampleOutput(NamedTuple):
    tokens: np.ndarray  # [N, max_new_tokens] int32, pad_id after each row's length
    logprobs: np.ndarray  # [N, max_new_tokens] float32, 0 after each row's length
    lengths: np.ndarray  # [N] int32, tokens generated (including a stop token)
    finished: np.ndarray  # [N] bool, True when the row ended on a stop token

    def row(self, i: int) -> tuple[list[int], list[float]]:
        n = int(self.lengths[i])
        return self.tokens[i, :n].tolist(), self.logprobs[i, :n].tolist()


class DecodeState(NamedTuple):
    cache: Any  # marl_jax.models.decoder.KVCache or PagedCache
    token: jax.Array  # [B] last sampled token (not yet in the cache)
    pos: jax.Array  # [B] position of `token` (paged: also its cache slot)
    step: jax.Array  # [B] tokens generated so far by each row
    active: jax.Array  # [B] row still generating
    out_tokens: jax.Array  # [B, Tn]
    out_logp: jax.Array  # [B, Tn]
    row_id: jax.Array  # [B] original row index (keys the randomness); -1 for filler rows
    max_len: jax.Array  # [B] per-row new-token limit
