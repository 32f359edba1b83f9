"""Where qkit may write: the one check every output goes through, and the hidden sibling it is staged in.

Every writer (``quantize -o`` in every format, every ``--json``) calls ``check_output`` before any work.
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

``staged`` then stages the write in a hidden sibling ``.NAME.qkit-tmp-PID-RANDOM`` (a directory, or a
file for ``--json``): on success the caller renames it into place; on any failure it is removed, the
parent directories it created are removed, and an ``OSError`` of writing (ENOSPC, EROFS, ...) becomes
one ``OutputError`` line naming the path and the cause. A run killed with SIGKILL leaves only such a
sibling, and the next write into the same parent removes it (``remove_stale_siblings``).

What this process published (every ``staged`` block that completed: the output was moved into place) is
recorded (``published()``), so an interrupt can say truthfully whether something was written.

Scratch directories under ``$TMPDIR`` (an eval row's checkpoint, ``inspect errors --method``'s) come from
``temporary_directory(prefix)``: ``PREFIXPID-RANDOM``, removed on exit; a SIGKILLed run's is removed by
the next ``remove_stale_temporary(prefix)`` (its PID is gone).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Union

from qkit import assets
from qkit.errors import OutputError, OutputExistsError

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

TMP_MARK = ".qkit-tmp-"  # hidden sibling being written: .NAME.qkit-tmp-PID-RANDOM
OLD_MARK = ".qkit-old-"  # the replaced output, removed once the new one is in place: .NAME.qkit-old-PID-RANDOM
_SIBLING = re.compile(r"^\.(?P<name>.+)(?:\.qkit-tmp-|\.qkit-old-)(?P<pid>[0-9]+)-[0-9a-f]{8}$")

# errno of a failed write -> the cause in words (a failed write anywhere inside the staging sibling is
# the output's problem, not the input's)
_WRITE_ERRORS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EFBIG: "file too large for this file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENAMETOOLONG: "file name too long",
    errno.EIO: "input/output error",
}


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
    of its symlinks, or a file); for the default model (``None``) or a ``.gguf`` file, also qkit's cache of
    converted models and the pinned GGUF. The resolved directory is added once known (``qkit.api``)."""
    cache_models = ("qkit's model cache", assets.cache_dir() / "models")
    if model is None or os.fspath(model) == "":
        return [("the default model", assets.DEFAULT_MODEL.path), cache_models]
    found = directory_inputs(label, model)
    if os.fspath(model).endswith(".gguf"):
        found.append(cache_models)
    return found


def file_inputs(label: str, value: str | None) -> list[Input]:
    """An option naming a file or a dataset (``hf:...``): the file, if it is one."""
    if value is None or str(value).startswith("hf:"):
        return []
    return [(label, value)]


# --------------------------------------------------------------------------- what qkit wrote


def is_qkit_directory(path: PathLike) -> bool:
    """A directory qkit may replace: empty, a qkit checkpoint, an export (``qkit-export.json``) or a
    converted GGUF in the cache (``qkit-source.json``)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if not names or EXPORT_MANIFEST in names or SOURCE_FILE in names:
        return True
    try:
        with open(os.path.join(os.fspath(path), "config.json"), "rb") as f:
            config = json.loads(f.read(_MAX_JSON_BYTES))
        return (config.get("quantization_config") or {}).get("quant_method") == "qkit"
    except (OSError, ValueError, AttributeError):
        return False


def is_json_file(path: PathLike) -> bool:
    """A file that parses as JSON (what every ``--json`` writes)."""
    try:
        if os.path.getsize(path) > _MAX_JSON_BYTES:
            return False
        with open(path, "rb") as f:
            json.loads(f.read())
        return True
    except (OSError, ValueError):
        return False


_DESCRIBE = {"dir": "a qkit checkpoint or export, or an empty directory", "json": "a JSON file",
             "file": "a file qkit wrote"}


# --------------------------------------------------------------------------- the check


def check_output(
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
        if not os.path.exists(path):
            raise OutputExistsError(f"{what} {path} is a symbolic link to a missing path; remove it or choose another {what}")
        if kind == "dir" and not path.is_dir():
            raise OutputExistsError(f"{what} {path} exists and is not a directory; choose another {what}")
        if kind != "dir" and path.is_dir():
            raise OutputExistsError(f"{what} {path} is a directory; give a file path")
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
    """Create, write one byte to, and remove a sibling-named probe file in ``directory``; the error, if any."""
    probe = directory / sibling_name(name or "out", TMP_MARK)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return error


# --------------------------------------------------------------------------- staging siblings


def sibling_name(name: str, mark: str = TMP_MARK) -> str:
    """``.NAME.qkit-tmp-PID-RANDOM``: hidden, unique, and naming the writer's PID for stale cleanup."""
    return f".{name}{mark}{os.getpid()}-{uuid.uuid4().hex[:8]}"


_pid_alive = assets.pid_alive  # a writer's PID in a temporary name: gone means the name is garbage


