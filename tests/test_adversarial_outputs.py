"""Adversarial outputs: nothing read is ever written over, nothing half-written is left, nothing replaced
without --force, and --force replaces only what qkit wrote (issue 18, defects 2, 5, 6, 7, 9).

Every refusal: exit 2, one ``error:`` line, no traceback, nothing added to or removed from the places an
output could land, every input's sha256 unchanged. The source-destruction cases come first. Faults (a
read-only or full file system) need a tmpfs mount (root); without one they are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from adversarial import Unchanged, assert_refused, invoke, spawn, tripwire
from conftest import make_tiny_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkit import outputs, staging
from qkit.errors import OutputError, OutputExistsError

NEVER = "never writes over what it reads"  # the refusal of an output that is, holds or lies in an input


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A tiny model only this module reads, in a directory of its own with an unrelated neighbour."""
    root = tmp_path_factory.mktemp("inputs")
    model = root / "src"
    make_tiny_llama(model)
    (root / "neighbour.txt").write_text("not qkit's")
    return model


@pytest.fixture(scope="module")
def src_gguf(src, tmp_path_factory) -> Path:
    """A GGUF file of the tiny model (written by qkit, so it carries the qkit.export record)."""
    from qkit.api import quantize_model

    out = tmp_path_factory.mktemp("gguf") / "src.gguf"
    quantize_model(src, output=out, scheme="q8_0", format="gguf")
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """qkit's cache in this test's directory: nothing here converts into the user's real cache."""
    path = tmp_path / "cache"
    monkeypatch.setenv("QKIT_CACHE", str(path))
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the model is resolved: every output refusal comes before any work."""
    tripwire(monkeypatch, "qkit.models.inputs.resolve", "the model was resolved")


# --------------------------------------------------------------------------- the source is never destroyed

FORMATS = {
    "qkit": ["-s", "int8-row"],
    "compressed-tensors": ["-s", "int8-row", "--format", "compressed-tensors"],
    "bitsandbytes": ["-s", "nf4", "--format", "bitsandbytes"],
    "gguf": ["-s", "q8_0", "--format", "gguf"],
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("where", ["is", "parent", "inside", "symlink", "dotdot", "relative", "config.json"])
def test_an_output_on_the_source_is_refused_even_with_force(src, tmp_path, monkeypatch, no_work, fmt, where):
    root = src.parent
    link = tmp_path / "link"
    link.symlink_to(src)
    monkeypatch.chdir(tmp_path)
    target = {
        "is": src,
        "parent": root,  # would delete the source and its neighbour
        "inside": src / "sub" / "out",
        "symlink": link,
        "dotdot": src / "sub" / ".." / ".." / src.name,
        "relative": Path(os.path.relpath(src, tmp_path)),
        "config.json": src / "config.json",
    }[where]
    with Unchanged(inputs=[root], dirs=[root, src, tmp_path]):
        line = assert_refused(invoke("quantize", src, "-o", target, "--force", *FORMATS[fmt]), NEVER)
    assert "--force" not in line  # never suggests the flag that would not help


def test_a_gguf_source_is_never_overwritten(src_gguf, tmp_path, cache, no_work):
    link = tmp_path / "link.gguf"
    link.symlink_to(src_gguf)
    hard = tmp_path / "hard.gguf"
    os.link(src_gguf, hard)
    for model, out in [(src_gguf, src_gguf), (link, src_gguf), (src_gguf, link), (hard, src_gguf), (src_gguf, hard)]:
        with Unchanged(inputs=[src_gguf.parent], dirs=[src_gguf.parent, tmp_path]):
            assert_refused(invoke("quantize", model, "--format", "gguf", "-s", "q8_0", "-o", out, "--force"), NEVER)


def test_the_resolved_model_directory_counts_as_an_input(src, tmp_path, monkeypatch):
    """The library checks -o again once the model is resolved (a hub snapshot, a ``ref`` given): the
    resolved directory is an input even when the arguments did not name it."""
    from qkit import api
    from qkit.api import QuantizeOptions
    from qkit.models import resolve

    ref = resolve(src)
    monkeypatch.setattr(api, "prepare_export", _tripwire)
    with Unchanged(inputs=[src], dirs=[src]), pytest.raises(OutputError, match=NEVER):
        api.quantize_model(ref, output=src / "out", scheme="q8_0", format="gguf", options=QuantizeOptions(force=True))


PLAN_ARGS = ["--format", "gguf", "--target-bits", "6", "--calibration-samples", "2", "--calibration-seqlen", "32",
             "--check-windows", "1"]


@pytest.mark.parametrize("via", ["symlink", "dotdot"])
@pytest.mark.parametrize("which", ["-o", "--emit-tensor-types"])
def test_a_plan_inside_the_model_given_by_another_path_is_refused(src, tmp_path, monkeypatch, no_work, via, which):
    """``qkit plan`` of a model named through a symlink or ``..``, writing its plan (or tensor-type file) into
    the directory that path resolves to: one line, exit 2, before the model is resolved, nothing written."""
    (tmp_path / "link").symlink_to(src)
    (tmp_path / "sub").mkdir()
    model = {"symlink": tmp_path / "link", "dotdot": tmp_path / "sub" / ".." / "link"}[via]
    paths = {"-o": tmp_path / "p.json", "--emit-tensor-types": tmp_path / "tt.txt"}
    paths[which] = src / ("p.json" if which == "-o" else "tt.txt")
    with Unchanged(inputs=[src], dirs=[src, tmp_path]):
        line = assert_refused(invoke("plan", model, *PLAN_ARGS, "-o", paths["-o"], "--emit-tensor-types",
                                     paths["--emit-tensor-types"], "--force"), NEVER, "the model")
    assert line == (f"error: {which} {paths[which]} lies inside the model {model}; qkit never writes over what it reads, "
                    "whatever the flags: choose a path outside it")


@pytest.mark.parametrize("which", ["output", "emit_tensor_types"])
def test_plan_model_checks_its_outputs_against_the_resolved_model(src, tmp_path, monkeypatch, which):
    """``plan_model`` given a ``ModelRef`` (resolved from a path through a symlink and ``..``: the arguments name
    no directory) refuses an output inside the resolved directory once it is known, before any work."""
    from qkit import api
    from qkit.models import resolve
    from qkit.plan import PlanOptions

    (tmp_path / "link").symlink_to(src)
    (tmp_path / "sub").mkdir()
    ref = resolve(tmp_path / "sub" / ".." / "link")
    monkeypatch.setattr(api, "precheck", _tripwire)  # the first step of the plan's work
    monkeypatch.setattr(api, "sensitivity_table", _tripwire)
    paths = {"output": tmp_path / "p.json", "emit_tensor_types": tmp_path / "tt.txt"}
    paths[which] = src / "sub" / f"{which}.out"
    options = PlanOptions(format="gguf", target_bits=6.0, samples=2, seqlen=32, check_windows=1, force=True,
                          emit_tensor_types=paths["emit_tensor_types"])
    with Unchanged(inputs=[src], dirs=[src, tmp_path]), pytest.raises(OutputError) as err:
        api.plan_model(ref, options=options, output=paths["output"])
    option = {"output": "-o", "emit_tensor_types": "--emit-tensor-types"}[which]
    assert str(err.value) == (f"{option} {paths[which]} lies inside the model {ref.directory}; qkit never writes over "
                              "what it reads, whatever the flags: choose a path outside it")


def test_the_cache_of_converted_models_is_an_input(src_gguf, cache, no_work):
    (cache / "models" / "gguf-0123").mkdir(parents=True)
    with Unchanged(inputs=[cache], dirs=[cache / "models"]):
        assert_refused(invoke("quantize", src_gguf, *FORMATS["gguf"], "-o", cache / "models" / "gguf-0123", "--force"),
                       NEVER, "cache")
        assert_refused(invoke("quantize", *FORMATS["qkit"], "-o", cache, "--force"), NEVER, "cache")  # the default model


def test_the_calibration_file_is_an_input(src, tmp_path, no_work):
    cal = tmp_path / "cal.txt"
    cal.write_text("words " * 200)
    with Unchanged(inputs=[cal, src], dirs=[tmp_path]):
        assert_refused(invoke("quantize", src, "-s", "int8-row", "--method", "gptq", "--calibration", cal,
                              "-o", cal, "--force"), NEVER, "calibration")


def test_an_output_on_a_bind_mount_of_the_source_is_refused(src, tmp_path, no_work):
    view = tmp_path / "view"
    view.mkdir()
    with mounted(view, "--bind", src):
        with Unchanged(inputs=[src], dirs=[src, tmp_path]):
            assert_refused(invoke("quantize", src, "-s", "int8-row", "-o", view / "out"), NEVER)


# --------------------------------------------------------------------------- --force replaces only qkit's own


def test_force_never_replaces_what_qkit_did_not_write(src, tmp_path, no_work):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("mine")
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"GGUF" + b"\0" * 60)  # a GGUF header without qkit's record
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (plain, FORMATS["qkit"], "not something qkit wrote"),
        (plain, FORMATS["gguf"], "not something qkit wrote"),
        (foreign, FORMATS["gguf"], "not something qkit wrote"),
        (afile, FORMATS["qkit"], "not a directory"),
        (afile, FORMATS["compressed-tensors"], "not a directory"),
    ]
    for out, args, needle in cases:
        with Unchanged(inputs=[plain, foreign, afile, src], dirs=[tmp_path]):
            line = assert_refused(invoke("quantize", src, "-o", out, "--force", *args), needle)
        assert "--force" not in line


def test_force_replaces_a_qkit_gguf_and_an_empty_directory(src, tmp_path):
    out = tmp_path / "x.gguf"
    assert invoke("quantize", src, "-o", out, *FORMATS["gguf"]).code == 0
    line = assert_refused(invoke("quantize", src, "-o", out, *FORMATS["gguf"]), "already exists", "--force")
    assert "pass --force" in line
    assert invoke("quantize", src, "-o", out, "--force", *FORMATS["gguf"]).code == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert invoke("quantize", src, "-o", empty, "--force", *FORMATS["qkit"]).code == 0
    assert (empty / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "x.gguf"]


def test_directory_markers_match_the_writers():
    from qkit.export.common import EXPORT_MANIFEST
    from qkit.export.gguf import SOURCE_FILE

    assert outputs.EXPORT_MANIFEST == EXPORT_MANIFEST and outputs.SOURCE_FILE == SOURCE_FILE


# --------------------------------------------------------------------------- unwritable -o: one line, before work


@pytest.mark.parametrize("fmt", ["qkit", "gguf"])
def test_unwritable_outputs_are_refused_before_any_work(src, tmp_path, no_work, fmt):
    afile = tmp_path / "afile"
    afile.write_text("x")
    suffix = ".gguf" if fmt == "gguf" else ""
    cases = [
        ("", "empty"),
        (f"/proc/qkit-x{suffix}", "cannot write"),
        (f"{afile}/sub{suffix}", "is a file"),
        (f"{afile}/deeper/sub{suffix}", "is a file"),
    ]
    for out, needle in cases:
        with Unchanged(inputs=[src, afile], dirs=[tmp_path]):
            assert_refused(invoke("quantize", src, "-o", out, *FORMATS[fmt]), needle)


def test_read_only_and_full_file_systems_are_refused_before_any_work(src, tmp_path, no_work):
    ro, full = tmp_path / "ro", tmp_path / "full"
    with mounted(ro, "-t", "tmpfs", "-o", "size=64k", "tmpfs", read_only=True), mounted(full, "-t", "tmpfs", "-o", "size=16k", "tmpfs"):
        (full / "fill").write_bytes(b"\0" * 16384)
        for out, needle in [(ro / "out", "read-only file system"), (ro / "a" / "b" / "out", "read-only file system"),
                            (full / "deep" / "out", "no space left on device")]:
            with Unchanged(inputs=[src], dirs=[tmp_path, ro, full]):
                # gptq would calibrate for minutes before the write; the refusal comes first
                assert_refused(invoke("quantize", src, "-s", "int8-row", "--method", "gptq", "-o", out), needle, str(out))


def test_read_only_output_through_the_real_entry_point(src, tmp_path):
    ro = tmp_path / "ro"
    with mounted(ro, "-t", "tmpfs", "-o", "size=64k", "tmpfs", read_only=True):
        with Unchanged(inputs=[src], dirs=[tmp_path, ro]):
            assert_refused(spawn("quantize", src, "-s", "int8-row", "--method", "gptq", "-o", ro / "out", timeout=120),
                           "read-only file system")


def test_no_space_in_the_middle_of_the_shards_leaves_nothing(src, tmp_path):
    """The probe passes (the disk has a few kB), the shards do not fit: one line naming the path and the
    cause, the staging sibling and the parents created for it removed."""
    small = tmp_path / "small"
    with mounted(small, "-t", "tmpfs", "-o", "size=100k", "tmpfs"):
        for args in (["-s", "int8-row", "--max-shard-size", "20kB"], FORMATS["gguf"]):
            out = small / "deep" / ("out.gguf" if "gguf" in args else "out")
            with Unchanged(inputs=[src], dirs=[small]):
                assert_refused(spawn("quantize", src, "-o", out, *args, timeout=120), "no space left", str(out))
            assert not any(small.iterdir())


# --------------------------------------------------------------------------- --json of every command


def _commands(src: Path, lengths: Path, eval_json: Path, out: Path) -> dict[str, tuple[list, Path]]:
    """argv (without --json) and the input a --json could land in, per command."""
    m = str(src)
    return {
        "quantize": (["quantize", m, "-o", str(out), "-s", "int8-row"], src),
        "eval": (["eval", m, "--schemes", "int8-row", "--tokens", "64"], src),
        "verify": (["verify", m], src),
        "inspect errors": (["inspect", "errors", m], src),
        "inspect matrix": (["inspect", "matrix", m], src),
        "inspect outliers": (["inspect", "outliers", m], src),
        "inspect sensitivity": (["inspect", "sensitivity", m, "-s", "int8-row"], src),
        "inspect next-token": (["inspect", "next-token", m, "hello"], src),
        "kv": (["kv", m], src),
        "budget": (["budget", m], src),
        "bench": (["bench", m, "--quick"], src),
        "speculate": (["speculate", "--from", str(eval_json)], eval_json),
        "simulate batching": (["simulate", "batching", "--lengths", str(lengths)], lengths),
    }


@pytest.fixture(scope="module")
def side_inputs(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("side")
    lengths = d / "lengths.txt"
    lengths.write_text("\n".join(str(i % 50 + 1) for i in range(40)) + "\n")
    eval_json = d / "eval.json"
    eval_json.write_text(json.dumps({"rows": []}))
    return lengths, eval_json


COMMANDS = list(_commands(Path("/m"), Path("/l"), Path("/e"), Path("/o")))
BAD_JSON = ["in-input", "existing", "existing-not-json-forced", "directory", "under-a-file", "empty", "proc"]


@pytest.mark.parametrize("bad", BAD_JSON)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_json_target_is_refused_before_any_work(src, side_inputs, tmp_path, cache, monkeypatch, command, bad):
    argv, holder = _commands(src, *side_inputs, tmp_path / "q-out")[command]
    monkeypatch.setattr("qkit.models.resolve", _tripwire)
    monkeypatch.setattr("qkit.models.inputs.resolve", _tripwire)
    old = tmp_path / "old.json"
    old.write_text('{"kept": true}\n')
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\x00\x01 not json")
    target, extra, needle = {
        "in-input": ((holder / "config.json") if holder.is_dir() else holder, ["--force"], NEVER),
        "existing": (old, [], "pass --force"),
        "existing-not-json-forced": (blob, ["--force"], "not something qkit wrote"),
        "directory": (tmp_path, ["--force"], "is a directory"),
        "under-a-file": (blob / "r.json", [], "is a file"),
        "empty": ("", [], "empty"),
        "proc": ("/proc/qkit-r.json", [], "cannot write"),
    }[bad]
    inputs = [src.parent, *side_inputs, old, blob]
    with Unchanged(inputs=inputs, dirs=[tmp_path, src]):
        line = assert_refused(invoke(*argv, "--json", target, *extra), needle)
    if bad != "existing":
        assert "--force" not in line  # suggested only where it would work


def _tripwire(*_a, **_k):
    raise AssertionError("the model was resolved before the --json target was refused")


def test_json_full_and_read_only_are_refused_up_front(tmp_path):
    ro, full = tmp_path / "ro", tmp_path / "full"
    with mounted(ro, "-t", "tmpfs", "-o", "size=64k", "tmpfs", read_only=True), mounted(full, "-t", "tmpfs", "-o", "size=16k", "tmpfs"):
        (full / "fill").write_bytes(b"\0" * 16384)
        for target, needle in [(ro / "r.json", "read-only"), (full / "r.json", "no space left")]:
            with Unchanged(dirs=[ro, full]):
                assert_refused(invoke("simulate", "batching", "--json", target), needle)


def test_json_that_fills_the_disk_midway_leaves_no_temporary_file(tmp_path):
    """The probe fits (one page), the 78 kB report does not: one line, no ``.r.json.qkit-tmp-*`` left."""
    small = tmp_path / "small"
    with mounted(small, "-t", "tmpfs", "-o", "size=16k", "tmpfs"):
        with Unchanged(dirs=[small]):
            out = spawn("simulate", "batching", "--requests", "2000", "--json", small / "r.json", timeout=120)
        lines = out.lines
        assert out.code == 2 and lines[-1].startswith("error: ") and "no space left" in lines[-1], out.text
        assert str(small / "r.json") in lines[-1] and "Traceback" not in out.text
        assert not any(small.iterdir())


def test_a_failed_json_write_removes_its_temporary_file(tmp_path, monkeypatch):
    import errno

    real = os.replace

    def full(src, dst):
        if ".qkit-tmp-" in str(src):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", full)
    with Unchanged(dirs=[tmp_path]):
        out = invoke("simulate", "batching", "--json", tmp_path / "deep" / "r.json")
    assert out.code == 2 and out.lines[-1].startswith("error: ") and "no space left" in out.lines[-1], out.text
    assert not (tmp_path / "deep").exists()  # the parent it created is gone too


def test_json_force_replaces_a_json_file_and_a_killed_writers_file_is_cleaned(tmp_path, dead_pid):
    target = tmp_path / "r.json"
    target.write_text('{"old": true}\n')
    stale = tmp_path / f".r.json{staging.TMP_MARK}{dead_pid}-0123abcd"  # what a SIGKILLed write leaves
    stale.write_text('{"half')
    live = tmp_path / f".r.json{staging.TMP_MARK}{os.getpid()}-89abcdef"  # a live writer's: kept
    live.write_text("{")
    out = invoke("simulate", "batching", "--json", target, "--force")
    assert out.code == 0, out.text
    assert "requests" in json.loads(target.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["r.json", live.name])


def test_json_and_output_cannot_be_the_same_path(src, tmp_path, no_work):
    with Unchanged(inputs=[src], dirs=[tmp_path]):
        assert_refused(invoke("quantize", src, "-s", "int8-row", "-o", tmp_path / "o", "--json", tmp_path / "o"), "--json")
        assert_refused(invoke("quantize", src, "-s", "int8-row", "-o", tmp_path / "o" / "x", "--json", tmp_path / "o"),
                       "contains")


# --------------------------------------------------------------------------- the check itself, as a property

_SPELLINGS_IN = ["abs", "rel", "link", "dotdot", "dot"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    (root / "src" / "sub").mkdir(parents=True)
    (root / "src" / "config.json").write_text("{}")
    (root / "other").mkdir()
    (root / "link").symlink_to(root / "src")
    return root


def _spell(root: Path, name: str, how: str) -> str:
    """Ways to write ``root/name``: absolute, relative to the cwd, through a symlink (src only), via ``..``."""
    target = root / name
    return {
        "abs": str(target),
        "rel": os.path.relpath(target),
        "link": str(root / "link") if name == "src" else str(target),
        "dotdot": str(root / "other" / ".." / name),
        "dot": str(root / "." / name / "."),
    }[how]


TAIL = st.lists(st.sampled_from(["sub", "new", "x.json", ".", "config.json", "deep"]), max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(how=st.sampled_from(_SPELLINGS_IN), in_how=st.sampled_from(_SPELLINGS_IN), tail=TAIL,
       kind=st.sampled_from(["dir", "json", "file"]), force=st.booleans())
def test_property_output_inside_an_input_is_always_refused(tree, how, in_how, tail, kind, force):
    out = os.path.join(_spell(tree, "src", how), *tail)
    model = _spell(tree, "src", in_how)
    with pytest.raises(OutputError, match=NEVER):
        outputs.check_output_path(out, kind=kind, force=force, inputs=[("the model", model)])
    # the input's parent and the root contain it: refused as well
    for holder in (str(tree), os.path.relpath(tree)):
        with pytest.raises(OutputError, match="contains"):
            outputs.check_output_path(holder, kind="dir", force=True, inputs=[("the model", model)])


@settings(max_examples=100, deadline=None)
@given(how=st.sampled_from(["abs", "rel", "dotdot", "dot"]), in_how=st.sampled_from(_SPELLINGS_IN), tail=TAIL)
def test_property_output_beside_an_input_is_not_an_overlap(tree, how, in_how, tail):
    out = os.path.join(_spell(tree, "other", how), *tail)
    assert outputs.overlap(out, [("the model", _spell(tree, "src", in_how))]) is None


def test_check_output_creates_nothing_and_refuses_existing_outputs(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    assert outputs.check_output_path(out, kind="dir") == out
    assert list(tmp_path.iterdir()) == []  # neither parents nor the probe
    (tmp_path / "r.json").write_text("[1]")
    with pytest.raises(OutputExistsError, match="pass --force"):
        outputs.check_output_path(tmp_path / "r.json", kind="json", what="--json")
    outputs.check_output_path(tmp_path / "r.json", kind="json", what="--json", force=True)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputExistsError, match="symbolic link"):
        outputs.check_output_path(tmp_path / "dangling", kind="json", force=True)


# --------------------------------------------------------------------------- mounts


@contextlib.contextmanager
def mounted(where: Path, *args, read_only: bool = False):
    """``mount ARGS WHERE`` for the block (a tmpfs, or ``--bind SRC``), unmounted after; skips the test
    where this machine does not let the test mount (not root, no mount namespace)."""
    where.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs or bind mount needs root and mount(8)")
    done = subprocess.run(["mount", *map(str, args), str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()[:120]}")
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True)
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)
