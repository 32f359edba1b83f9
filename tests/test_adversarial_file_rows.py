"""Adversarial ``qkit eval --schemes file:PATH.gguf``: every bad file row refused in one line, exit 2.

Each refusal: one ``error:`` line, no traceback, nothing written (the ``--json`` target is never created,
no row directory is left), every input unchanged, and the reference model never loaded
(``qkit.evaluation.runner.load`` fails the test if called). A refusal that needs no model file (the
words themselves, the runtimes) also comes before MODEL is resolved.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from adversarial import Unchanged, assert_refused, invoke, tripwire
from conftest import TINY_TEXT, make_tiny_llama

FAST = ["--tokens", "64", "--agree-tokens", "1", "--no-battery"]


@pytest.fixture(scope="module")
def q8_file(tiny_model_dir, tmp_path_factory) -> Path:
    """A GGUF of the tiny model, written by qkit: a good file row."""
    out = tmp_path_factory.mktemp("good") / "q8_0.gguf"
    assert invoke("quantize", str(tiny_model_dir), "-s", "q8_0", "--format", "gguf", "-o", str(out)).code == 0
    return out


@pytest.fixture
def no_load(monkeypatch):
    tripwire(monkeypatch, "qkit.evaluation.runner.load", "the reference model was loaded")


@pytest.fixture
def no_resolve(monkeypatch):
    tripwire(monkeypatch, "qkit.evaluation.runner.resolve", "MODEL was resolved")


def _refused(model, schemes, needles, tmp_path, inputs=(), extra=()):
    out, text = tmp_path / "out.json", tmp_path / "text.txt"
    if not text.exists():
        text.write_text(TINY_TEXT * 3)
    with Unchanged(inputs=[model, text, *inputs], dirs=[tmp_path]):
        line = assert_refused(invoke("eval", str(model), "--schemes", schemes, "--json", str(out), "--corpus", str(text),
                                     *FAST, *extra), *needles)
    assert not out.exists()
    return line


def _gguf_of(model: Path, out: Path, scheme: str = "q8_0") -> Path:
    assert invoke("quantize", str(model), "-s", scheme, "--format", "gguf", "-o", str(out)).code == 0
    return out


# --------------------------------------------------------------------------- the word itself: before MODEL is resolved


@pytest.mark.parametrize("word, needles", [
    ("file:", ["file: names no file", "file:PATH.gguf"]),
    ("file:   ", ["file: names no file"]),
    ("q8_0,FILE:", ["file: names no file"]),
])
def test_a_file_word_with_no_path_is_refused(tiny_model_dir, tmp_path, no_resolve, no_load, word, needles):
    _refused(tiny_model_dir, word, needles, tmp_path)


def test_a_missing_file_is_refused(tiny_model_dir, tmp_path, no_resolve, no_load):
    _refused(tiny_model_dir, f"file:{tmp_path / 'nope.gguf'}", ["nope.gguf: no such file", "existing gguf file"], tmp_path)


def test_a_directory_is_refused(tiny_model_dir, tmp_path, no_resolve, no_load):
    d = tmp_path / "export"
    d.mkdir()
    _refused(tiny_model_dir, f"file:{d}", ["export is not a file", ".gguf file inside"], tmp_path)


@pytest.mark.parametrize("content", [
    b"",  # empty
    b"GGU",  # shorter than the preamble
    TINY_TEXT.encode(),  # text
    b"\x08\x00\x00\x00\x00\x00\x00\x00{}" + b"\x00" * 40,  # a safetensors header
])
def test_a_file_that_is_not_gguf_is_refused(tiny_model_dir, tmp_path, no_resolve, no_load, content):
    f = tmp_path / "fake.gguf"
    f.write_bytes(content)
    _refused(tiny_model_dir, f"file:{f}", ["fake.gguf is not a gguf file"], tmp_path, [f])


def test_a_truncated_gguf_is_refused(tiny_model_dir, q8_file, tmp_path, no_load):
    f = tmp_path / "cut.gguf"
    f.write_bytes(q8_file.read_bytes()[: q8_file.stat().st_size - 1000])
    _refused(tiny_model_dir, f"file:{f}", ["cut.gguf is truncated", "ends at byte"], tmp_path, [f])


def test_the_same_file_twice_is_refused(tiny_model_dir, q8_file, tmp_path, no_resolve, no_load):
    _refused(tiny_model_dir, f"file:{q8_file},q4_0,file:{q8_file}", ["q8_0.gguf is given twice", "name each file once"],
             tmp_path, [q8_file])
    link = tmp_path / "again.gguf"
    link.symlink_to(q8_file)
    _refused(tiny_model_dir, f"file:{q8_file},file:{link}", ["again.gguf is given twice", f"also as file:{q8_file}"],
             tmp_path, [q8_file])


def test_a_file_row_in_a_runtime_that_cannot_load_it_is_refused(tiny_model_dir, q8_file, tmp_path, no_resolve, no_load,
                                                                 monkeypatch):
    # vLLM taken as installed, so that the refusal is the file row's, not the missing engine's
    monkeypatch.setattr("qkit.evaluation.engines.vllm.VllmEngine.check_available", lambda self, options: None)
    _refused(tiny_model_dir, f"file:{q8_file}", ["--runtime vllm: vllm does not load a gguf file as it is",
                                                 "--runtime torch or llama.cpp"], tmp_path, [q8_file],
             ["--runtime", "torch,vllm"])


def test_the_json_target_cannot_be_the_file_row(tiny_model_dir, q8_file, tmp_path, no_resolve, no_load):
    with Unchanged(inputs=[q8_file, tiny_model_dir], dirs=[q8_file.parent]):
        assert_refused(invoke("eval", str(tiny_model_dir), "--schemes", f"file:{q8_file}", "--json", str(q8_file),
                              "--force", *FAST), "is a file row", "never writes over what it reads")


# --------------------------------------------------------------------------- a GGUF of another model: from its header


def test_a_gguf_of_another_architecture_is_refused(tiny_model_dir, tmp_path, no_load):
    f = tmp_path / "qwen.gguf"
    w = gguf.GGUFWriter(str(f), "qwen2")
    w.add_tensor("token_embd.weight", np.zeros((304, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(tiny_model_dir, f"file:{f}", ["qwen.gguf is a gguf of a 'qwen2' model", "the reference is 'llama'"],
             tmp_path, [f])


def test_a_gguf_of_a_model_with_other_shapes_is_refused(tiny_model_dir, tmp_path, no_load):
    other = tmp_path / "wider"
    make_tiny_llama(other, hidden=128, intermediate=256)
    f = _gguf_of(other, tmp_path / "wider.gguf")
    line = _refused(tiny_model_dir, f"file:{f}", ["wider.gguf does not hold the reference's tensors", "shape of",
                                                  "(reference [", "pass a gguf of the reference model"], tmp_path, [f])
    assert "missing" not in line and "extra" not in line


def test_a_gguf_of_a_model_with_other_tensors_is_refused(tiny_model_dir, tmp_path, no_load):
    deeper = tmp_path / "deeper"
    make_tiny_llama(deeper, layers=3)
    f = _gguf_of(deeper, tmp_path / "deeper.gguf")
    _refused(tiny_model_dir, f"file:{f}", ["deeper.gguf does not hold the reference's tensors", "extra blk.2."],
             tmp_path, [f])
    untied = tmp_path / "untied"
    make_tiny_llama(untied, tie=False)  # an output.weight the tied reference has no tensor of its own for
    f = _gguf_of(untied, tmp_path / "untied.gguf")
    _refused(tiny_model_dir, f"file:{f}", ["extra output.weight"], tmp_path, [f])


def test_a_good_file_row_passes_the_same_checks(tiny_model_dir, q8_file, corpus, tmp_path):
    """The control: the same command with a GGUF of the reference runs, and its row is there."""
    out = tmp_path / "out.json"
    r = invoke("eval", str(tiny_model_dir), "--schemes", f"file:{q8_file}", "--corpus", str(corpus), "--json", str(out),
               *FAST)
    assert r.code == 0, r.text
    assert "q8_0" in r.text and out.is_file()
