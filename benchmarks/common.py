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


def time_steps(step, state, base, batch, reps: int):
    """One untimed call of a train step (compiling), then `reps` timed calls on the same batch.
    Returns (state, first-call seconds, first-call loss, [seconds per timed call])."""
    t = time.perf_counter()
    state, met = step(state, base, batch)
    first_loss = float(met["loss"])  # blocks until the step is done
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        state, met = step(state, base, batch)
        float(met["loss"])
        times.append(time.perf_counter() - t)
    return state, first, first_loss, times


class PeakRSS:
    """The process's peak resident memory over chosen spans (Linux: /proc/self/status VmHWM, reset by writing 5
    to /proc/self/clear_refs), so that two implementations run in one process get a peak each. Elsewhere
    `peak` stays 0 and `measured` is False."""

    def __init__(self):
        self.peak = 0
        self.measured = False

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise OSError("no VmHWM")

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._ok = True
        except OSError:
            self._ok = False
        return self

    def __exit__(self, *exc):
        if self._ok:
            try:
                self.peak, self.measured = max(self.peak, self._hwm()), True
            except OSError:
                pass
        return False

    def gb(self) -> str:
        return f"{self.peak / 1e9:.1f} GB" if self.measured else "unmeasured"
