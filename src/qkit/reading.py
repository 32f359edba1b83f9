"""Reading a file the user named: regular files only, checked before they are opened, and bounded.

Layer 1. Every file qkit reads from a path it was given (``--imatrix``, ``--plan``, ``--tensor-type-file``,
``plan:`` and ``file:`` rows, ``qkit report``'s inputs, ``--calibration``, ``--corpus``, ``--config``,
``--from``, ``--lengths``, ``--bench``, a model's ``config.json``, tokenizer and weights) goes through
``check_file`` first, and a JSON or text file is read whole only through ``read_bytes``/``read_text``.

A named pipe (FIFO) blocks ``open`` until a writer appears, and a read until it writes; a character device
such as ``/dev/zero`` never ends; a socket cannot be opened at all. So each is refused, in one line naming
what it is, from ``stat`` alone, *before* it is opened: nothing is printed and then nothing happens. The
open that follows uses ``O_NONBLOCK`` and checks again (``fstat``), so a FIFO put in the file's place
between the two cannot block either. A symbolic link that points to itself (``ELOOP``) is called a loop,
never "no such file". A file larger than the caller's ``limit`` is refused by its size before a byte is read.

A missing or unreadable path raises its ``OSError`` unchanged (``FileNotFoundError``, ``PermissionError``):
each caller words those for its own option.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO, Union

from qkit.errors import InputError

PathLike = Union[str, "os.PathLike[str]"]

# The bounds of what qkit reads whole: a JSON document (a config, a plan, a report input, a tokenizer) and a
# text (a calibration text, a corpus, a lengths file). Larger files are not what the option takes.
MAX_JSON_BYTES = 256 * 1024**2
MAX_TEXT_BYTES = 1024**3

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def kind_of(st: os.stat_result) -> str | None:
    """What a ``stat`` result is, in words, when it is not a regular file (``"a named pipe (FIFO)"``, ``"a
    socket"``, ``"a character device"``, ``"a block device"``, ``"a directory"``); None for a regular file."""
    if stat.S_ISREG(st.st_mode):
        return None
    return next((words for test, words in _KINDS if test(st.st_mode)), "not a regular file")


def is_link_loop(path: PathLike) -> bool:
    """Whether ``path`` is (or passes through) a symbolic link loop: ``stat`` fails with ``ELOOP``."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    except ValueError:  # an embedded NUL: not a loop
        return False
    return False


def refusal(what: str, kind: str, fix: str = "") -> InputError:
    """The one line for an input that is ``kind`` (``kind_of``'s words, or "a symbolic link loop")."""
    tail = f"; {fix}" if fix else "; give a regular file"
    if kind == "a symbolic link loop":
        return InputError(f"{what} is a symbolic link loop (it points back to itself){tail}")
    return InputError(f"{what} is {kind}, not a regular file; qkit reads only regular files{tail}")


def check_file(path: PathLike, what: str, fix: str = "", *, directory_ok: bool = False) -> os.stat_result:
    """``stat`` ``path`` (following symbolic links) without opening it; return the result for a regular file.

    Refused in one ``InputError`` line naming ``what`` (e.g. ``"--imatrix m.gguf"``) and ``fix``: a symbolic
    link loop, a FIFO, a socket, a device, a directory (unless ``directory_ok``). A missing or unreadable
    path raises its ``OSError`` as it is.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refusal(what, "a symbolic link loop", fix) from None
        raise
    kind = kind_of(st)
    if kind is not None and not (directory_ok and stat.S_ISDIR(st.st_mode)):
        raise refusal(what, kind, fix)
    return st


def open_file(path: PathLike, what: str, fix: str = "") -> BinaryIO:
    """``path`` opened for reading in binary, once ``check_file`` has passed. The open itself is non-blocking
    and ``fstat`` checks the opened file again (a FIFO swapped in after the check is refused, not waited on);
    the file object then reads in the ordinary blocking mode."""
    check_file(path, what, fix)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        kind = kind_of(os.fstat(fd))
        if kind is not None:
            raise refusal(what, kind, fix)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: PathLike, what: str, fix: str = "", *, limit: int) -> bytes:
    """The whole of the regular file ``path`` (``open_file``); one larger than ``limit`` bytes is refused by its
    size before a byte is read (and a file that grows while it is read stops at ``limit + 1``)."""
    with open_file(path, what, fix) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise InputError(f"{what} is larger than {limit:,} bytes ({max(size, len(data)):,}), more than such a file "
                         f"holds{'; ' + fix if fix else ''}")
    return data


def read_text(path: PathLike, what: str, fix: str = "", *, limit: int = MAX_TEXT_BYTES) -> str:
    """``read_bytes`` decoded as UTF-8 (``UnicodeDecodeError`` for the caller to word)."""
    return read_bytes(path, what, fix, limit=limit).decode("utf-8")


def check_existing(path: PathLike, what: str, fix: str = "") -> None:
    """For a path that may not exist (an option whose file is optional): ``check_file`` when something is
    there (a loop included), nothing when it is absent."""
    if os.path.lexists(path):
        try:
            check_file(path, what, fix)
        except FileNotFoundError:  # a dangling link: the caller's "no such file"
            pass


def check_entries(directory: PathLike, what: str, fix: str = "") -> None:
    """Refuse a directory (a model's) holding an entry that is neither a regular file nor a directory: a FIFO,
    a socket, a device or a symbolic link loop, named in one line (``what``: the directory as given). A
    model's files are read by qkit, transformers, safetensors and the gguf package alike, so one ``stat`` per
    entry up front guards every one of those opens. A dangling link is left to the reader that wants it."""
    with os.scandir(directory) as entries:
        found = sorted(entries, key=lambda e: e.name)
    for e in found:
        try:
            st = os.stat(e.path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise refusal(f"{what}: {e.name}", "a symbolic link loop", fix) from None
            continue
        kind = kind_of(st)
        if kind is not None and not stat.S_ISDIR(st.st_mode):
            raise refusal(f"{what}: {e.name}", kind, fix)


def is_regular(path: PathLike) -> bool:
    """Whether ``path`` is a regular file (symbolic links followed); never opens it, never raises."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


__all__ = ["MAX_JSON_BYTES", "MAX_TEXT_BYTES", "check_entries", "check_existing", "check_file", "is_link_loop", "is_regular", "kind_of",
           "open_file", "read_bytes", "read_text", "refusal"]
