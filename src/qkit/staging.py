"""How qkit writes: in a hidden sibling moved into place when complete, and what it leaves when killed.

Layer 1, below ``qkit.outputs`` (which checks a target before any work).

``staged`` stages a write in a hidden sibling ``.NAME.qkit-tmp-PID-RANDOM`` (a directory, or a
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
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Union

from qkit import assets
from qkit.errors import OutputError

PathLike = Union[str, "os.PathLike[str]"]

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


__all__ = ["OLD_MARK", "TMP_MARK", "interrupted_message", "publish_directory", "published", "remove_stale_siblings",
           "remove_stale_temporary", "sibling_name", "stale_siblings", "staged", "temporary_directory", "write_failure",
           "write_text"]
