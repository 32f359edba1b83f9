"""Adversarial model inputs: remote code, incomplete models, bad configs, unreadable or absent paths, corrupt
export records.

The remote-code matrix runs every command that reads a model on a directory whose config.json has an
unknown ``model_type`` and an ``auto_map`` to a Python file that writes a marker when imported, with "y"
on stdin (what transformers' own prompt would accept): each is refused in one line and the marker never
appears. ``quantize --format compressed-tensors`` and ``verify`` run as real subprocesses; the rest
in-process (typer's runner feeds the same stdin to transformers' ``input()``).

Each refusal: exit 2, one ``error:`` line, no traceback, nothing left behind, inputs unchanged.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adversarial import Outcome, Unchanged, assert_refused, evil_module, invoke, make_untrusted, spawn
from conftest import make_tiny_llama

from qkit.errors import ModelLoadError, QkitError

EVAL_FAST = ["--tokens", "64", "--agree-tokens", "1", "--schemes", "int8-row"]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models")
    make_tiny_llama(d / "tiny")
    return d


@pytest.fixture(scope="module")
def marker(base) -> Path:
    return base / "MARKER"


@pytest.fixture(scope="module")
def untrusted(base, marker) -> Path:
    return make_untrusted(base / "tiny", base / "untrusted", marker)


@pytest.fixture(scope="module")
def untrusted_tokenizer(base, marker) -> Path:
    """A llama (built-in code) whose tokenizer_config.json names a tokenizer class only its own file defines."""
    d = base / "untrusted-tok"
    shutil.copytree(base / "tiny", d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "EvilTokenizer"
    tc["auto_map"] = {"AutoTokenizer": ["evil_code.EvilTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "evil_code.py").write_text(evil_module(marker, "EvilTokenizer"))
    return d


@pytest.fixture(scope="module")
def gguf_export(base) -> Path:
    out = base / "tiny.gguf"
    r = invoke("quantize", base / "tiny", "-s", "q8_0", "--format", "gguf", "-o", out)
    assert r.code == 0, r.text
    return out


@pytest.fixture
def no_marker(marker):
    marker.unlink(missing_ok=True)
    yield
    assert not marker.exists(), "the model's own code ran"


@pytest.fixture
def spawn_env(base) -> dict[str, str]:
    # Where transformers would copy the module before importing it: a scratch folder, not ~/.cache.
    return {"HF_MODULES_CACHE": str(base / "hf-modules"), "HF_HUB_OFFLINE": "1"}


# --------------------------------------------------------------------------- 1. remote code is never run


def test_quantize_export_refuses_custom_code_with_y_on_stdin(untrusted, tmp_path, no_marker, spawn_env):
    """The issue's reproduction: `echo y | qkit quantize DIR --format compressed-tensors` ran the file."""
    with Unchanged(inputs=[untrusted], dirs=[tmp_path]):
        r = spawn("quantize", untrusted, "-s", "int8-row", "--format", "compressed-tensors", "-o", tmp_path / "out",
                  input="y\n", env=spawn_env)
        line = assert_refused(r, "custom code", "auto_map", "--trust-remote-code")
    assert "Do you wish" not in r.text and str(untrusted) in line


def test_verify_refuses_custom_code_with_y_on_stdin(tiny_ct_export, base, marker, tmp_path, no_marker, spawn_env):
    """An export whose config.json asks for its own code (its model's auto_map): refused, never prompted."""
    export = make_untrusted(tiny_ct_export, tmp_path / "export", marker)
    with Unchanged(inputs=[export], dirs=[tmp_path]):
        r = spawn("verify", export, "--device", "cpu", input="y\n", env=spawn_env)
        assert_refused(r, "custom code", "--trust-remote-code")


def test_trust_remote_code_reaches_every_load(untrusted, tmp_path, marker, spawn_env):
    """With --trust-remote-code the export path builds the model from the directory's own classes: the flag
    reaches every transformers call (without it, one of them would refuse or prompt)."""
    marker.unlink(missing_ok=True)
    r = spawn("quantize", untrusted, "-s", "int8-row", "--format", "compressed-tensors", "-o", tmp_path / "out",
              "--trust-remote-code", env=spawn_env)
    assert r.code == 0, r.text
    assert marker.read_text() == "model code ran"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "compressed-tensors"
    marker.unlink()


