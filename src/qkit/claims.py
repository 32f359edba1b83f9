"""Claiming an output for one run, so that a second qkit process writing the same path refuses before any work.

Layer 1, below ``qkit.outputs`` (which checks a target, then claims it) and ``qkit.staging``.

Two runs writing one output both used to finish, the second's file replacing the first's, and the first's
summary then described the other run's file. Now every output a run writes is *claimed* right after it is
checked, and held until the run has put it in place:

* the claim is a file ``.REL.qkit-claim`` in the nearest existing directory above the output, where REL is
  the output's path below that directory with ``%`` and ``/`` written ``%25`` and ``%2F``: ``-o m.gguf``
  is claimed by ``.m.gguf.qkit-claim`` beside it, and ``-o new/m.gguf`` (``new`` not made yet) by
  ``.new%2Fm.gguf.qkit-claim``, so that claiming never creates a directory. It is created with
  ``O_EXCL`` (one creator wins), holds the holder's PID and command line, and is locked (``flock``) by its
  holder for as long as it is held;
* a claim whose lock can be taken belongs to a process that is gone (the kernel releases a dead process's
  lock, whatever became of its PID): it is removed, as the staging siblings of killed runs are
  (``qkit.staging``), and the run goes on. A live one refuses the run in one line naming the process;
* once its own claim exists, a run looks for claims of the same output made where fewer of its parents
  existed (a run that started before ``new/`` was made): of two runs racing, at least one sees the other;
* claims are held per process. A second claim of a path this process holds is a no-op under the same
  option, and a refusal under another (two options of one run naming one file). ``scope`` releases what was
  claimed inside it (every CLI command and library entry point runs in one); an ``atexit`` hook releases the
  rest. A forked child never releases its parent's claims.

On a file system without ``flock`` the holder's PID decides (alive: live), as for staging siblings; on one
shared between machines a PID names a process on one host only (docs/guarantees.md).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar, Union

from qkit.assets import pid_alive
from qkit.errors import OutputError

PathLike = Union[str, "os.PathLike[str]"]
F = TypeVar("F", bound=Callable)

MARK = ".qkit-claim"
_NAME_MAX = 255
_SETTLE_SECONDS = 5.0  # a claim file this young with no PID yet is being created, not abandoned
_TRIES = 250  # x _PAUSE: how long a claim being created or removed by another process is waited for
_PAUSE = 0.02
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


@dataclasses.dataclass
class _Held:
    target: str  # as the caller spelled it, for messages
    what: str  # the option, for messages
    file: Path  # the claim file
    fd: int  # open and flock'ed for as long as it is held
    pid: int  # the process that took it (a forked child must not release it)


_HELD: dict[str, _Held] = {}  # real path of the output -> its claim


# --------------------------------------------------------------------------- names


def _key(target: PathLike) -> Path:
    """The output's real path: absolute, ``..`` and symbolic links of its existing parents resolved."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(target))))


def claim_name(rel: str) -> str:
    """The claim file's name for an output ``rel`` below its directory (``a/b.json`` -> ``.a%2Fb.json.qkit-claim``);
    a name too long for the file system is replaced by its sha256."""
    name = "." + rel.replace("%", "%25").replace("/", "%2F") + MARK
    if len(name.encode()) > _NAME_MAX:
        name = "." + hashlib.sha256(rel.encode()).hexdigest() + MARK
    return name


def _levels(key: Path) -> list[tuple[Path, Path]]:
    """Every directory above ``key``, nearest first, with the claim file of ``key`` in it."""
    return [(d, d / claim_name(os.path.relpath(key, d))) for d in key.parents]


def _command() -> str:
    """This process's command line, one line of printable characters (for another run's refusal)."""
    argv = list(sys.argv)
    head = "qkit" if argv and os.path.basename(argv[0]) in ("qkit", "__main__.py") else os.path.basename(argv[0] if argv else "")
    text = " ".join([head, *argv[1:]]).strip()
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", "?", text)[:200]


# --------------------------------------------------------------------------- another process's claim


@dataclasses.dataclass(frozen=True)
class _Found:
    state: str  # "live", "gone" (absent, or removed here), "busy" (being created or removed: look again)
    pid: int | None = None
    command: str = ""


def _parse(data: bytes) -> tuple[int | None, str]:
    lines = data.decode("utf-8", "replace").splitlines()
    pid = int(lines[0]) if lines and lines[0].strip().isdigit() else None
    return pid, (lines[1] if len(lines) > 1 else "")


