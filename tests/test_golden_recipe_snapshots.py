"""llama.cpp's own type-selection snapshots, recorded, so the recipes are checked against them without its source.

``tests/test_recipes_ladder.py::test_equals_llama_cpp_snapshot`` reads llama.cpp's
``tests/snapshots/*.schema`` (written by its ``test-quant-type-selection`` from
``llama_quant_compute_types``) out of the fetched source and skips where the source is not in the qkit
cache. ``tests/golden/recipe_snapshots.json`` holds what that test reads: for Llama-3.1-70B, Qwen3-0.6B,
Qwen3-14B and Gemma-3-4B and every ftype of qkit's ladder, the default type and every tensor whose type
differs from it, with the sha256 of each snapshot file and the llama.cpp commit (checked against the pinned
commit, so a new pin asks for a new recording). The check is that test's.

Recorded with the source fetched (``python benchmarks/build_llama_ref.py``):

    QKIT_RECORD_SNAPSHOTS=1 python -m pytest tests/test_golden_recipe_snapshots.py
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from conftest import benchmark_module
from helpers_recipes import (
    GGUF_PROJ,
    SNAPSHOT_MODELS,
    SNAPSHOTS,
    read_snapshot,
    recipe,
    type_names,
)

from qkit.schemes.recipes import DEFAULT_TYPES

GOLDEN_PATH = Path(__file__).parent / "golden" / "recipe_snapshots.json"
RECORD_COMMAND = "QKIT_RECORD_SNAPSHOTS=1 python -m pytest tests/test_golden_recipe_snapshots.py"


def record() -> dict:
    if not SNAPSHOTS.exists():
        pytest.fail(f"recording needs llama.cpp's source ({SNAPSHOTS}): python benchmarks/build_llama_ref.py")
    blr = benchmark_module("build_llama_ref")
    models = {}
    for model in SNAPSHOT_MODELS:
        path = SNAPSHOTS / f"{model}.schema"
        sections = read_snapshot(path)
        models[model] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                         "ftypes": {f: {"default": sections[f][0], "overrides": dict(sorted(sections[f][1].items()))}
                                    for f in DEFAULT_TYPES}}
    doc = {"description": "llama.cpp's tests/snapshots/*.schema (test-quant-type-selection): per model and ftype, the "
                          "default type and the tensors of another type",
           "command": RECORD_COMMAND, "llama_cpp_commit": blr.commit(), "llama_cpp_python_sdist": blr.LLAMA_CPP_PYTHON,
           "models": models}
    GOLDEN_PATH.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


GOLDEN = record() if os.environ.get("QKIT_RECORD_SNAPSHOTS") == "1" else json.loads(GOLDEN_PATH.read_text())


def test_golden_file_says_where_it_came_from():
    assert GOLDEN["command"] == RECORD_COMMAND
    assert GOLDEN["llama_cpp_commit"] == benchmark_module("build_llama_ref").LLAMA_CPP_COMMIT
    assert set(GOLDEN["models"]) == set(SNAPSHOT_MODELS)
    assert all(set(m["ftypes"]) == set(DEFAULT_TYPES) for m in GOLDEN["models"].values())


@pytest.mark.parametrize("ftype", list(DEFAULT_TYPES))
@pytest.mark.parametrize("model", list(SNAPSHOT_MODELS))
def test_equals_recorded_llama_cpp_snapshot(model, ftype):
    """Every block projection's type in qkit's recipe is the snapshot's (and no tensor the snapshot names is missing)."""
    snap = GOLDEN["models"][model]["ftypes"][ftype]
    default, overrides = snap["default"], snap["overrides"]
    assert default == DEFAULT_TYPES[ftype].name
    config, *widths = SNAPSHOT_MODELS[model]
    n = config["num_hidden_layers"]
    shapes = [("token_embd.weight", (1000, widths[0]))] + ([] if config["tie_word_embeddings"] else [("output.weight", (1000, widths[0]))])
    shapes += [(f"blk.{i}.{p}.weight", (64, widths[w])) for i in range(n) for p, w in GGUF_PROJ.items()]
    got = type_names(recipe(ftype, config), shapes)
    assert set(overrides) <= set(got)
    assert got == {name: overrides.get(name, default) for name in got}