def stale_siblings(out: PathLike) -> list[Path]:
    """Hidden temporary siblings (``.NAME.qkit-tmp-PID-*``, ``.NAME.qkit-old-PID-*``: directories, or files of
    a ``--json`` write or a probe) in ``out``'s parent whose writer process is gone: what a run killed with
    SIGKILL (or a power cut) leaves behind.

    Any NAME counts: every such entry in the parent was written by qkit and is garbage once its writer
    has exited. The name holds the writer's PID only (no host name); on a file system shared between
    machines, a writer on another host whose PID does not exist here would count as gone.
    """
    parent = Path(out).parent
    try:
        entries = list(parent.iterdir())
    except OSError:  # no parent yet: nothing to clean
        return []
    found = []
    for p in entries:
        m = _SIBLING.match(p.name)
        if m and not p.is_symlink() and (p.is_dir() or p.is_file()) and not _pid_alive(int(m.group("pid"))):
            found.append(p)
    return sorted(found)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            p.unlink()


def remove_stale_siblings(out: PathLike) -> list[Path]:
    """Remove ``stale_siblings(out)``; return the paths removed (to report them)."""
    removed = []
    for p in stale_siblings(out):
        _remove(p)
        if not os.path.lexists(p):
            removed.append(p)
    return removed


_SHORT = -1  # a short write without an errno
_SHORT_WRITE = re.compile(r"\b[0-9]+ requested and [0-9]+ written\b")


def _nearest_existing(path: Path) -> Path:
    return next((p for p in (path, *path.parents) if os.path.lexists(p)), Path("/"))


def _stat_free(directory: Path) -> int | None:
    """Bytes free to this user on ``directory``'s file system (None: cannot tell)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# errnos a read of an input can raise too: counted as the output's only when they name a path being written
_AMBIGUOUS = {errno.EACCES, errno.EPERM, errno.ENAMETOOLONG, errno.EIO}


def write_failure(exc: BaseException, out: PathLike, what: str = "-o", staging: PathLike | None = None) -> OutputError | None:
    """The ``OutputError`` for an exception raised while writing ``out`` (staged in ``staging``), when it is a
    failed write: an ``OSError`` such as ENOSPC or EROFS, or safetensors' wrapped I/O error; else None (the
    caller re-raises it as it is). Permission and I/O errors count only when they name ``out`` or a path
    inside ``staging``: the same errors from reading an input are the input's."""
    if isinstance(exc, OutputError):
        return None
    code = None
    if isinstance(exc, OSError) and exc.errno is None and _SHORT_WRITE.search(str(exc)):
        # numpy's tofile reports a short write without an errno ("10880 requested and 2560 written")
        free = _stat_free(_nearest_existing(Path(os.path.abspath(os.fspath(out))).parent))
        code = errno.ENOSPC if free is not None and free < (1 << 20) else _SHORT
    elif isinstance(exc, OSError):
        code = exc.errno
        if code in _AMBIGUOUS:
            names = [os.fspath(f) for f in (exc.filename, exc.filename2) if f is not None]
            mine = [os.fspath(out), *([os.fspath(staging)] if staging is not None else [])]
            if not any(n == m or n.startswith(m.rstrip(os.sep) + os.sep) for n in names for m in mine):
                return None
    elif isinstance(exc, Exception):  # safetensors: "Error while serializing: I/O error: ... (os error 28)"
        m = re.search(r"\(os error ([0-9]+)\)|\bOs \{ code: ([0-9]+)", str(exc))
        code = int(m.group(1) or m.group(2)) if m else None
        if code in _AMBIGUOUS and "serializ" not in str(exc):  # only a failed save is the output's
            code = None
    if code == _SHORT:
        cause = f"the file system took only part of a write ({exc})"
    elif code in _WRITE_ERRORS:
        cause = _WRITE_ERRORS[code]
    else:
        return None
    fix = "free space or choose another" if code in (errno.ENOSPC, errno.EDQUOT, _SHORT) else "choose another"
    return OutputError(f"cannot write {what} {out}: {cause}; the partial output was removed: {fix} {what}")


