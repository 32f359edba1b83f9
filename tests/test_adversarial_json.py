"""Adversarial JSON fields: every field qkit reads from a model's JSON files holds the wrong JSON type.

A hand-edited ``config.json`` (``"quantization_config": "abc"``), ``tokenizer_config.json``,
``tokenizer.json``, ``model.safetensors.index.json`` or ``qkit-source.json``: each command that reads it
refuses in one line naming the file and the field (``qkit.jsonfields``), before the model loads, with
nothing written and the inputs unchanged. Also the helper itself, and that the schemas accept what
transformers and compressed-tensors write.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from adversarial import Unchanged, assert_refused, invoke, tripwire
from conftest import make_tiny_llama

from qkit.errors import CheckpointError, ExportError, ModelLoadError

EVAL_FAST = ["--tokens", "64", "--agree-tokens", "1", "--schemes", "int8-row"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("json")
    make_tiny_llama(d / "tiny")
    return d


@pytest.fixture
def no_load(monkeypatch):
    """Loading the model fails the test: every refusal here comes before it."""
    tripwire(monkeypatch, "transformers.modeling_utils.PreTrainedModel.from_pretrained", "the model loaded")


def _edited_copy(model: Path, tmp_path: Path, name: str, path: tuple[str, ...], value) -> tuple[Path, Path]:
    """A copy of ``model`` under ``tmp_path`` with ``name``'s field at ``path`` set to ``value``, and an empty
    work directory beside it: ``(copy, work)``."""
    copy, work = tmp_path / "model", tmp_path / "work"
    shutil.copytree(model, copy)
    _edit(copy, name, path, value)
    work.mkdir()
    return copy, work


def _edit(directory: Path, name: str, path: tuple[str, ...], value) -> None:
    """Set the field at ``path`` (keys from the document's top) of ``directory/name`` to ``value``."""
    f = directory / name
    doc = json.loads(f.read_text())
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    f.write_text(json.dumps(doc))


# --------------------------------------------------------------------------- config.json, every command

# (field path, bad value, what the line says it is)
_GROUP = {"targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32,
                                             "symmetric": True}}
CONFIG_CASES = {
    "quantization_config a string": (("quantization_config",), "abc", ["quantization_config is 'abc' (a string)",
                                                                        "not an object or null"]),
    "quantization_config a list": (("quantization_config",), ["qkit"], ["quantization_config is ['qkit'] (a list)"]),
    "quantization_config a number": (("quantization_config",), 4, ["quantization_config is 4 (a number)"]),
    "quant_method a number": (("quantization_config", "quant_method"), 3,
                              ["quantization_config.quant_method is 3 (a number)", "not a string"]),
    "format a list": (("quantization_config", "format"), ["pack-quantized"], ["quantization_config.format"]),
    "config_groups a list": (("quantization_config", "config_groups"), [_GROUP],
                             ["quantization_config.config_groups is", "(a list)", "not an object of objects"]),
    "a config group a string": (("quantization_config", "config_groups"), {"group_0": "int4"},
                                ["quantization_config.config_groups.group_0 is 'int4' (a string)"]),
    "group weights a string": (("quantization_config", "config_groups"), {"group_0": {**_GROUP, "weights": "int4"}},
                               ["quantization_config.config_groups.group_0.weights is 'int4'"]),
    "num_bits a string": (("quantization_config", "config_groups"),
                          {"group_0": {**_GROUP, "weights": {**_GROUP["weights"], "num_bits": "4"}}},
                          ["config_groups.group_0.weights.num_bits is '4' (a string)", "not an integer"]),
    "group targets a string": (("quantization_config", "config_groups"), {"group_0": {**_GROUP, "targets": "Linear"}},
                               ["config_groups.group_0.targets is 'Linear' (a string)", "not a list of strings"]),
    "ignore a string": (("quantization_config", "ignore"), "lm_head",
                        ["quantization_config.ignore is 'lm_head' (a string)", "not a list of strings"]),
    "ignore of numbers": (("quantization_config", "ignore"), ["lm_head", 7], ["quantization_config.ignore[1] is 7"]),
    "load_in_4bit a string": (("quantization_config", "load_in_4bit"), "true",
                              ["quantization_config.load_in_4bit is 'true' (a string)", "not a boolean"]),
    "torch_dtype a number": (("torch_dtype",), 32, ["torch_dtype is 32 (a number)", "not a string or null"]),
    "dtype an object": (("dtype",), {"text": "float32"}, ["dtype is {'text': 'float32'} (an object)"]),
    "architectures a string": (("architectures",), "LlamaForCausalLM",
                               ["architectures is 'LlamaForCausalLM' (a string)", "not a list of strings"]),
    "architectures of numbers": (("architectures",), [1], ["architectures[0] is 1 (a number)", "not a string"]),
    "tie_word_embeddings a string": (("tie_word_embeddings",), "false",
                                     ["tie_word_embeddings is 'false' (a string)", "not a boolean"]),
    "rope_scaling a string": (("rope_scaling",), "linear", ["rope_scaling is 'linear' (a string)"]),
    "rope factor a string": (("rope_scaling",), {"rope_type": "linear", "factor": "2"},
                             ["rope_scaling.factor is '2' (a string)", "not a number or null"]),
    "rms_norm_eps a string": (("rms_norm_eps",), "1e-6", ["rms_norm_eps is '1e-6' (a string)"]),
    "text_config a string": (("text_config",), "llama", ["text_config is 'llama' (a string)"]),
    "text_config tie a number": (("text_config",), {"tie_word_embeddings": 1},
                                 ["text_config.tie_word_embeddings is 1 (a number)"]),
    "auto_map a number": (("auto_map",), 3, ["auto_map is 3 (a number)", "not an object of class names"]),
    "auto_map value a number": (("auto_map",), {"AutoConfig": 3}, ["auto_map.AutoConfig is 3 (a number)"]),
    "model_type a list": (("model_type",), ["llama"], ["model_type"]),
}