def test_trust_remote_code_reaches_eval(untrusted, tmp_path, marker):
    """eval takes the flag too: the reference and every row are built from the directory's own classes."""
    marker.unlink(missing_ok=True)
    r = invoke("eval", untrusted, *EVAL_FAST, "--json", tmp_path / "r.json", "--trust-remote-code")
    assert r.code == 0 and r.exception is None, r.text
    assert marker.read_text() == "model code ran"
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [row["scheme"] for row in rows] == ["reference", "int8-row"] and rows[1]["matrices"] == 14
    marker.unlink()


def _model_commands(model: Path, out: Path) -> list[list[str]]:
    """Every command that reads a MODEL (see `qkit --help`; speculate and simulate read none)."""
    return [
        ["quantize", model, "-s", "int8-row", "-o", out / "q"],
        ["quantize", model, "-s", "int8-row", "--format", "bitsandbytes", "-o", out / "b"],
        ["quantize", model, "-s", "nf4", "--format", "bitsandbytes", "-o", out / "b"],
        ["quantize", model, "-s", "q8_0", "--format", "gguf", "-o", out / "g.gguf"],
        ["quantize", model, "-s", "int4-g32", "--method", "gptq", "-o", out / "q"],
        ["eval", model, *EVAL_FAST],
        ["inspect", "errors", model, "-s", "int8-row"],
        ["inspect", "matrix", model, "-s", "int8-row"],
        ["inspect", "outliers", model, "--device", "cpu"],
        ["inspect", "sensitivity", model, "-s", "int8-row", "--device", "cpu"],
        ["inspect", "next-token", model, "hello"],
        ["kv", model],
        ["kv", model, "--measure", "--tokens", "8", "--device", "cpu"],
        ["budget", model],
        ["bench", model, "--quick", "--device", "cpu"],
    ]


_COMMAND_IDS = ["quantize-qkit", "quantize-int8-bitsandbytes", "quantize-bitsandbytes", "quantize-gguf",
                "quantize-gptq", "eval", "inspect-errors", "inspect-matrix", "inspect-outliers", "inspect-sensitivity",
                "inspect-next-token", "kv", "kv-measure", "budget", "bench"]


@pytest.mark.parametrize("index", range(len(_COMMAND_IDS)), ids=_COMMAND_IDS)
def test_every_command_refuses_custom_code(untrusted, tmp_path, no_marker, index):
    args = _model_commands(untrusted, tmp_path)[index]
    with Unchanged(inputs=[untrusted], dirs=[tmp_path]):
        assert_refused(invoke(*args, input="y\n"), "custom code", "--trust-remote-code")


@pytest.mark.parametrize("args", [["quantize", "-s", "int8-row"], ["eval", *EVAL_FAST]], ids=["quantize", "eval"])
def test_tokenizer_auto_map_is_refused(untrusted_tokenizer, tmp_path, no_marker, args):
    cmd = [args[0], untrusted_tokenizer, *args[1:]] + (["-o", tmp_path / "q"] if args[0] == "quantize" else [])
    with Unchanged(inputs=[untrusted_tokenizer], dirs=[tmp_path]):
        assert_refused(invoke(*cmd, input="y\n"), "tokenizer_config.json", "EvilTokenizer", "--trust-remote-code")


