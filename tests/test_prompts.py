"""Packaged prompt sets: every set covers the reference templates with a subset of their fields."""
import os
import re

import pytest

from marl_jax.workflows.base import PROMPT_DIR, load_prompts, resolve_prompt_dir

FIELD = re.compile(r"\{\{(\w+)\}\}")


def _templates(node, path=""):
    if isinstance(node, str):
        return {path: set(FIELD.findall(node))}
    out = {}
    for k, v in node.items():
        if not k.startswith("_"):
            out.update(_templates(v, f"{path}/{k}"))
    return out


SETS = sorted(d for d in os.listdir(PROMPT_DIR) if os.path.isdir(os.path.join(PROMPT_DIR, d)))


def test_there_is_a_compact_set():
    assert "compact" in SETS


@pytest.mark.parametrize("name", SETS)
def test_prompt_set_has_every_template_and_only_known_fields(name):
    for kind in sorted(f[:-5] for f in os.listdir(os.path.join(PROMPT_DIR, name)) if f.endswith(".json")):
        ref, other = _templates(load_prompts(kind)), _templates(load_prompts(kind, name))
        assert set(ref) == set(other), set(ref) ^ set(other)
        for path, fields in other.items():
            assert fields <= ref[path], (path, fields - ref[path])
            # The question (or, for self-contained subtasks, the item) must reach every prompt.
            if path.endswith("/user"):
                assert fields & {"question", "item"}, path


def test_unknown_prompt_set_names_the_packaged_sets(tmp_path):
    with pytest.raises(FileNotFoundError, match="compact"):
        resolve_prompt_dir("no-such-set")
    assert resolve_prompt_dir(str(tmp_path)) == str(tmp_path)
    assert resolve_prompt_dir("") == PROMPT_DIR