COMMANDS = {
    "quantize": lambda m, w: ["quantize", m, "-s", "int8-row", "-o", w / "q"],
    "quantize-ct": lambda m, w: ["quantize", m, "-s", "int8-row", "--format", "compressed-tensors", "-o", w / "ct"],
    "eval": lambda m, w: ["eval", m, *EVAL_FAST, "--json", w / "r.json"],
    "inspect-errors": lambda m, w: ["inspect", "errors", m, "-s", "int8-row"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_field_of_the_wrong_type(base, tmp_path, no_load, case, command):
    path, value, needles = CONFIG_CASES[case]
    model, work = _edited_copy(base / "tiny", tmp_path, "config.json", path, value)
    with Unchanged(inputs=[model], dirs=[work, tmp_path]):
        line = assert_refused(invoke(*COMMANDS[command](model, work)), *needles)
    assert f"{model / 'config.json'}" in line or "model_type" in line  # model_type: its own older line
    assert "Traceback" not in line and "AttributeError" not in line


@pytest.mark.parametrize("case", ["quantization_config a string", "quant_method a number", "config_groups a list",
                                  "num_bits a string", "ignore a string", "torch_dtype a number"])
def test_verify_refuses_a_bad_export_config(tiny_ct_export, tmp_path, no_load, case):
    path, value, needles = CONFIG_CASES[case]
    export = tmp_path / "export"
    shutil.copytree(tiny_ct_export, export)
    _edit(export, "config.json", path, value)
    with Unchanged(inputs=[export], dirs=[tmp_path]):
        line = assert_refused(invoke("verify", export, "--device", "cpu"), *needles)
    assert str(export / "config.json") in line


def test_the_issue_reproduction(base, tmp_path):
    """``"quantization_config": "abc"`` gave ``AttributeError: 'str' object has no attribute 'get'``, exit 1."""
    model = tmp_path / "model"
    shutil.copytree(base / "tiny", model)
    _edit(model, "config.json", ("quantization_config",), "abc")
    line = assert_refused(invoke("quantize", model, "-s", "int8-row", "-o", tmp_path / "q"))
    assert line == (f"error: {model / 'config.json'}: quantization_config is 'abc' (a string), not an object or null; "
                    "fix the config")


# --------------------------------------------------------------------------- tokenizer files

TOKENIZER_CASES = {
    "auto_map a number": ("tokenizer_config.json", ("auto_map",), 3, ["auto_map is 3 (a number)"]),
    "auto_map tokenizer a number": ("tokenizer_config.json", ("auto_map",), {"AutoTokenizer": 5},
                                    ["auto_map.AutoTokenizer is 5 (a number)"]),
    "tokenizer_class a number": ("tokenizer_config.json", ("tokenizer_class",), 5,
                                 ["tokenizer_class is 5 (a number)", "not a string or null"]),
    "add_prefix_space a string": ("tokenizer_config.json", ("add_prefix_space",), "yes",
                                  ["add_prefix_space is 'yes' (a string)", "not a boolean or null"]),
}


@pytest.mark.parametrize("command", ["quantize", "eval", "inspect-errors"])
@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_tokenizer_config_field_of_the_wrong_type(base, tmp_path, no_load, case, command):
    name, path, value, needles = TOKENIZER_CASES[case]
    model = tmp_path / "model"
    shutil.copytree(base / "tiny", model)
    _edit(model, name, path, value)
    work = tmp_path / "work"
    work.mkdir()
    with Unchanged(inputs=[model], dirs=[work, tmp_path]):
        line = assert_refused(invoke(*COMMANDS[command](model, work)), *needles)
    assert str(model / name) in line


def test_tokenizer_config_not_an_object(base, tmp_path, no_load):
    model = tmp_path / "model"
    shutil.copytree(base / "tiny", model)
    (model / "tokenizer_config.json").write_text("[1, 2]")
    with Unchanged(inputs=[model], dirs=[tmp_path]):
        line = assert_refused(invoke("quantize", model, "-s", "int8-row", "-o", tmp_path / "q"), "(a list)",
                              "not an object")
    assert str(model / "tokenizer_config.json") in line


@pytest.mark.parametrize("path, value, needles", [
    (("model",), "BPE", ["model is 'BPE' (a string)", "not an object or null"]),
    (("model", "type"), 1, ["model.type is 1 (a number)"]),
    (("pre_tokenizer",), ["ByteLevel"], ["pre_tokenizer is ['ByteLevel'] (a list)"]),
    (("pre_tokenizer", "use_regex"), "yes", ["pre_tokenizer.use_regex is 'yes'", "not a boolean"]),
], ids=["model a string", "model type a number", "pre_tokenizer a list", "use_regex a string"])
def test_tokenizer_json_field_for_gguf(base, tmp_path, path, value, needles):
    """--format gguf converts tokenizer.json itself: its fields are checked before any tensor is written."""
    model, work = _edited_copy(base / "tiny", tmp_path, "tokenizer.json", path, value)
    with Unchanged(inputs=[model], dirs=[work, tmp_path]):
        line = assert_refused(invoke("quantize", model, "-s", "q8_0", "--format", "gguf", "-o", work / "m.gguf"),
                              *needles)
    assert str(model / "tokenizer.json") in line


def test_source_record_sha256_a_number(base, tmp_path):
    """qkit-source.json (beside a model qkit converted from a GGUF): its sha256 is read by --format gguf."""
    model = tmp_path / "model"
    shutil.copytree(base / "tiny", model)
    (model / "qkit-source.json").write_text(json.dumps({"gguf": "x.gguf", "sha256": 5}))
    work = tmp_path / "work"
    work.mkdir()
    with Unchanged(inputs=[model], dirs=[work, tmp_path]):
        line = assert_refused(invoke("quantize", model, "-s", "q8_0", "--format", "gguf", "-o", work / "m.gguf"),
                              "sha256 is 5 (a number)", "not a string or null")
    assert str(model / "qkit-source.json") in line


# --------------------------------------------------------------------------- the shard index


def _indexed(base: Path, dst: Path) -> Path:
    """The tiny model with a model.safetensors.index.json naming its one shard."""
    from safetensors import safe_open

    shutil.copytree(base / "tiny", dst)
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    return dst


@pytest.mark.parametrize("edit, needles", [
    (lambda i: {**i, "weight_map": list(i["weight_map"])}, ["weight_map is", "(a list)", "not an object of strings"]),
    (lambda i: {**i, "weight_map": {k: 5 for k in i["weight_map"]}}, ["(a number)", "not a string"]),
    (lambda i: {**i, "weight_map": {k: ["model.safetensors"] for k in i["weight_map"]}}, ["(a list)", "not a string"]),
    (lambda i: {**i, "metadata": "x"}, ["metadata is 'x' (a string)", "not an object"]),
    (lambda i: [i], ["(a list)", "not an object"]),
], ids=["weight_map a list", "shard a number", "shard a list", "metadata a string", "index a list"])
@pytest.mark.parametrize("command", ["quantize", "eval", "inspect-errors"])
def test_index_field_of_the_wrong_type(base, tmp_path, no_load, edit, needles, command):
    model = _indexed(base, tmp_path / "model")
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps(edit(json.loads(index.read_text()))))
    work = tmp_path / "work"
    work.mkdir()
    with Unchanged(inputs=[model], dirs=[work, tmp_path]):
        line = assert_refused(invoke(*COMMANDS[command](model, work)), *needles)
    assert str(index) in line


def test_a_good_index_still_works(base, tmp_path):
    from qkit.checkpoint import weight_files

    model = _indexed(base, tmp_path / "model")
    assert weight_files(model) == [model / "model.safetensors"]


# --------------------------------------------------------------------------- the helper


def test_field_and_check():
    from qkit.jsonfields import BOOL, INT, NULL, NUMBER, OBJECT, STRING, check, field, list_of, obj

    doc = {"a": "x", "n": 3, "f": 1.5, "b": True, "l": ["p", "q"], "o": {"k": {"v": 1}}, "z": None}
    assert field(doc, "a", STRING, "f.json") == "x"
    assert field(doc, "missing", STRING, "f.json", default="d") == "d"
    assert field(doc, "n", INT, "f.json") == 3 and field(doc, "f", NUMBER, "f.json") == 1.5
    assert field(doc, "z", STRING | NULL, "f.json") is None
    assert field(doc, "l", list_of(STRING), "f.json") == ["p", "q"]
    assert check(doc, obj({"o": obj(values=obj({"v": INT}))}), "f.json") is doc

    def refused(fn, error=ModelLoadError):
        with pytest.raises(error) as info:
            fn()
        assert "\n" not in str(info.value)
        return str(info.value)

    assert refused(lambda: field(doc, "a", OBJECT | NULL, "/m/config.json", fix="fix the config")) == \
        "/m/config.json: a is 'x' (a string), not an object or null; fix the config"
    assert refused(lambda: field(doc, "b", INT, "f.json")) == "f.json: b is true (a boolean), not an integer; fix the file"
    assert "n is 3 (a number), not a boolean" in refused(lambda: field(doc, "n", BOOL, "f.json"))
    assert "l[1] is 3 (a number), not a string" in refused(lambda: field({"l": ["p", 3]}, "l", list_of(STRING), "f.json"))
    assert "o.k.v is 1 (a number), not a string" in refused(
        lambda: check(doc, obj({"o": obj(values=obj({"v": STRING}))}), "f.json"))
    assert "qc.x is null (null), not a string" in refused(lambda: field({"x": None}, "x", STRING, "f.json", prefix="qc"))
    # the document itself, and the error class and fix a caller picks
    assert refused(lambda: field([1], "a", STRING, "i.json", error=CheckpointError, fix="re-create it"),
                   CheckpointError) == "i.json is [1] (a list), not an object; re-create it"
    assert refused(lambda: check("s", OBJECT, "e.json", error=ExportError), ExportError).startswith("e.json is 's'")
    long = refused(lambda: field({"a": "y" * 500}, "a", INT, "f.json"))
    assert len(long) < 200 and "..." in long  # a long value is cut: the line stays short


def test_schemas_accept_what_libraries_write(base, tiny_ct_export):
    """No false refusals: transformers' default config of every causal LM, its quantization configs, a
    compressed-tensors export qkit wrote, the tiny model's own files."""
    import warnings

    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import quantization_config as qcm

    from qkit.jsonfields import check
    from qkit.models import check_config, read_config, read_tokenizer_config
    from qkit.models.files import QUANTIZATION_CONFIG

    read_config(base / "tiny")
    read_tokenizer_config(base / "tiny")
    assert read_config(tiny_ct_export)["quantization_config"]["quant_method"] == "compressed-tensors"
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                config = json.loads(CONFIG_MAPPING[model_type]().to_json_string(use_diff=False))
            except Exception:  # noqa: BLE001 - a config class that needs arguments or a missing package
                continue
            check_config(config, model_type)
            checked += 1
        for cls in (qcm.BitsAndBytesConfig, qcm.FbgemmFp8Config, qcm.FineGrainedFP8Config, qcm.Mxfp4Config):
            check(json.loads(json.dumps(cls().to_dict(), default=str)), QUANTIZATION_CONFIG, cls.__name__)
        check(json.loads(json.dumps(qcm.GPTQConfig(bits=4).to_dict(), default=str)), QUANTIZATION_CONFIG, "gptq")
    assert checked > 50
