"""Process-wide JAX settings the command-line tools share."""
from __future__ import annotations

import os


def enable_compilation_cache(path: str | None = None) -> str:
    """Persist compiled programs across runs (XLA compiles dominate short CPU runs).

    Location: $MARL_JAX_CACHE, else ~/.cache/marl_jax/xla. Set MARL_JAX_CACHE=off to disable.
    """
    import jax

    path = path or os.environ.get("MARL_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "marl_jax", "xla")
    if path == "off":
        return ""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