def test_built_in_architecture_with_auto_map_runs_built_in_code(base, marker, tmp_path, no_marker):
    """A llama whose config also has an auto_map: transformers' own llama is used (trust_remote_code=False is
    passed explicitly), the directory's file is never imported, and the export works."""
    d = tmp_path / "llama-with-auto-map"
    shutil.copytree(base / "tiny", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil_code.EvilModel"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "evil_code.py").write_text(evil_module(marker, "EvilTokenizer"))
    r = invoke("quantize", d, "-s", "int8-row", "--format", "compressed-tensors", "-o", tmp_path / "out", input="y\n")
    assert r.code == 0, r.text
    assert "Do you wish" not in r.text


def test_custom_code_lists_what_needs_code(untrusted, untrusted_tokenizer, base):
    from qkit.models import custom_code

    assert custom_code(untrusted) == ["config.json auto_map: AutoConfig, AutoModelForCausalLM"]
    assert custom_code(untrusted_tokenizer) == ["tokenizer_config.json auto_map: AutoTokenizer (EvilTokenizer)"]
    assert custom_code(base / "tiny") == []


# --------------------------------------------------------------------------- 2. complete models only


def _variant(base: Path, dst: Path, *, drop=(), config=None, replace=None, add=None) -> Path:
    shutil.copytree(base / "tiny", dst)
    state = load_file(str(dst / "model.safetensors"))
    for k in drop:
        del state[k]
    for k, v in (replace or {}).items():
        state[k] = v
    for k, v in (add or {}).items():
        state[k] = v
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _incomplete_cases():
    import torch

    return {
        "deleted": (dict(drop=["model.layers.1.self_attn.q_proj.weight", "model.norm.weight"]),
                    ["missing", "model.layers.1.self_attn.q_proj.weight", "model.norm.weight", "2 missing"]),
        "more-layers": (dict(config={"num_hidden_layers": 4}), ["layers 2, 3 entirely", "18 missing"]),
        "fewer-layers": (dict(config={"num_hidden_layers": 1}), ["unexpected", "model.layers.1.", "9 unexpected"]),
        "shape": (dict(replace={"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 5)}),
                  ["model.layers.0.mlp.up_proj.weight", "[3, 5]", "[160, 64]"]),
        "untied-no-head": (dict(config={"tie_word_embeddings": False}), ["missing lm_head.weight"]),
    }


# Every case through quantize; the first through every other path that reads the weights.
_INCOMPLETE = [(case, "quantize") for case in _incomplete_cases()] + [
    ("deleted", c) for c in ("quantize-gptq", "eval", "inspect", "inspect-errors", "inspect-matrix", "kv-measure")]


@pytest.mark.parametrize("case, command", _INCOMPLETE)
def test_incomplete_model_is_refused(base, tmp_path, monkeypatch, case, command):
    kwargs, needles = _incomplete_cases()[case]
    model = _variant(base, tmp_path / "model", **kwargs)
    work = tmp_path / "work"
    work.mkdir()
    args = {
        "quantize": ["quantize", model, "-s", "int8-row", "-o", work / "q"],
        "quantize-gptq": ["quantize", model, "-s", "int4-g32", "--method", "gptq", "-o", work / "q"],
        "eval": ["eval", model, *EVAL_FAST],
        "inspect": ["inspect", "outliers", model, "--device", "cpu"],
        "inspect-errors": ["inspect", "errors", model, "-s", "int8-row"],
        "inspect-matrix": ["inspect", "matrix", model, "-s", "int8-row"],
        "kv-measure": ["kv", model, "--measure", "--tokens", "8", "--device", "cpu"],
    }[command]
    # No weights are read before the refusal: safetensors' loader fails the test if reached.
    monkeypatch.setattr("transformers.modeling_utils.PreTrainedModel.from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("weights loaded before the refusal")))
    with Unchanged(inputs=[model], dirs=[work]):
        line = assert_refused(invoke(*args), "does not hold the tensors", *needles)
    assert "above report" not in line


def test_qkit_checkpoint_with_a_missing_tensor(base, tmp_path):
    """A qkit checkpoint's stored parts (W.qweight, W.scales) count as W; a deleted norm is named."""
    from qkit.api import quantize_model
    from qkit.models import check_complete, resolve

    ckpt = tmp_path / "ckpt"
    quantize_model(base / "tiny", output=ckpt, scheme="int8-row")
    check_complete(resolve(ckpt))  # complete: passes
    path = ckpt / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    state = load_file(str(path))
    del state["model.norm.weight"]
    save_file(state, str(path), metadata=meta)
    with pytest.raises(ModelLoadError, match=r"missing model\.norm\.weight \(1 missing"):
        check_complete(resolve(ckpt))
    with Unchanged(inputs=[ckpt]):
        assert_refused(invoke("inspect", "next-token", ckpt, "hello", "--device", "cpu"), "model.norm.weight")


def test_expected_tensors(base, tmp_path):
    from qkit.models import expected_tensors

    tied = expected_tensors(base / "tiny")
    assert len(tied) == 2 * 9 + 2 and "lm_head.weight" not in tied  # tied: stored once, as the embedding
    assert tied["model.embed_tokens.weight"] == (304, 64)
    assert tied["model.layers.1.self_attn.k_proj.weight"] == (32, 64)  # 2 kv heads of 16
    assert not any("inv_freq" in n for n in tied)  # non-persistent buffer
    untied = tmp_path / "untied"
    make_tiny_llama(untied, tie=False, layers=3)
    shapes = expected_tensors(untied)
    assert len(shapes) == 3 * 9 + 3 and shapes["lm_head.weight"] == (304, 64)


# --------------------------------------------------------------------------- 3. config sanity


@pytest.mark.parametrize("edit, needle", [
    ({"num_attention_heads": 6, "head_dim": None}, "not a multiple of num_attention_heads 6"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"hidden_size": 0}, "hidden_size is 0"),
    ({"num_hidden_layers": -1}, "num_hidden_layers is -1"),
    ({"vocab_size": 304.0}, "vocab_size is 304.0"),
    ({"intermediate_size": "160"}, "intermediate_size is '160'"),
    ({"num_attention_heads": True}, "num_attention_heads is True"),
    ({"head_dim": 15, "num_attention_heads": 4}, "rotary dimension 15"),
])
def test_check_architecture(base, edit, needle):
    from qkit.models import check_architecture

    cfg = json.loads((base / "tiny" / "config.json").read_text())
    check_architecture(cfg)  # the tiny model's own config passes
    with pytest.raises(ModelLoadError, match="not a positive integer|not a multiple|is odd") as info:
        check_architecture({**cfg, **edit})
    assert needle in str(info.value)


@pytest.mark.parametrize("command", ["eval", "bench", "kv", "budget"])
def test_bad_heads_are_one_line(base, tmp_path, command):
    """The issue's case: heads that do not divide the hidden size (eval, bench) gave a traceback."""
    model = _variant(base, tmp_path / "model", config={"num_attention_heads": 6, "head_dim": None})
    args = {"eval": ["eval", model, *EVAL_FAST], "bench": ["bench", "--config", model / "config.json", "--quick"],
            "kv": ["kv", "--config", model / "config.json"], "budget": ["budget", model]}[command]
    with Unchanged(inputs=[model], dirs=[tmp_path]):
        assert_refused(invoke(*args), "hidden_size 64 is not a multiple of num_attention_heads 6")


def test_transformers_own_config_rule_is_named(base, tmp_path):
    """llama requires heads | hidden even with head_dim given: transformers' message, not its validator's."""
    model = _variant(base, tmp_path / "model", config={"num_attention_heads": 6})  # head_dim 16 kept
    with Unchanged(inputs=[model], dirs=[tmp_path]):
        line = assert_refused(invoke("quantize", model, "-s", "int8-row", "-o", tmp_path / "q"),
                              "hidden size (64) is not a multiple of the number of attention heads (6)")
    assert "validator" not in line


# --------------------------------------------------------------------------- 4. messages that name the cause


def _spawn_unprivileged(*args: str, cwd: Path) -> Outcome:
    """``python -m qkit ARGS`` as an unprivileged user (a user namespace: root ignores permission bits)."""
    proc = subprocess.run(["unshare", "--user", "--map-user=65534", sys.executable, "-m", "qkit", *map(str, args)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300, cwd=cwd,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return Outcome(proc.returncode, proc.stdout, proc.stderr)


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--user", "--map-user=65534", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _unshare_works(), reason="no unprivileged user namespace here (unshare --user)")
@pytest.mark.parametrize("what", [".", "config.json", "model.safetensors"])
def test_unreadable_model_says_permission_denied(base, tmp_path, what):
    model = tmp_path / "model"
    shutil.copytree(base / "tiny", model)
    target = model / what
    target.chmod(0)
    try:
        with Unchanged(dirs=[tmp_path]):
            r = _spawn_unprivileged("quantize", model, "-s", "int8-row", "-o", tmp_path / "out", cwd=tmp_path)
            line = assert_refused(r, "permission denied")
    finally:
        target.chmod(0o755 if target.is_dir() else 0o644)
    assert "No such file" not in line and "corrupt" not in line


@pytest.mark.parametrize("spec, needles", [
    ("models/x", ["no such file or directory: models/x", "models/ exists here"]),
    ("./x", ["no such file or directory: ./x"]),
    ("models/empty", ["has no config.json"]),
    ("models", ["has no config.json"]),
])
def test_local_path_is_not_a_hub_fetch(tmp_path, monkeypatch, spec, needles):
    (tmp_path / "models" / "empty").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with Unchanged(dirs=[tmp_path, tmp_path / "models"]):
        line = assert_refused(invoke("quantize", spec, "-s", "int8-row", "-o", tmp_path / "out"), *needles)
    assert "cannot fetch" not in line  # a local path problem, never a failed hub fetch


class _HubThatFails(http.server.BaseHTTPRequestHandler):
    """Lists a repo, then answers every file request with 503: huggingface_hub retries (and logs) each one."""

    def _reply(self):
        if "/tree/" in self.path:
            body = json.dumps([{"type": "file", "path": "config.json", "size": 10, "oid": "b" * 40}]).encode()
        elif self.path.startswith("/api/models/"):
            body = json.dumps({"id": "foo/bar", "sha": "a" * 40, "siblings": [{"rfilename": "config.json"}]}).encode()
        else:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_HEAD = _reply

    def log_message(self, *_args):
        pass


def test_hub_retries_are_one_line(tmp_path):
    """5 retries of a 503 logged 10 warning lines before qkit's error; now only the error (retries not
    waited for: a sitecustomize in the child makes time.sleep free)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubThatFails)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import time\ntime.sleep = lambda s: None\n")
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "0", "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    try:
        r = spawn("quantize", "foo/bar", "-s", "int8-row", "-o", tmp_path / "out", env=env)
    finally:
        server.shutdown()
    assert_refused(r, "cannot fetch foo/bar from the Hugging Face hub")
    assert "Retry" not in r.text


@pytest.mark.parametrize("env, needle", [
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot fetch foo/bar from the Hugging Face hub"),
], ids=["offline", "unreachable"])
def test_hub_fetch_offline_is_one_line(tmp_path, env, needle):
    r = spawn("eval", "foo/bar", *EVAL_FAST, env={**env, "HF_HOME": str(tmp_path / "hf")})
    assert_refused(r, needle)


# --------------------------------------------------------------------------- 4b. verify: corrupt export records


def _edit_record(path: Path, edit) -> None:
    record = json.loads(path.read_text())
    edited = edit(record)
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))


def _first(record: dict) -> dict:
    return record["tensors"][sorted(record["tensors"])[0]]


@pytest.mark.parametrize("edit, needles", [
    (lambda r: "{not json", ["not valid JSON"]),
    (lambda r: [r], ["JSON list, not an object"]),
    (lambda r: {k: v for k, v in r.items() if k != "tensors"}, ["'tensors' of type NoneType"]),
    (lambda r: {**r, "tensors": list(r["tensors"])}, ["'tensors' of type list"]),
    (lambda r: {**r, "format": "fancy-format"}, ["format 'fancy-format'"]),
    (lambda r: {k: v for k, v in r.items() if k != "format"}, ["format None"]),
    (lambda r: {**r, "format_version": 99}, ["format_version 99"]),
    (lambda r: (_first(r).update(shape="64x160"), r)[1], ["shape '64x160'"]),
    (lambda r: (_first(r).update(scheme={"name": "int9-row"}), r)[1], ["int9-row"]),
    (lambda r: (_first(r).update(sha256=7), r)[1], ["sha256", "not 64 hex digits"]),
    (lambda r: (_first(r).pop("dtype"), r)[1], ["has no dtype"]),
], ids=["json", "list", "no-tensors", "tensors-list", "format", "no-format", "version", "shape", "scheme", "sha",
        "no-dtype"])
def test_verify_refuses_a_corrupt_export_record(tiny_ct_export, tmp_path, edit, needles):
    export = tmp_path / "export"
    shutil.copytree(tiny_ct_export, export)
    _edit_record(export / "qkit-export.json", edit)
    with Unchanged(inputs=[export], dirs=[tmp_path]):
        assert_refused(invoke("verify", export, "--device", "cpu"), "qkit-export.json", *needles)


def _corrupt_gguf_field(src: Path, dst: Path, old: bytes, new: bytes) -> None:
    """Replace, in place and at the same length, bytes of the file's ``qkit.export`` JSON."""
    data = src.read_bytes()
    start = data.index(b'{"format": "gguf"') if b'{"format": "gguf"' in data else data.index(b'"format":')
    at = data.index(old, start)
    assert len(old) == len(new)
    dst.write_bytes(data[:at] + new + data[at + len(old):])


@pytest.mark.parametrize("old, new, needles", [
    (b'"format"', b'!format"', ["not valid JSON"]),
    (b'"format": "gguf"', b'"format": "ggxf"', ["format 'ggxf'"]),
    (b'"tensors": {', b'"tensors": [', ["not valid JSON"]),
], ids=["json", "format", "tensors"])
def test_verify_refuses_a_corrupt_gguf_record(gguf_export, tmp_path, old, new, needles):
    bad = tmp_path / "bad.gguf"
    _corrupt_gguf_field(gguf_export, bad, old, new)
    with Unchanged(inputs=[bad], dirs=[tmp_path]):
        assert_refused(invoke("verify", bad, "--device", "cpu"), "qkit.export record", *needles)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=6)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_export_record_is_a_qkit_error(tiny_ct_export, tmp_path_factory, data):
    """Any mutation of a real qkit-export.json (a value replaced by other JSON, a key deleted or added) is
    read back either as before or refused with a QkitError: never another exception."""
    from qkit.export.common import read_export_manifest
    from qkit.verify import iter_decoded

    export = tmp_path_factory.mktemp("fuzz") / "export"
    shutil.copytree(tiny_ct_export, export)
    record = json.loads((export / "qkit-export.json").read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(record))
        path = data.draw(st.sampled_from(paths))
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if not path:
            record = data.draw(_JSON)
            continue
        parent = record
        for p in path[:-1]:
            parent = parent[p]
        if action == "replace":
            parent[path[-1]] = data.draw(_JSON)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=6))] = data.draw(_JSON)
    (export / "qkit-export.json").write_text(json.dumps(record))
    try:
        entries = read_export_manifest(export, "compressed-tensors")
        for _ in iter_decoded(export, entries):
            pass
    except QkitError:
        pass
    shutil.rmtree(export.parent)


def test_every_transformers_load_passes_trust_remote_code_explicitly():
    """transformers prompts on stdin when ``trust_remote_code`` is not passed (None) and a model needs its own
    code: every ``from_pretrained`` / ``from_config`` call in src/qkit passes the argument, so it never asks."""
    import ast

    src = Path(__file__).resolve().parents[1] / "src" / "qkit"
    calls, missing = 0, []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("from_pretrained", "from_config")):
                calls += 1
                if not any(k.arg == "trust_remote_code" for k in node.keywords):
                    missing.append(f"{path.relative_to(src)}:{node.lineno} {ast.unparse(node.func)}")
    assert calls >= 10, calls  # the walk found the loads (models, export, verify, serving)
    assert not missing, missing
