"""Helpers shared by the benchmark scripts."""
from __future__ import annotations

import time


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of a jitted float32 n x n matmul: the reference the benchmarks report against."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        f(a).block_until_ready()
    return 2 * n ** 3 * reps / (time.perf_counter() - t)
