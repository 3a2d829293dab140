"""marl_jax: end-to-end multi-agent RL of LLM workflows in JAX."""

__version__ = "0.1.0"

# Before any JAX backend starts: on a machine without a TPU, keep libtpu (the `aot` extra) out of this process
# and the ones it starts (no TPU errors, no libtpu lock file); JAX_PLATFORMS set by the user wins.
from marl_jax import jax_setup as _jax_setup

_jax_setup.keep_libtpu_out()
# Under glibc tuned never to mmap (the launcher's allocator), one-device programs run on the calling thread so
# their temporaries come from the heap that keeps its pages (jax_setup.inline_dispatch).
_jax_setup.inline_dispatch()