def _inspect(file: Path, what: str, target: PathLike) -> _Found:
    """Whether the claim ``file`` is held by a live process; a dead one's is removed here."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return _Found("gone")
    except OSError as exc:  # a symbolic link or something else put there under a claim's name
        raise OutputError(f"cannot claim {what} {target}: {file} exists and is not a qkit claim ({exc.strerror}); "
                          "remove it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(f"cannot claim {what} {target}: {file} exists and is not a qkit claim; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            locked = False
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            locked = None  # no flock here: the PID decides
        pid, command = _parse(os.pread(fd, 4096, 0))
        if locked is False:  # its holder is alive, unless a third run is removing a dead claim right now
            return _Found("live", pid, command) if pid is None or pid_alive(pid) else _Found("busy")
        if pid is None and time.time() - st.st_mtime < _SETTLE_SECONDS:
            return _Found("busy")  # created a moment ago; its PID is being written
        if locked is None and pid is not None and pid_alive(pid):
            return _Found("live", pid, command)
        with contextlib.suppress(OSError):  # gone: remove it, if the name still means this file
            now = os.stat(file, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(file)
        return _Found("busy")  # look again: the name is free now, or someone else's
    finally:
        os.close(fd)


def _refuse(what: str, target: PathLike, found: _Found) -> OutputError:
    who = f"PID {found.pid}" if found.pid is not None else "a process"
    return OutputError(f"{what} {target} is being written by another qkit process ({who}"
                       + (f": {found.command}" if found.command else "") + f"); wait for it to finish, or choose another {what}")


def _create(file: Path, what: str, target: PathLike) -> int | None:
    """Create and lock the claim ``file`` (``O_EXCL``); its fd, or None when the name exists."""
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except FileExistsError:
        return None
    except OSError as exc:
        raise OutputError(f"cannot write {what} {target}: cannot create {file} ({exc.strerror}); choose a writable "
                          "location") from None
    try:
        for _ in range(_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another run looked at it in the instant before our lock: it lets go
                time.sleep(_PAUSE)
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise
                break
        else:
            raise OutputError(f"cannot claim {what} {target}: another process keeps {file} locked; wait for it, or "
                              f"choose another {what}")
        os.write(fd, f"{os.getpid()}\n{_command()}\n".encode())
        return fd
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(file)
        raise


# --------------------------------------------------------------------------- claiming


def claim(target: PathLike, what: str = "-o") -> None:
    """Claim the output ``target`` (named ``what`` in messages) for this process, until ``release``.

    Refused in one ``OutputError`` line when another live process holds a claim on it (naming its PID and
    command), or when this process holds it under another option. A dead process's claim is removed.
    Creates one file (``claim_name``) in the nearest existing directory above ``target``; never a directory.
    """
    key = _key(target)
    held = _HELD.get(str(key))
    if held is not None and held.pid == os.getpid():
        if held.what != what:
            raise OutputError(f"{what} {target} is the same path as {held.what} {held.target}; give each output its "
                              "own path")
        return
    levels = _levels(key)
    at = next((i for i, (d, _f) in enumerate(levels) if os.path.isdir(d)), None)
    if at is None:  # pragma: no cover - "/" exists
        raise OutputError(f"cannot write {what} {target}: no existing parent directory")
    file = levels[at][1]
    for _ in range(_TRIES):
        fd = _create(file, what, target)
        if fd is not None:
            break
        found = _inspect(file, what, target)
        if found.state == "live":
            raise _refuse(what, target, found)
        time.sleep(_PAUSE if found.state == "busy" else 0)
    else:
        raise OutputError(f"cannot claim {what} {target}: {file} keeps changing; another qkit process is starting on "
                          f"it: wait for it, or choose another {what}")
    _HELD[str(key)] = mine = _Held(os.fspath(target), what, file, fd, os.getpid())
    for _d, other in levels[at + 1:]:  # a run that claimed it when fewer of its parents existed
        if not os.path.lexists(other):
            continue
        found = _inspect(other, what, target)
        for _ in range(_TRIES):
            if found.state != "busy":
                break
            time.sleep(_PAUSE)
            found = _inspect(other, what, target)
        if found.state == "live":
            _release(str(key), mine)
            raise _refuse(what, target, found)


def holds(target: PathLike) -> bool:
    """Whether this process holds a claim on ``target``."""
    held = _HELD.get(str(_key(target)))
    return held is not None and held.pid == os.getpid()


def _release(key: str, held: _Held) -> None:
    _HELD.pop(key, None)
    if held.pid != os.getpid():  # a forked child: the claim, its file and its lock are the parent's
        return
    with contextlib.suppress(OSError):
        mine, now = os.fstat(held.fd), os.stat(held.file, follow_symlinks=False)
        if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
            os.unlink(held.file)
    with contextlib.suppress(OSError):
        os.close(held.fd)


def release(target: PathLike) -> None:
    """Release this process's claim on ``target`` (its file removed, its lock dropped); nothing if none."""
    key = str(_key(target))
    held = _HELD.get(key)
    if held is not None:
        _release(key, held)


def release_all() -> None:
    """Release every claim this process holds (at exit, and at the end of every CLI command)."""
    for key, held in list(_HELD.items()):
        _release(key, held)


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Release, when the block ends (returns, raises, Ctrl-C), the claims taken inside it; claims held before it
    (a CLI command's, around a library call) stay held."""
    before = set(_HELD)
    try:
        yield
    finally:
        for key in [k for k in _HELD if k not in before]:
            _release(key, _HELD[key])


def scoped(fn: F) -> F:
    """``fn`` run inside ``scope()``: what it claims is released when it returns or raises."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with scope():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


atexit.register(release_all)

__all__ = ["MARK", "claim", "claim_name", "holds", "release", "release_all", "scope", "scoped"]
