"""Adversarial inputs, round 2 (issue 33 f): hostile plan files, importance matrices, report inputs that
carry HTML, an engine interpreter that is not Python, and Ctrl-C / SIGKILL during ``plan`` and ``imatrix``.

Each refusal: exit 2, one ``error:`` line, no traceback, nothing left behind, inputs unchanged
(``tests/adversarial.py``); a refusal that must come before the model is resolved, read or loaded fails
the test if that happens (``tripwire``). The matrix:

* ``--plan FILE`` (quantize) and ``plan:FILE`` (eval): not JSON, not an object, the wrong marker or
  version, every field of the wrong type or value (tensors, a type, a scheme, bytes, shape, KL, the
  records), names no model has (path separators, control characters), a plan of another model, deep
  nesting, a 2 GB file (refused by its size), invalid UTF-8, a directory, an unreadable file;
* ``--imatrix FILE`` (quantize, plan): empty, truncated, NaN / inf / negative sums, negative or zero
  counts, widths that are not the tensor's, another model's names, huge declared counts and lengths, a
  legacy ``.dat`` with a negative entry count, a 2 GB sparse file (memory-mapped, never read whole);
* ``qkit report``: every string of every input carrying ``<script>``, an ``onerror`` attribute,
  ``</script>``, ``-->`` and mathtext; the page holds no injected element; hostile shapes refused;
* ``$QKIT_ENGINE_PYTHON``: missing, a directory, not executable, ``/bin/false``, ``/bin/echo``, a script
  printing garbage, a Python without the engine;
* SIGINT and SIGKILL while ``plan`` / ``imatrix`` work or write: exit 130 and one line, no output, no
  staging sibling; after SIGKILL the next run removes what was left and succeeds.

The signal cases slow the command down from outside: a ``sitecustomize`` on ``PYTHONPATH`` (written by
``_hook``) wraps the progress callback or the staged write of the child process; qkit has no test hook.
"""

from __future__ import annotations

import copy
import html.parser
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from adversarial import Unchanged, assert_refused, invoke, listing, tripwire
from conftest import make_tiny_llama

from qkit import claims, reading
from qkit.staging import TMP_MARK

