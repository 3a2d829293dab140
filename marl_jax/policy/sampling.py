"""The bridge from a workflow's `sample(slot, prompts, max_new_tokens, stage)` to the jitted sampler."""
from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Any, Sequence

import jax

from marl_jax.generate.sampler import Sampler, SamplingParams
from marl_jax.workflows.base import Completion


@dataclasses.dataclass
class PolicySampler:
    """Callable with the workflow Sampler signature, sampling from (base, trainable[slot]).

    The PRNG key of a call depends on the step key and the stage name only, never on the slot:
    Shared- and Isolated-Policy runs whose slots hold identical parameters sample identical rows.
    """

    sampler: Sampler
    base: Any
    trainable: Any
    key: jax.Array
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    shapes: dict = dataclasses.field(default_factory=dict)  # stage -> generate.types.CallShape (plan.call_shapes)
    calls: list = dataclasses.field(default_factory=list)

    @property
    def max_context(self) -> int:
        """The model's positions: a prompt plus its completion must fit (checked by run_episodes)."""
        return int(self.sampler.cfg.max_position_embeddings)

    def __call__(self, slot: int, prompts: Sequence[Sequence[int]], max_new_tokens: int, stage: str) -> list[Completion]:
        sp = self.params(max_new_tokens)
        key = jax.random.fold_in(self.key, zlib.crc32(stage.encode()) & 0x7FFFFFFF)
        t0 = time.perf_counter()
        out = self.sampler.generate(self.base, list(prompts), key, sp, trainable=self.trainable, slot=slot,
                                    shape=self.shapes.get(stage))
        self.calls.append({"stage": stage, "slot": slot, "rows": len(prompts), "seconds": time.perf_counter() - t0,
                           "tokens": int(out.lengths.sum()), **self.sampler.stats})
        return [Completion(*out.row(i), finished=bool(out.finished[i])) for i in range(len(prompts))]

    def params(self, max_new_tokens: int) -> SamplingParams:
        """The sampling parameters of a call (static in the sampler's programs)."""
        return SamplingParams(max_new_tokens=int(max_new_tokens), temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, stop_ids=tuple(self.stop_ids))

    def warmup(self, roles: dict, slots: dict, max_new_tokens: dict, workers: int = 1) -> int:
        """Compile the programs of each stage's call as `shapes` sizes it (Sampler.warmup): roles (stage ->
        role), slots (role -> slot), max_new_tokens (role -> limit). Returns the programs compiled."""
        return sum(self.sampler.warmup(self.base, self.params(max_new_tokens[roles[st]]), shape,
                                       trainable=self.trainable, slot=slots[roles[st]], key=self.key, workers=workers)
                   for st, shape in self.shapes.items())

    def summary(self) -> dict[str, float]:
        """The sampler's work over the calls so far: prefill and decode seconds, useful decode row-steps per
        computed one, the fraction of prompt tokens loaded from the prefix cache, the largest decode KV cache."""
        c = self.calls
        if not c:
            return {}
        total = lambda k: sum(x.get(k, 0) for x in c)
        return {"sample_prefill_s": float(total("prefill_s")), "sample_decode_s": float(total("decode_s")),
                "sample_row_use": total("useful_row_steps") / max(total("row_steps"), 1),
                "sample_cached_frac": total("cached_tokens") / max(total("prompt_tokens"), 1),
                "sample_peak_kv_mib": max(x.get("peak_kv_bytes", 0) for x in c) / 2 ** 20}
