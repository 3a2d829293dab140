"""marl_jax: end-to-end multi-agent RL of LLM workflows in JAX."""

__version__ = "0.1.0"
