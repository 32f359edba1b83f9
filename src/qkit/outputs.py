"""Where qkit may write: the one check every output goes through, and the hidden sibling it is staged in.

Every writer (``quantize -o`` in every format, every ``--json``) calls ``check_output_path`` before any work.
It refuses, in this order:

1. an output that **is, contains or lies inside an input** (the model as given and as resolved, a
   reference, a calibration or corpus file, a config), whatever the flags, ``--force`` included. Paths
   are compared by device and inode along every existing ancestor, so symlinks, ``..``, relative paths,
   hard links, bind mounts and a case-insensitive file system's other spellings are all seen through;
2. an empty path, a path under a file, an existing output of the wrong kind (a file for a directory
   output; a directory for a file output);
3. an existing output without ``force``; and, with ``force``, one that qkit did not write (``owned``:
   a qkit checkpoint or export directory, an empty directory, a GGUF carrying qkit's record, a JSON
   file): a refusal suggests ``--force`` only where it would work;
4. a place qkit cannot write (read-only or full file system, no permission, a pseudo file system such
   as ``/proc``, a name too long): a probe file is created, written one byte (a full file system refuses
   the first block) and removed where the output's staging sibling will be created. Nothing is created
   on a refusal: no parent directory, no probe left behind.

Before that, ``check_apart`` refuses two outputs of one command that are one path or one inside the other
(``plan -o p.json --json p.json``); after it, ``claim_output`` claims the output for this run
(``qkit.claims``), so that a second qkit process writing it refuses in one line while the first runs. An
existing output that is not a regular file (a FIFO, a device, a socket) is refused without being opened:
the ``owned`` checks below read it, and a FIFO would block them.

The staging of a write (the hidden sibling, its cleanup, what this process published, scratch
directories) is ``qkit.staging``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Union

from qkit import assets, claims, jsonfields, pinned_models, reading
from qkit.errors import OutputError, OutputExistsError, QkitError
from qkit.staging import _WRITE_ERRORS, TMP_MARK, sibling_name

PathLike = Union[str, "os.PathLike[str]"]
Input = tuple[str, Union[PathLike, None]]  # (what it is, e.g. "the model"; its path, or None: not given)

# Files that mark a directory as qkit's own: qkit.export.common.EXPORT_MANIFEST (every export) and
# qkit.export.gguf.SOURCE_FILE (a GGUF converted into the cache); a qkit checkpoint is recognised by its
# config.json (quantization_config.quant_method == "qkit"). Tests check these names against the modules.
EXPORT_MANIFEST = "qkit-export.json"
SOURCE_FILE = "qkit-source.json"
# A --json target is replaced only if it is JSON: read at most this much to decide (qkit's reports are
# far smaller; a larger file is not one of them).
_MAX_JSON_BYTES = 64 * 1024**2



# --------------------------------------------------------------------------- paths


def _real(path: PathLike, expand: bool) -> Path:
    """Absolute, ``..`` and symlinks resolved as far as the path exists (``os.path.realpath``)."""
    p = os.path.expanduser(os.fspath(path)) if expand else os.fspath(path)
    return Path(os.path.realpath(os.path.abspath(p)))


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def _chain(path: Path) -> list[tuple[Path, os.stat_result]]:
    """``path`` and its ancestors that exist, each with its ``stat`` (nearest first)."""
    out = []
    for p in (path, *path.parents):
        st = _stat(p)
        if st is not None:
            out.append((p, st))
    return out


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def overlap(out: PathLike, inputs: Iterable[Input]) -> tuple[str, str, Path] | None:
    """The first input that ``out`` is, lies inside or contains: ``(relation, label, input path)``, else None.

    ``relation`` is ``"is"``, ``"lies inside"`` or ``"contains"``. Inputs that do not exist (a hub id, an
    option not given) cannot be harmed and are skipped. Comparison is by (device, inode) of ``out``'s
    existing ancestors against the input, and of the input's ancestors against ``out``.
    """
    out_real = _real(out, expand=False)
    out_chain = _chain(out_real)
    out_st = out_chain[0][1] if out_chain and out_chain[0][0] == out_real else None
    for label, raw in inputs:
        if raw is None or os.fspath(raw) == "":
            continue
        in_real = _real(raw, expand=True)
        in_st = _stat(in_real)
        if in_st is None:
            continue
        for p, st in out_chain:  # the input is out, or one of out's ancestors
            if _same(st, in_st):
                return ("is" if p == out_real else "lies inside"), label, Path(os.fspath(raw))
        if out_st is not None and os.path.isdir(out_real):  # out is one of the input's ancestors
            if any(_same(st, out_st) for _, st in _chain(in_real.parent)):
                return "contains", label, Path(os.fspath(raw))
    return None


def directory_inputs(label: str, directory: PathLike | None) -> list[Input]:
    """A model directory and, one level down, the targets of its symlinked entries (a hub snapshot's
    files point into its blob store; a hand-made directory may link weights kept elsewhere)."""
    if directory is None:
        return []
    found: list[Input] = [(label, directory)]
    try:
        entries = list(os.scandir(os.path.expanduser(os.fspath(directory))))
    except OSError:
        return found
    for e in entries:
        if e.is_symlink():
            found.append((label, os.path.realpath(e.path)))
    return found


def model_inputs(model: PathLike | None, label: str = "the model") -> list[Input]:
    """What a MODEL argument reads, before it is resolved: the path as given (a directory with the targets
    of its symlinks, or a file); for the default model (``None``), a pinned model's name or a ``.gguf`` file,
    also qkit's cache of converted models and the pinned GGUF. The resolved directory is added once known
    (``qkit.api``)."""
    cache_models = ("qkit's model cache", assets.cache_dir() / "models")
    if model is None or os.fspath(model) == "":
        return [("the default model", pinned_models.DEFAULT.asset.path), cache_models]
    found = directory_inputs(label, model)
    pinned = pinned_models.PINNED_MODELS.find(os.fspath(model))
    if pinned is not None:  # a local path of that name is read instead; both are inputs until it is resolved
        found.append((f"the pinned model {pinned.name}", pinned.asset.path))
    if pinned is not None or os.fspath(model).endswith(".gguf"):
        found.append(cache_models)
    return found


def file_inputs(label: str, value: str | Sequence[str] | None) -> list[Input]:
    """An option naming a file or a dataset (``hf:...``, ``kjv:...``): the file, if it is one; an option naming
    several (``--calibration a.txt,b.txt``, or repeated: ``texts.split_sources``), each, and the whole value
    too (a file whose name holds a comma is one file to ``--corpus``)."""
    if value is None:
        return []
    values = [str(value)] if isinstance(value, (str, os.PathLike)) else [str(v) for v in value]
    entries = [e for v in values for e in dict.fromkeys([v, *v.split(",")])]
    return [(label, e) for e in entries if e and not e.startswith(("hf:", "kjv:"))]


# --------------------------------------------------------------------------- what qkit wrote


def is_qkit_directory(path: PathLike) -> bool:
    """A directory qkit may replace: empty, a qkit checkpoint, an export (``qkit-export.json``) or a
    converted GGUF in the cache (``qkit-source.json``)."""
    try:  # a claim on an output inside it (quantize -o D --json D/r.json) is this run's, not content
        names = [n for n in os.listdir(path) if not n.endswith(claims.MARK)]
    except OSError:
        return False
    if not names or EXPORT_MANIFEST in names or SOURCE_FILE in names:
        return True
    try:
        config_path = os.path.join(os.fspath(path), "config.json")
        config = json.loads(reading.read_bytes(config_path, config_path, limit=_MAX_JSON_BYTES))
        qc = jsonfields.field(config, "quantization_config", jsonfields.OBJECT | jsonfields.NULL, config_path) or {}
        return qc.get("quant_method") == "qkit"
    except (OSError, ValueError, RecursionError, QkitError):  # unreadable or of the wrong shape: not qkit's
        return False


def is_json_file(path: PathLike) -> bool:
    """A file that parses as JSON (what every ``--json`` writes)."""
    try:
        json.loads(reading.read_bytes(path, os.fspath(path), limit=_MAX_JSON_BYTES))
        return True
    except (OSError, ValueError, RecursionError, QkitError):  # not a regular file, too large, not JSON
        return False


_DESCRIBE = {"dir": "a qkit checkpoint or export, or an empty directory", "json": "a JSON file",
             "file": "a file qkit wrote"}


# --------------------------------------------------------------------------- the check


def check_output_path(
    out: PathLike | None,
    *,
    kind: str = "dir",
    force: bool = False,
    inputs: Iterable[Input] = (),
    what: str = "-o",
    owned: Callable[[Path], bool] | None = None,
    describe: str | None = None,
) -> Path:
    """Refuse an output qkit must not or cannot write (see the module docstring); return it as a ``Path``.

    ``kind``: ``"dir"`` (a directory output), ``"file"`` or ``"json"`` (one file). ``owned(path)``: whether
    an existing output is qkit's to replace (default: ``is_qkit_directory`` for ``dir``,
    ``is_json_file`` for ``json``, nothing for ``file``); ``describe``: what ``owned`` accepts, in words.
    ``what``: the option, for messages. Raises ``OutputError`` (``OutputExistsError`` for an existing
    output) in one line; creates nothing.
    """
    if out is None or os.fspath(out) == "":
        raise OutputError(f"{what} is empty; give a path to write to")
    path = Path(os.fspath(out))
    found = overlap(path, inputs)
    if found is not None:
        relation, label, src = found
        raise OutputError(f"{what} {path} {relation} {label} {src}; qkit never writes over what it reads, "
                          f"whatever the flags: choose a path outside it")
    if owned is None:
        owned = {"dir": is_qkit_directory, "json": is_json_file}.get(kind, lambda _p: False)
    describe = describe or _DESCRIBE.get(kind, "a qkit output")
    if os.path.lexists(path):
        if reading.is_link_loop(path):
            raise OutputExistsError(f"{what} {path} is a symbolic link loop (it points back to itself); remove it or "
                                    f"choose another {what}")
        if not os.path.exists(path):
            raise OutputExistsError(f"{what} {path} is a symbolic link to a missing path; remove it or choose another {what}")
        if kind == "dir" and not path.is_dir():
            raise OutputExistsError(f"{what} {path} exists and is not a directory; choose another {what}")
        if kind != "dir" and path.is_dir():
            raise OutputExistsError(f"{what} {path} is a directory; give a file path")
        other = kind != "dir" and reading.kind_of(os.stat(path))
        if other:  # a FIFO would block the check below and the write; a device or socket is no file to replace
            raise OutputExistsError(f"{what} {path} is {other}, not a regular file; qkit writes only regular files: "
                                    f"choose another {what}")
        if not owned(path):
            raise OutputExistsError(f"{what} {path} already exists and is not something qkit wrote (not {describe}); "
                                    f"qkit replaces only its own outputs: move it away or choose another {what}")
        if not force:
            raise OutputExistsError(f"{what} {path} already exists; pass --force to replace it or choose another {what}")
    probe_dir = _writable_ancestor(path, what)
    error = _probe(probe_dir, path.name)
    if error is not None:
        cause = _WRITE_ERRORS.get(error.errno or 0, error.strerror or str(error))
        raise OutputError(f"cannot write {what} {path}: {probe_dir} does not accept new files ({cause}); "
                          f"choose a writable location")
    return path


# --------------------------------------------------------------------------- a command's outputs together


Output = tuple[str, Union[PathLike, None]]  # (the option, e.g. "--json"; its path, or None/"-": not a file)


def _spelled(path: PathLike) -> str:
    """The path as it will be written: absolute, with ``..`` and the symbolic links of its parents resolved."""
    return os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))


def check_apart(targets: Iterable[Output], *, may_hold: Iterable[str] = ()) -> None:
    """Refuse two outputs of one command that would write over each other, before any work.

    Two are one when their real paths are equal (``..``, relative paths and symbolic links resolved) or, where
    both exist, when they are one file (device and inode: a hard link); one lies inside the other when its
    real path continues the other's, or its existing parents include the other (``overlap``). Only an output
    whose option is in ``may_hold`` (``quantize -o``: a directory put in place before the ``--json`` report
    is written into it) may hold another. ``None``, ``""`` and ``"-"`` (stdout) are not files and are skipped.
    Raises ``OutputError`` naming both options.
    """
    given = [(what, p) for what, p in targets if p is not None and os.fspath(p) not in ("", "-")]
    holders = set(may_hold)
    for i, (a_what, a) in enumerate(given):
        for b_what, b in given[i + 1:]:
            ra, rb = _spelled(a), _spelled(b)
            sa, sb = _stat(Path(ra)), _stat(Path(rb))
            if ra == rb or (sa is not None and sb is not None and _same(sa, sb)):
                raise OutputError(f"{b_what} {b} is the same path as {a_what} {a}; one would replace the other: give "
                                  "each output its own path")
            for (o_what, o), (i_what, inner) in (((a_what, a), (b_what, b)), ((b_what, b), (a_what, a))):
                if o_what not in holders and _inside(inner, o):
                    raise OutputError(f"{o_what} {o} contains {i_what} {inner}; one would replace the other: give "
                                      "each output its own path")


def _inside(inner: PathLike, outer: PathLike) -> bool:
    """Whether ``inner`` lies below ``outer``: by spelling (real paths), or by the inodes of its existing parents."""
    if _spelled(inner).startswith(_spelled(outer).rstrip(os.sep) + os.sep):
        return True
    found = overlap(inner, [("", outer)])
    return found is not None and found[0] == "lies inside"


def claim_output(out: PathLike, what: str = "-o") -> None:
    """Claim ``out`` for this run (``qkit.claims.claim``): refused in one line while another live qkit process
    writes it; held until the caller's ``claims.scope`` (or ``scoped`` function) ends. Call right after
    ``check_output_path``."""
    claims.claim(out, what)


scoped = claims.scoped  # a library entry point that claims its outputs releases them when it returns or raises


def _writable_ancestor(path: Path, what: str) -> Path:
    """The directory the staging sibling (or the first missing parent) will be created in."""
    parent = Path(os.path.abspath(path)).parent
    for p in (parent, *parent.parents):
        if os.path.lexists(p):
            if not p.is_dir():
                raise OutputError(f"cannot write {what} {path}: {p} is {'a file' if p.exists() else 'a broken link'}, "
                                  "not a directory; choose another path")
            return p
    raise OutputError(f"cannot write {what} {path}: no existing parent directory")  # pragma: no cover - "/" exists


def _probe(directory: Path, name: str) -> OSError | None:
    """Create, write one byte to, and remove a sibling-named probe file in ``directory``; the error, if any.

    The name is new (a random part), so the probe is removed in an outer ``finally`` that also covers the
    moment between ``os.open`` returning and the inner ``try``: a Ctrl-C landing there left the probe
    behind (seen on a loaded machine). Only a name that already existed (``FileExistsError``) is not ours."""
    probe = directory / sibling_name(name or "out", TMP_MARK)
    ours = True
    try:
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as exc:
            ours = False
            return exc
        except OSError as exc:
            return exc
        error = None
        try:
            os.write(fd, b"\0")  # a full file system refuses the first block; creating an empty file still works
        except OSError as exc:
            error = exc
        finally:
            try:
                os.close(fd)
            except OSError as exc:  # NFS reports a full disk on close
                error = error or exc
        return error
    finally:
        if ours:
            with contextlib.suppress(OSError):
                os.unlink(probe)


__all__ = ["EXPORT_MANIFEST", "SOURCE_FILE", "Input", "Output", "check_apart", "check_output_path", "claim_output",
           "directory_inputs", "file_inputs", "scoped",
           "is_json_file", "is_qkit_directory", "model_inputs", "overlap"]
