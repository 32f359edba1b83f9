"""A write killed with SIGKILL leaves only its hidden temporary sibling and its claim; the next quantize removes both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from typer.testing import CliRunner

from qkit import claims
from qkit.checkpoint import atomic_directory
from qkit.staging import TMP_MARK, remove_stale_siblings, stale_siblings
from qkit.cli import app


def test_only_dead_writers_siblings_are_stale(tmp_path, dead_pid):
    gone = dead_pid
    stale = tmp_path / f".out{TMP_MARK}{gone}-0123abcd"
    stale_old = tmp_path / f".other.qkit-old-{gone}-89abcdef"  # any NAME in the same parent counts
    live = tmp_path / f".out{TMP_MARK}{os.getpid()}-0123abcd"  # this process: alive
    legacy = tmp_path / ".out.qkit-tmp-0123abcd"  # no PID in the name: cannot tell, kept
    unrelated = tmp_path / f".out.tmp-{gone}-0123abcd"
    for d in (stale, stale_old, live, legacy, unrelated):
        d.mkdir()
        (d / "model-00001.safetensors.part").write_bytes(b"x" * 10)
    assert stale_siblings(tmp_path / "out") == sorted([stale, stale_old])
    assert remove_stale_siblings(tmp_path / "out") == sorted([stale, stale_old])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, legacy, unrelated))


def test_atomic_directory_names_its_sibling_with_its_pid_and_cleans_first(tmp_path, dead_pid):
    gone = dead_pid
    (tmp_path / f".out{TMP_MARK}{gone}-0123abcd").mkdir()
    seen = []
    with atomic_directory(tmp_path / "out", on_stale=seen.append) as tmp:
        assert tmp.name.startswith(f".out{TMP_MARK}{os.getpid()}-")
        assert seen == [[tmp_path / f".out{TMP_MARK}{gone}-0123abcd"]]
        (tmp / "f").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


WRITER = textwrap.dedent(
    """
    import sys, time
    from qkit.api import QuantizeOptions, quantize_model

    done = []

    def slow(name):  # after the third tensor: say so, then stall mid-write until killed
        done.append(name)
        if len(done) == 3:
            print("writing", flush=True)
            time.sleep(120)

    # max_shard_bytes=1: every tensor is flushed to its own shard file, so files are on disk when killed
    quantize_model(sys.argv[1], output=sys.argv[2], scheme="int8-row", options=QuantizeOptions(max_shard_bytes=1),
                   progress=lambda step: step.done and slow(step.name))
    """
)


def test_sigkill_mid_write_leaves_only_the_sibling_and_its_claim_and_the_next_run_removes_them(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tiny_model_dir), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "writing", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    # the claim on -o (qkit.claims) cannot be released by a killed run: the next run removes it, its holder gone
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(claims.MARK)) == [".out" + claims.MARK]
    left = sorted(p for p in tmp_path.iterdir() if not p.name.endswith(claims.MARK))
    assert [p.name for p in left] == [p.name for p in left if p.name.startswith(f".out{TMP_MARK}{proc.pid}-")]
    assert len(left) == 1 and not out.exists()
    assert list(left[0].glob("*.safetensors.part"))  # it died mid-write, with shards on disk

    result = CliRunner().invoke(app, ["quantize", str(tiny_model_dir), "-o", str(out), "--scheme", "int8-row"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if "temporary director" in line]
    assert len(notes) == 1 and str(left[0]) in notes[0] and "writer process is gone" in notes[0], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_a_live_writers_sibling_is_kept(tiny_model_dir, tmp_path):
    # A concurrent run into the same parent (this process stands in for it) keeps its directory.
    live = tmp_path / f".other{TMP_MARK}{os.getpid()}-0123abcd"
    live.mkdir()
    result = CliRunner().invoke(app, ["quantize", str(tiny_model_dir), "-o", str(tmp_path / "out"), "--scheme", "int8-row"])
    assert result.exit_code == 0, result.output
    assert "temporary director" not in result.stderr
    assert live.is_dir()