def _make_parents(directory: Path, created: list[Path]) -> None:
    """``mkdir -p directory``, recording each directory it creates in ``created``, deepest first (to remove
    them on failure; recorded as they are made, so a failure halfway loses none)."""
    missing = []
    for p in (directory, *directory.parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    for p in reversed(missing):
        p.mkdir()
        created.insert(0, p)


@contextlib.contextmanager
def staged(
    out: PathLike, *, directory: bool = True, what: str = "-o", on_stale: Callable[[list[Path]], None] | None = None
) -> Iterator[Path]:
    """Yield a hidden sibling of ``out`` to write into: a new directory, or (``directory=False``) the name
    of a file not yet created. The caller moves it into place inside the ``with`` block.

    First creates the missing parents and removes stale siblings of killed runs (reported to
    ``on_stale``). Whatever is left of the sibling afterwards is removed; on failure the parents it
    created are removed too, and a failed write becomes one ``OutputError`` line (``write_failure``).
    """
    out = Path(out)
    created: list[Path] = []
    tmp: Path | None = None
    try:
        _make_parents(out.parent, created)
        removed = remove_stale_siblings(out)
        if removed and on_stale:
            on_stale(removed)
        tmp = out.parent / sibling_name(out.name, TMP_MARK)
        if directory:
            tmp.mkdir()
        yield tmp
        if os.path.lexists(out):  # the caller moved it into place: from here on, something was written
            _PUBLISHED.append(out)
    except BaseException as exc:
        failure = write_failure(exc, out, what, tmp)  # first: removing the partial output frees the space
        if tmp is not None:
            _remove(tmp)
            tmp = None
        for p in created:  # deepest first; only if still empty
            with contextlib.suppress(OSError):
                p.rmdir()
        if failure is not None:
            raise failure from exc
        raise
    finally:
        if tmp is not None and os.path.lexists(tmp):
            _remove(tmp)


def publish_directory(tmp: Path, out: Path, recheck: Callable[[], None] | None = None) -> None:
    """Put the finished directory ``tmp`` at ``out``; an existing ``out`` (checked again by ``recheck``:
    it may have appeared while we worked) is moved aside first and removed once the new one is in place."""
    if os.path.lexists(out):
        if recheck is not None:
            recheck()
        old = out.parent / sibling_name(out.name, OLD_MARK)
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)  # put the old output back: a failed publish changes nothing
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def write_text(path: PathLike, text: str, *, what: str = "--json",
               on_stale: Callable[[list[Path]], None] | None = None) -> None:
    """Write ``text`` to ``path`` atomically: into a hidden sibling file, then renamed over ``path``.

    A failed write (full disk) leaves neither the sibling nor a partial ``path``; the sibling of a run
    killed mid-write is removed by the next write into the same directory.
    """
    path = Path(path)
    with staged(path, directory=False, what=what, on_stale=on_stale) as tmp:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)


# --------------------------------------------------------------------------- what this process wrote

_PUBLISHED: list[Path] = []  # every output this process put in place, in order (``staged`` records them)


def published() -> list[Path]:
    """The outputs this process has put in place so far (a checkpoint, an export, a ``--json`` report)."""
    return list(_PUBLISHED)


def interrupted_message() -> str:
    """What an interrupt left, in words: ``interrupted after writing PATH`` once something was published,
    else ``interrupted; nothing was written`` (staged writes in progress are removed as the stack unwinds)."""
    done = list(dict.fromkeys(_PUBLISHED))
    if not done:
        return "interrupted; nothing was written"
    return f"interrupted after writing {', '.join(map(str, done))}"


# --------------------------------------------------------------------------- scratch directories in $TMPDIR

_RANDOM = 8  # tempfile's random part: 8 characters of [a-z0-9_]


def _temporary_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}(?P<pid>[0-9]+)-[a-z0-9_]{{{_RANDOM}}}$")


def remove_stale_temporary(prefix: str, parent: PathLike | None = None) -> list[Path]:
    """Remove ``PREFIXPID-RANDOM`` directories under ``parent`` (default ``tempfile.gettempdir()``, i.e.
    ``$TMPDIR``) whose writer process is gone (killed by SIGKILL or a power cut); return them. A live
    process's directory (its PID exists) is never touched."""
    root = Path(parent or tempfile.gettempdir())
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    pattern = _temporary_pattern(prefix)
    removed = []
    for p in sorted(entries):
        m = pattern.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and not _pid_alive(int(m.group("pid"))):
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                removed.append(p)
    return removed


@contextlib.contextmanager
def temporary_directory(prefix: str, on_stale: Callable[[list[Path]], None] | None = None) -> Iterator[Path]:
    """A scratch directory ``$TMPDIR/PREFIXPID-RANDOM``, removed when the block ends (also on an exception
    or Ctrl-C). The writer's PID in the name lets the next run remove it when this one was SIGKILLed:
    stale ones of the same prefix are removed first (reported to ``on_stale``)."""
    removed = remove_stale_temporary(prefix)
    if removed and on_stale:
        on_stale(removed)
    with tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-") as tmp:
        try:
            yield Path(tmp)
        finally:  # what was written in here is gone with it: an interrupt must not claim it was written
            inside = Path(tmp)
            _PUBLISHED[:] = [p for p in _PUBLISHED if inside not in p.parents]


__all__ = ["EXPORT_MANIFEST", "OLD_MARK", "SOURCE_FILE", "TMP_MARK", "Input", "check_output", "directory_inputs",
           "file_inputs", "interrupted_message", "is_json_file", "is_qkit_directory", "model_inputs", "overlap",
           "publish_directory", "published", "remove_stale_siblings", "remove_stale_temporary", "sibling_name", "stale_siblings", "staged", "temporary_directory", "write_failure", "write_text"]