T = "model.layers.0.mlp.down_proj.weight"  # [64, 160] in the tiny model
PLAN_FAST = ["--calibration-samples", "2", "--calibration-seqlen", "32", "--check-windows", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("r2") / "tiny"
    make_tiny_llama(d)
    return d


@pytest.fixture(scope="module")
def plan_doc(tiny, tmp_path_factory) -> dict:
    """A gguf plan of the tiny model (as ``qkit plan -o`` writes it)."""
    from qkit.api import plan_model
    from qkit.plan import PlanOptions

    out = tmp_path_factory.mktemp("r2plan") / "plan.json"
    plan_model(str(tiny), options=PlanOptions(format="gguf", target_bits=6.0, samples=2, seqlen=32, check_windows=1),
               output=out)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def matrix(tiny, tmp_path_factory):
    """The tiny model's importance matrix (``qkit imatrix``), read back."""
    from qkit.api import imatrix_model
    from qkit.methods.imatrix import ImatrixOptions
    from qkit.methods.imatrix.file import read

    out = tmp_path_factory.mktemp("r2im") / "im.gguf"
    imatrix_model(str(tiny), output=out, options=ImatrixOptions(chunks=4, chunk_size=32))
    return read(out)


# --------------------------------------------------------------------------- 1. plan files


def _set(doc: dict, *path_and_value) -> dict:
    *path, value = path_and_value
    d = doc
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return doc


def _rename(doc: dict, new: str) -> dict:
    doc["tensors"][new] = doc["tensors"].pop(T)
    return doc


# (id, a change of the good plan's dict (or the file's bytes), words the line must hold)
PLAN_CASES = [
    ("not-json", b"{not json", "not a readable JSON"),
    ("empty", b"", "not a readable JSON"),
    ("list", b"[1, 2]", "not a qkit plan"),
    ("number", b"3", "not a qkit plan"),
    ("null", b"null", "not a qkit plan"),
    ("invalid-utf8", b'{"format": "qkit-plan\xff"}', "not UTF-8"),
    ("bom", b"\xef\xbb\xbf{}", "not a readable JSON"),
    ("deep-list", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("deep-object", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    ("wrong-marker", lambda d: _set(d, "format", "qkit-export"), "not a qkit plan"),
    ("marker-number", lambda d: _set(d, "format", 1), "not a qkit plan"),
    ("version-string", lambda d: _set(d, "format_version", "1"), "format_version"),
    ("version-true", lambda d: _set(d, "format_version", True), "format_version"),
    ("no-tensors", lambda d: d.pop("tensors") and d, "names no tensors"),
    ("tensors-list", lambda d: _set(d, "tensors", [T]), "names no tensors"),
    ("tensors-empty", lambda d: _set(d, "tensors", {}), "names no tensors"),
    ("entry-list", lambda d: _set(d, "tensors", T, [1]), "not an object"),
    ("type-number", lambda d: _set(d, "tensors", T, "type", 4), "type 4"),
    ("type-unknown", lambda d: _set(d, "tensors", T, "type", "q9_9"), "q9_9"),
    ("type-other-format", lambda d: _set(d, "tensors", T, "type", "int4-g64"), "int4-g64"),
    ("type-not-its-scheme", lambda d: _set(d, "tensors", T, "type", "q8_0" if d["tensors"][T]["type"] != "q8_0" else "q4_0"),
     "stores scheme"),
    ("scheme-unknown", lambda d: _set(d, "tensors", T, "scheme", "name", "q9_9"), "q9_9"),
    ("scheme-string", lambda d: _set(d, "tensors", T, "scheme", "q4_0"), "malformed"),
    ("scheme-field", lambda d: _set(d, "tensors", T, "scheme", "block_size", "x"), "block_size"),
    ("kept-with-no-keep", lambda d: _set(d, "tensors", T, "scheme", None), "no scheme"),
    ("bytes-negative", lambda d: _set(d, "tensors", T, "bytes", -5), "bytes -5"),
    ("bytes-float", lambda d: _set(d, "tensors", T, "bytes", 7680.5), "bytes 7680.5"),
    ("bytes-nan", lambda d: _set(d, "tensors", T, "bytes", float("nan")), "bytes nan"),
    ("bytes-huge", lambda d: _set(d, "tensors", T, "bytes", 10**30), "not what --format gguf stores"),
    ("bytes-off-by-one", lambda d: _set(d, "tensors", T, "bytes", d["tensors"][T]["bytes"] + 1), "not what --format gguf stores"),
    ("bytes-string", lambda d: _set(d, "tensors", T, "bytes", "7680"), "not a positive integer"),
    ("shape-3d", lambda d: _set(d, "tensors", T, "shape", [64, 160, 1]), "shape"),
    ("shape-zero", lambda d: _set(d, "tensors", T, "shape", [0, 160]), "shape"),
    ("shape-huge", lambda d: _set(d, "tensors", T, "shape", [10**12, 10**12]), "not what --format gguf stores"),
    ("kl-nan", lambda d: _set(d, "tensors", T, "predicted_kl", float("nan")), "predicted_kl nan"),
    ("kl-negative", lambda d: _set(d, "tensors", T, "predicted_kl", -1.0), "predicted_kl"),
    ("kl-inf", lambda d: _set(d, "tensors", T, "predicted_kl", float("inf")), "predicted_kl inf"),
    ("lossless-string", lambda d: _set(d, "tensors", T, "lossless", "yes"), "lossless"),
    ("candidates-list", lambda d: _set(d, "tensors", T, "candidates", [1]), "candidates"),
    ("candidates-bad", lambda d: _set(d, "tensors", T, "candidates", {"q4_0": "x"}), "candidates"),
    ("model-number", lambda d: _set(d, "model", 5), "'model'"),
    ("fingerprint-number", lambda d: _set(d, "model_fingerprint", 5), "model_fingerprint"),
    ("format-unknown", lambda d: _set(d, "target_format", "zip"), "target_format 'zip'"),
    ("format-number", lambda d: _set(d, "target_format", 5), "target_format"),
    ("method-unknown", lambda d: _set(d, "method", "awq"), "method 'awq'"),
    ("gptq-unpriced", lambda d: _set(d, "method", "gptq"), "sensitivity.feedback.gptq"),
    ("target-list", lambda d: _set(d, "target", []), "'target'"),
    ("imatrix-string", lambda d: _set(d, "imatrix", "im.gguf"), "'imatrix'"),
    ("imatrix-no-sha", lambda d: _set(d, "imatrix", {"file": "im.gguf"}), "sha256"),
    ("check-list", lambda d: _set(d, "check", [1]), "'check'"),
    ("check-kl-string", lambda d: _set(d, "check", "measured_kl", "x"), "measured_kl"),
    ("solver-string", lambda d: _set(d, "solver", "x"), "'solver'"),
    ("sensitivity-list", lambda d: _set(d, "sensitivity", []), "'sensitivity'"),
    ("version-object", lambda d: _set(d, "qkit_version", {"a": 1}), "qkit_version"),
    ("name-control", lambda d: _rename(d, "model.layers.0\x1b[31m\n.mlp.down_proj.weight"), "control characters"),
]
# Checked against the model's headers: after it is resolved, before anything heavy.
PLAN_MODEL_CASES = [
    ("name-not-in-model", lambda d: _rename(d, "model.layers.9.mlp.down_proj.weight"), "model.layers.9.mlp.down_proj.weight is not a tensor"),
    ("name-path", lambda d: _rename(d, "../../etc/passwd"), "../../etc/passwd is not a tensor"),
    ("name-slash", lambda d: _rename(d, "model/layers/0/mlp/down_proj.weight"), "is not a tensor"),
    ("fingerprint-other", lambda d: _set(d, "model_fingerprint", "0" * 64), "whose tensors differ"),
]


def _plan_file(tmp_path: Path, plan_doc: dict, change) -> Path:
    f = tmp_path / "plan.json"
    if isinstance(change, bytes):
        f.write_bytes(change)
    else:
        f.write_text(json.dumps(change(copy.deepcopy(plan_doc))))
    return f


@pytest.mark.parametrize("case, change, needle", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_a_hostile_plan_file_is_refused_before_the_model_is_resolved(tiny, plan_doc, tmp_path, monkeypatch, case, change, needle):
    f = _plan_file(tmp_path, plan_doc, change)
    tripwire(monkeypatch, "qkit.models.inputs.resolve", "the model was resolved")
    with Unchanged(inputs=[tiny, f], dirs=[tmp_path]):
        line = assert_refused(invoke("quantize", tiny, "--plan", f, "--format", "gguf", "-o", tmp_path / "q.gguf"), "--plan", needle)
    assert "\x1b" not in line


@pytest.mark.parametrize("case, change, needle", PLAN_MODEL_CASES, ids=[c[0] for c in PLAN_MODEL_CASES])
def test_a_plan_naming_what_the_model_lacks_is_refused_before_work(tiny, plan_doc, tmp_path, monkeypatch, case, change, needle):
    f = _plan_file(tmp_path, plan_doc, change)
    tripwire(monkeypatch, "qkit.api.prepare_export", "the export began")
    with Unchanged(inputs=[tiny, f], dirs=[tmp_path]):
        assert_refused(invoke("quantize", tiny, "--plan", f, "--format", "gguf", "-o", tmp_path / "q.gguf"), needle)


@pytest.mark.parametrize("other, needle", [
    (dict(layers=1), "model.layers.1."),  # names the other model lacks
    (dict(intermediate=192), "[64, 160] there and [64, 192]"),  # the same names, other shapes
], ids=["other-names", "other-shapes"])
def test_a_plan_for_another_model_is_refused_by_quantize_and_eval(tiny, plan_doc, tmp_path, monkeypatch, other, needle):
    d = tmp_path / "other"
    make_tiny_llama(d, **other)
    f = _plan_file(tmp_path, plan_doc, lambda p: p)
    tripwire(monkeypatch, "qkit.api.prepare_export", "the export began")
    tripwire(monkeypatch, "qkit.evaluation.runner.load", "the reference model was loaded")
    with Unchanged(inputs=[d, f], dirs=[tmp_path]):
        assert_refused(invoke("quantize", d, "--plan", f, "--format", "gguf", "-o", tmp_path / "q.gguf"), "was made for", needle)
        assert_refused(invoke("eval", d, "--schemes", f"plan:{f}", "--tokens", "64", "--agree-tokens", "1"), "was made for", needle)


@pytest.mark.parametrize("case", ["not-json", "wrong-marker", "imatrix-string", "deep-list", "bytes-off-by-one"])
def test_eval_refuses_a_hostile_plan_row_before_the_reference_loads(tiny, plan_doc, tmp_path, monkeypatch, case):
    change, needle = {c[0]: (c[1], c[2]) for c in PLAN_CASES}[case]
    f = _plan_file(tmp_path, plan_doc, change)
    tripwire(monkeypatch, "qkit.evaluation.runner.resolve", "the model was resolved")
    with Unchanged(inputs=[tiny, f], dirs=[tmp_path]):
        assert_refused(invoke("eval", tiny, "--schemes", f"plan:{f}", "--tokens", "64", "--agree-tokens", "1"), needle)


def test_a_2gb_plan_is_refused_by_its_size_before_a_byte_is_read(tiny, tmp_path, monkeypatch):
    f = tmp_path / "big.json"
    with open(f, "wb") as fh:  # sparse: no disk, no time
        fh.write(b'{"format": "qkit-plan"')
        fh.truncate(2 * 1024**3)
    tripwire(monkeypatch, "json.loads", "the 2 GB file was parsed")
    with Unchanged(dirs=[tmp_path]):
        assert_refused(invoke("quantize", tiny, "--plan", f, "--format", "gguf", "-o", tmp_path / "q.gguf"), "larger than any plan")


def test_a_directory_or_unreadable_file_as_the_plan_is_one_line(tiny, plan_doc, tmp_path, monkeypatch):
    d = tmp_path / "plan-dir"
    d.mkdir()
    with Unchanged(inputs=[tiny], dirs=[tmp_path]):
        assert_refused(invoke("quantize", tiny, "--plan", d, "--format", "gguf", "-o", tmp_path / "q.gguf"), "is a directory")
        assert_refused(invoke("quantize", tiny, "--plan", tmp_path / "absent.json", "--format", "gguf", "-o", tmp_path / "q.gguf"),
                       "no such file")
    f = _plan_file(tmp_path, plan_doc, lambda p: p)
    f.chmod(0)
    if os.geteuid() == 0:  # root reads a chmod 000 file: the read fails as it would for anyone else
        real = reading.read_bytes  # every read of a user's file goes through qkit.reading

        def denied(path, *a, **k):
            if Path(path) == f:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *a, **k)
        monkeypatch.setattr(reading, "read_bytes", denied)
    try:
        with Unchanged(dirs=[tmp_path]):
            assert_refused(invoke("quantize", tiny, "--plan", f, "--format", "gguf", "-o", tmp_path / "q.gguf"), "permission denied")
    finally:
        f.chmod(0o644)


def test_the_good_plan_still_reads_and_round_trips(plan_doc, tmp_path):
    from qkit.plan import read_plan

    p = read_plan(_plan_file(tmp_path, plan_doc, lambda d: d))
    assert p.to_dict()["tensors"][T]["bytes"] == plan_doc["tensors"][T]["bytes"] and p.method == "rtn"


# --------------------------------------------------------------------------- 2. importance matrices


def _legacy(entries, tail: bytes = b"") -> bytes:
    """llama.cpp's legacy .dat (``save_imatrix_legacy``): n, then per entry len, name, ncall, nval, values."""
    out = struct.pack("<i", len(entries))
    for name, ncall, values in entries:
        b = name.encode()
        out += struct.pack("<i", len(b)) + b + struct.pack("<ii", ncall, len(values)) + np.asarray(values, "<f4").tobytes()
    return out + tail


def _gguf(matrix, change):
    from qkit.methods.imatrix.file import ImatrixEntry

    m = copy.deepcopy(matrix)
    first = sorted(m.entries)[0]
    change(m, first, ImatrixEntry)
    return m


def _entry(m, name, value):
    m.entries[name] = value


IMATRIX_CASES = [  # (id, build(matrix, dir) -> path, words); refused when the file is read
    ("empty", lambda m, d: _bytes(d / "e.dat", b""), "empty"),
    ("garbage", lambda m, d: _bytes(d / "g.bin", bytes(range(256)) * 16), "not an importance matrix"),
    ("gguf-truncated", lambda m, d: _bytes(d / "t.gguf", _gguf_bytes(m, d)[:200]), "not a readable GGUF"),
    ("gguf-header-only", lambda m, d: _bytes(d / "h.gguf", _gguf_bytes(m, d)[:10]), "not a readable GGUF"),
    ("gguf-huge-tensor-count", lambda m, d: _bytes(d / "n.gguf", _patch(_gguf_bytes(m, d), 8, 1 << 62)), "not a readable GGUF"),
    ("gguf-huge-kv-count", lambda m, d: _bytes(d / "k.gguf", _patch(_gguf_bytes(m, d), 16, 1 << 62)), "not a readable GGUF"),
    ("gguf-nan", lambda m, d: _write(d / "nan.gguf", _gguf(m, lambda x, f, E: x.entries[f].sums.__setitem__((0, 0), np.nan))),
     "non-finite"),
    ("gguf-inf", lambda m, d: _write(d / "inf.gguf", _gguf(m, lambda x, f, E: x.entries[f].sums.__setitem__((0, 1), np.inf))),
     "non-finite"),
    ("gguf-negative", lambda m, d: _write(d / "neg.gguf", _gguf(m, lambda x, f, E: x.entries[f].sums.__setitem__((0, 0), -1.0))),
     "negative sums"),
    ("gguf-negative-count", lambda m, d: _write(d / "nc.gguf", _gguf(m, lambda x, f, E: x.entries[f].counts.__setitem__(0, -5))),
     "negative count"),
    ("gguf-nan-count", lambda m, d: _write(d / "ncn.gguf", _gguf(m, lambda x, f, E: x.entries[f].counts.__setitem__(0, np.nan))),
     "non-finite"),
    ("not-an-imatrix-gguf", lambda m, d: _model_gguf(d / "model.gguf"), "no .in_sum2/.counts"),
    ("dat-negative-entries", lambda m, d: _bytes(d / "n.dat", struct.pack("<i", -3) + b"\0" * 64), "-3 entries"),
    ("dat-huge-entries", lambda m, d: _bytes(d / "h.dat", struct.pack("<i", 2**31 - 1) + b"\0" * 64), "2147483647 entries"),
    ("dat-huge-name", lambda m, d: _bytes(d / "l.dat", struct.pack("<ii", 1, 2**30) + b"x" * 64), "name of length"),
    ("dat-huge-values", lambda m, d: _bytes(d / "v.dat", struct.pack("<ii", 1, 3) + b"abc" + struct.pack("<ii", 1, 2**31 - 1) + b"\0" * 16),
     "declares 2147483647 values"),
    ("dat-negative-values", lambda m, d: _bytes(d / "nv.dat", struct.pack("<ii", 1, 3) + b"abc" + struct.pack("<ii", 1, -4) + b"\0" * 16),
     "declares -4 values"),
    ("dat-truncated", lambda m, d: _bytes(d / "t.dat", _dat(m)[:-10]), "which the file does not hold"),
    ("dat-nan", lambda m, d: _bytes(d / "nan.dat", _dat(m, value=float("nan"))), "non-finite"),
    ("dat-negative", lambda m, d: _bytes(d / "neg.dat", _dat(m, value=-1.0)), "negative sums"),
    ("dat-negative-ncall", lambda m, d: _bytes(d / "nn.dat", _dat(m, ncall=-2)), "negative count"),
    ("dat-2gb-sparse", lambda m, d: _sparse(d / "big.dat"), "entry name of length 0"),
    ("directory", lambda m, d: _mkdir(d / "im-dir"), "is a directory"),
]
# Checked against the model (its names and widths): after it is resolved, before anything is quantized.
IMATRIX_MODEL_CASES = [
    ("gguf-zero-count", lambda m, d: _write(d / "z.gguf", _gguf(m, lambda x, f, E: x.entries[f].counts.__setitem__(0, 0))), "counts 0 tokens"),
    ("dat-zero-ncall", lambda m, d: _bytes(d / "z.dat", _dat(m, ncall=0)), "counts 0 tokens"),
    ("width-not-the-tensors", lambda m, d: _write(d / "w.gguf", _gguf(m, lambda x, f, E: _entry(
        x, f, E(np.ones((1, 7), np.float32), np.array([3.0], np.float32))))), "has 7 columns"),
    ("other-names", lambda m, d: _write(d / "o.gguf", _gguf(m, lambda x, f, E: _entry(x, "blk.99.attn_q.weight", x.entries.pop(f)))),
     "name no tensor of this model"),
    ("other-widths", lambda m, d: _write(d / "ow.gguf", _gguf(m, lambda x, f, E: x.entries.update(
        {k: E(np.ones((1, 2 * e.width), np.float32), e.counts) for k, e in x.entries.items()}))), "collected from another model"),
    ("expert-rows", lambda m, d: _write(d / "x.gguf", _gguf(m, lambda x, f, E: _entry(
        x, f, E(np.ones((2, x.entries[f].width), np.float32), np.array([3.0, 3.0], np.float32))))), "expert rows"),
    ("dat-binary-name", lambda m, d: _bytes(d / "b.dat", struct.pack("<ii", 1, 3) + b"\xff\xfe\x01" + struct.pack("<ii", 1, 1)
                                             + np.ones(1, "<f4").tobytes()), "name no tensor of this model"),
]


def _bytes(p: Path, b: bytes) -> Path:
    p.write_bytes(b)
    return p


def _write(p: Path, m) -> Path:
    from qkit.methods.imatrix.file import write_gguf

    write_gguf(m, p)
    return p


def _gguf_bytes(m, d: Path) -> bytes:
    return _write(d / ".scratch.gguf", m).read_bytes()


def _patch(b: bytes, at: int, value: int) -> bytes:
    return b[:at] + struct.pack("<Q", value) + b[at + 8:]


def _dat(m, *, ncall: int = 10, value: float | None = None) -> bytes:
    return _legacy([(k, ncall, np.full(e.width, value, np.float32) if value is not None else e.sums[0] / e.counts[0] * max(ncall, 1))
                    for k, e in sorted(m.entries.items())])


def _model_gguf(p: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(p), arch="llama")
    w.add_tensor("token_embd.weight", np.ones((4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return p


def _sparse(p: Path) -> Path:
    with open(p, "wb") as fh:
        fh.write(struct.pack("<i", 3))
        fh.truncate(2 * 1024**3)
    return p


def _mkdir(p: Path) -> Path:
    p.mkdir()
    return p


def _imatrix_inputs(matrix, tmp_path, build) -> tuple[Path, Path]:
    src = tmp_path / "in"
    src.mkdir()
    f = build(matrix, src)
    (src / ".scratch.gguf").unlink(missing_ok=True)
    return src, f


@pytest.mark.parametrize("case, build, needle", IMATRIX_CASES, ids=[c[0] for c in IMATRIX_CASES])
def test_a_hostile_imatrix_is_refused_before_the_model_is_resolved(tiny, matrix, tmp_path, monkeypatch, case, build, needle):
    src, f = _imatrix_inputs(matrix, tmp_path, build)
    tripwire(monkeypatch, "qkit.models.inputs.resolve", "the model was resolved")
    with Unchanged(inputs=[tiny, src], dirs=[tmp_path, src]):
        assert_refused(invoke("quantize", tiny, "-s", "q4_0", "--imatrix", f, "-o", tmp_path / "q"), "--imatrix", needle)
        assert_refused(invoke("plan", tiny, "--imatrix", f, "--format", "gguf", "--target-bits", "6", "-o", tmp_path / "p.json",
                              *PLAN_FAST), "--imatrix", needle)


@pytest.mark.parametrize("case, build, needle", IMATRIX_MODEL_CASES, ids=[c[0] for c in IMATRIX_MODEL_CASES])
def test_an_imatrix_that_does_not_fit_the_model_is_refused_before_work(tiny, matrix, tmp_path, monkeypatch, case, build, needle):
    src, f = _imatrix_inputs(matrix, tmp_path, build)
    tripwire(monkeypatch, "qkit.api.atomic_output", "the output was begun")
    tripwire(monkeypatch, "qkit.api.sensitivity_table", "the sensitivity pass began")
    with Unchanged(inputs=[tiny, src], dirs=[tmp_path, src]):
        assert_refused(invoke("quantize", tiny, "-s", "q4_0", "--imatrix", f, "-o", tmp_path / "q"), "--imatrix", needle)
        assert_refused(invoke("plan", tiny, "--imatrix", f, "--format", "gguf", "--target-bits", "6", "-o", tmp_path / "p.json",
                              *PLAN_FAST), "--imatrix", needle)


def test_a_2gb_legacy_file_is_never_read_whole(tmp_path, monkeypatch):
    from qkit.errors import InputError
    from qkit.methods.imatrix.file import read

    f = _sparse(tmp_path / "big.dat")
    monkeypatch.setattr(Path, "read_bytes", lambda self: (_ for _ in ()).throw(AssertionError("read whole")))
    t0 = time.perf_counter()
    with pytest.raises(InputError, match="entry name of length 0"):
        read(f)
    assert time.perf_counter() - t0 < 5  # a memory map and a few reads; the hash is never reached


def test_a_good_legacy_file_still_quantizes(tiny, matrix, tmp_path):
    f = _bytes(tmp_path / "im.dat", _dat(matrix))
    r = invoke("quantize", tiny, "-s", "q4_0", "--imatrix", f, "-o", tmp_path / "q")
    assert r.code == 0, r.text


# --------------------------------------------------------------------------- 3. report inputs with HTML

PAYLOADS = [
    "<script>alert(1)</script>",
    "\"><img src=x onerror=alert(1)>",
    "</script><script>alert(1)</script>--><!--",
    "$\\foo{$ a$b$ <svg onload=alert(1)>",  # mathtext that does not parse, and an SVG element
]


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))

    handle_startendtag = handle_starttag


def _taint(x, payload: str, key: str | None = None):
    if isinstance(x, dict):
        return {k: _taint(v, payload, k) for k, v in x.items()}
    if isinstance(x, list):
        return [_taint(v, payload, key) for v in x]
    if isinstance(x, str) and key not in ("format", "qkit_version"):
        return payload + x
    return x


def _report_docs():
    pytest.importorskip("matplotlib", reason="qkit report needs the report extra (matplotlib)")
    from helpers_report import make_docs

    return make_docs()


@pytest.mark.parametrize("payload", PAYLOADS, ids=["script", "img-onerror", "close-script-comment", "mathtext-svg"])
def test_every_string_of_every_input_is_escaped_on_the_page(tmp_path, payload):
    docs = {k: _taint(v, payload) for k, v in _report_docs().items()}
    plan = docs["plan"]
    plan["tensors"] = {payload + n: t for n, t in plan["tensors"].items()} | plan["tensors"]  # tensor names are keys
    files = []
    for kind, doc in docs.items():
        files.append(tmp_path / f"{kind}.json")
        files[-1].write_text(json.dumps(doc))
    out = tmp_path / "page.html"
    r = invoke("report", *files, "-o", out, "--run", "none")
    assert r.code == 0, r.text
    page = out.read_text()
    parser = _Tags()
    parser.feed(page)
    names = {t for t, _ in parser.tags}
    assert not names & {"script", "img", "iframe", "object", "embed"}, names
    assert "svg" in names  # the figures are there (and no attribute of any element is an event handler)
    handlers = [(t, a) for t, attrs in parser.tags for a, _ in attrs if a.lower().startswith("on")]
    assert not handlers, handlers[:3]
    assert "</script>" not in page.lower() and "<script" not in page.lower()
    assert "&lt;" in page  # the payload is on the page, as text


REPORT_SHAPES = [  # (kind, change of its document, words)
    ("kv", lambda d: _set(d, "variants", 0, "kv_heads", "x"), "variants[0].kv_heads"),
    ("kv", lambda d: _set(d, "variants", [{}]), "variants[0]"),
    ("kv", lambda d: _set(d, "variants", 0, "bytes_per_token", 1e300), "bytes_per_token"),
    ("kv", lambda d: _set(d, "architecture", "x"), "architecture"),
    ("kv", lambda d: _set(d, "tokens", None), "tokens"),
    ("plan", lambda d: _set(d, "target", "x"), "target"),
    ("plan", lambda d: _set(d, "tensors", T, "shape", "x"), "shape"),
    ("plan", lambda d: _set(d, "totals", "bytes", "x"), "totals.bytes"),
    ("eval", lambda d: _set(d, "rows", 0, "spec", "x"), "rows[0].spec"),
    ("eval", lambda d: _set(d, "notes", "a string"), "notes"),
    ("eval", lambda d: _set(d, "rows", 1, "kld_se", -1), "rows[1].kld_se"),  # a negative error bar
    ("errors", lambda d: _set(d, "matrices", 0, "name", 5), "matrices[0].name"),
    ("errors", lambda d: _set(d, "matrices", 0, "rel_error", 1e300), "matrices[0].rel_error"),  # past a log scale
    ("outliers", lambda d: _set(d, "histogram", 0, "lo", float("nan")), "histogram[0].lo"),
    ("outliers", lambda d: _set(d, "per_layer", 0, "layer", "x"), "per_layer[0].layer"),
    ("outliers", lambda d: _set(d, "int8", "all", "typical", [{}]), "typical[0]"),
    ("sensitivity", lambda d: _set(d, "units", 0, "input_outlier_dims", 5), "input_outlier_dims"),
    ("sensitivity", lambda d: _set(d, "suggestion", "x"), "suggestion"),
    ("budget", lambda d: _set(d, "tables", 0, "rows", 0, "max_tokens", -1), "max_tokens"),
    ("budget", lambda d: _set(d, "models", 0, "architecture", [1]), "architecture"),
]


@pytest.mark.parametrize("kind, change, needle", REPORT_SHAPES, ids=[f"{k}-{n}" for k, _, n in REPORT_SHAPES])
def test_a_report_input_of_the_wrong_shape_is_one_line_and_no_page(tmp_path, monkeypatch, kind, change, needle):
    doc = change(copy.deepcopy(_report_docs()[kind]))
    f = tmp_path / f"{kind}.json"
    f.write_text(json.dumps(doc))
    tripwire(monkeypatch, "qkit.report.build.render", "the page was drawn")
    with Unchanged(inputs=[f], dirs=[tmp_path]):
        assert_refused(invoke("report", f, "-o", tmp_path / "page.html", "--run", "none"), str(f), needle)


@pytest.mark.parametrize("content, needle", [
    (b"{not json", "not a readable JSON"),
    (b"[1, 2, 3]", "not a JSON that qkit"),
    (b"\"<script>\"", "not a JSON that qkit"),
    (b"\xff\xfe{}", "not a readable JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
], ids=["not-json", "list", "string", "utf16", "deep"])
def test_a_report_input_that_is_no_qkit_json_is_one_line(tmp_path, content, needle):
    f = tmp_path / "x.json"
    f.write_bytes(content)
    with Unchanged(inputs=[f], dirs=[tmp_path]):
        assert_refused(invoke("report", f, "-o", tmp_path / "page.html", "--run", "none"), needle)


# --------------------------------------------------------------------------- 4. $QKIT_ENGINE_PYTHON


def _engine_pythons(d: Path) -> dict[str, tuple[str, str]]:
    """name -> (the interpreter, words the llama.cpp line must hold)."""
    d.mkdir()
    noexec = d / "noexec"
    noexec.write_text("#!/bin/sh\necho hi\n")
    garbage = d / "garbage.sh"
    garbage.write_text("#!/bin/sh\necho '{garbage, not json'\n")
    garbage.chmod(0o755)
    bare = d / "python-without-site"  # a real Python that sees no site-packages: no engine installed
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    false, echo = d / "false", d / "echo"  # what /bin/false and /bin/echo do, on any machine
    false.write_text("#!/bin/sh\nexit 1\n")
    echo.write_text('#!/bin/sh\necho "$@"\n')
    false.chmod(0o755)
    echo.chmod(0o755)
    return {"missing": (str(d / "no" / "python"), "does not exist"), "directory": (str(d), "directory"),
            "not-executable": (str(noexec), "not executable"), "false": (str(false), "not a python"),
            "echo": (str(echo), "not a python"), "garbage": (str(garbage), "not a python"),
            "no-engine": (str(bare), "lacks")}


@pytest.mark.parametrize("runtime", ["llama.cpp", "vllm"])
@pytest.mark.parametrize("which", ["missing", "directory", "not-executable", "false", "echo", "garbage", "no-engine"])
def test_an_engine_python_that_is_not_one_is_refused_before_the_model(tiny, tmp_path, monkeypatch, runtime, which):
    exe, needle = _engine_pythons(tmp_path / "py")[which]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    tripwire(monkeypatch, "qkit.evaluation.runner.resolve", "the model was resolved")
    with Unchanged(inputs=[tiny, tmp_path / "py"], dirs=[tmp_path, scratch]):
        line = assert_refused(invoke("eval", tiny, "--schemes", "q8_0", "--runtime", runtime, "--tokens", "64",
                                     "--agree-tokens", "1", env={"QKIT_ENGINE_PYTHON": exe}), "QKIT_ENGINE_PYTHON")
    if runtime == "llama.cpp":
        assert needle in line.lower(), line


# --------------------------------------------------------------------------- 5. Ctrl-C and SIGKILL: plan, imatrix

_HOOK = '''
import contextlib, os, time
from pathlib import Path
if os.environ.get("QKIT_TEST_HOOK"):
    from qkit import console, staging
    mark, mode = Path(os.environ["QKIT_TEST_MARK"]), os.environ["QKIT_TEST_HOOK"]
    if mode == "work":  # every step of the work (a Fisher window, an imatrix chunk) slowed down; the first marks it
        real_advance = console.ProgressHandle.advance
        def advance(self, *a, **k):
            mark.touch()
            time.sleep(0.5)
            return real_advance(self, *a, **k)
        console.ProgressHandle.advance = advance
    if mode == "write":  # stop inside the staged write of the output, its sibling half written
        real_staged = staging.staged
        @contextlib.contextmanager
        def staged(out, **kw):
            with real_staged(out, **kw) as tmp:
                if Path(out).name == os.environ["QKIT_TEST_TARGET"]:
                    if not kw.get("directory", True):
                        Path(tmp).write_bytes(b"half a file")
                    mark.touch()
                    time.sleep(120)
                yield tmp
        staging.staged = staged
'''


def _signalled(args: list, sig: int, mode: str, tmp: Path, target: str = "") -> tuple[int, int, str]:
    """Run ``python -m qkit ARGS`` with the hook in ``mode``; send ``sig`` once it marks; return (pid, exit code,
    stdout + stderr)."""
    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOOK)
    mark = tmp / "mark"
    mark.unlink(missing_ok=True)
    scratch = tmp / "tmpdir"
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "QKIT_TEST_HOOK": mode, "QKIT_TEST_MARK": str(mark), "QKIT_TEST_TARGET": target, "TMPDIR": str(scratch)}
    proc = subprocess.Popen([sys.executable, "-m", "qkit", *map(str, args)], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"ended before the signal: {proc.communicate()}"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc.pid, proc.returncode, out + err


def _qkit_leftovers(*dirs: Path) -> list[str]:
    """qkit's staging siblings and scratch directories in ``dirs`` (torch's own caches are not qkit's)."""
    return sorted(p for p in listing(*dirs) if TMP_MARK in p or Path(p).name.startswith("qkit-"))


def _commands(tiny: Path, out: Path) -> dict[str, tuple[list, str]]:
    """command -> (its arguments writing into ``out``, the -o file's name)."""
    return {
        "plan": (["plan", tiny, "-o", out / "p.json", "--json", out / "p.run.json", "--format", "gguf",
                  "--target-bits", "6", "--calibration-samples", "4", "--calibration-seqlen", "32", "--check-windows", "1",
                  "--candidates", "q4_0,q8_0,none"], "p.json"),  # few candidates: the signals, not the search, are tested
        "imatrix": (["imatrix", tiny, "-o", out / "i.gguf", "--json", out / "i.run.json", "--chunk-size", "32", "--chunks", "4"],
                    "i.gguf"),
    }


@pytest.mark.parametrize("command", ["plan", "imatrix"])
def test_ctrl_c_while_working_is_one_line_exit_130_and_writes_nothing(tiny, tmp_path, command):
    out = tmp_path / "out"
    out.mkdir()
    args, _ = _commands(tiny, out)[command]
    with Unchanged(inputs=[tiny]):
        _, code, text = _signalled(args, signal.SIGINT, "work", tmp_path)
    assert code == 130, text
    assert [ln for ln in text.splitlines() if ln.strip()] == ["error: interrupted; nothing was written"], text
    assert list(out.iterdir()) == []  # neither -o nor --json, nor a sibling
    assert _qkit_leftovers(tmp_path / "tmpdir") == []


def test_ctrl_c_while_the_plan_is_written_leaves_the_old_one_untouched(tiny, plan_doc, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args, name = _commands(tiny, out)["plan"]
    (out / name).write_text(json.dumps(plan_doc))  # a plan qkit wrote: --force may replace it
    before = (out / name).read_bytes()
    _, code, text = _signalled([*args, "--force"], signal.SIGINT, "write", tmp_path, target=name)
    assert code == 130, text
    assert [ln for ln in text.splitlines() if ln.strip()] == ["error: interrupted; nothing was written"], text
    assert (out / name).read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == [name]  # the half-written sibling was removed


@pytest.mark.parametrize("command", ["plan", "imatrix"])
def test_after_sigkill_the_next_run_removes_what_was_left_and_succeeds(tiny, tmp_path, monkeypatch, command):
    out = tmp_path / "out"
    out.mkdir()
    args, name = _commands(tiny, out)[command]
    # killed while working: nothing at all is left
    _, code, _ = _signalled(args, signal.SIGKILL, "work", tmp_path)
    # (its claims on the outputs, qkit.claims, stay until the next run finds their holder gone)
    unclaimed = [p for p in out.iterdir() if not p.name.endswith(claims.MARK)]
    assert code == -signal.SIGKILL and unclaimed == [] and _qkit_leftovers(tmp_path / "tmpdir") == []
    # killed while writing: the half-written sibling stays, named with the dead PID
    pid, code, _ = _signalled(args, signal.SIGKILL, "write", tmp_path, target=name)
    assert code == -signal.SIGKILL
    (left,) = _qkit_leftovers(out)
    assert Path(left).name.startswith(f".{name}{TMP_MARK}{pid}-") and not (out / name).exists()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmpdir"))
    again = invoke(*args)
    assert again.code == 0, again.text
    assert (out / name).is_file() and _qkit_leftovers(out, tmp_path / "tmpdir") == []
    assert sorted(p.name for p in out.iterdir()) == sorted([name, Path(args[args.index("--json") + 1]).name])
