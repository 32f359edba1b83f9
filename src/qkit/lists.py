"""Lists given in one word (``--schemes int8-row,nf4``) or by repeating an option: the one parser of them all.

A list option left out gives its default; one given names at least one thing. An empty value (``""``,
``","``, ``" , "``: usually an empty shell variable) and an empty entry (``"q4_0,,q8_0"``, a comma at an
end) are refused in one line naming the option, never read as the default or skipped: a mistake in a
script would otherwise run the wrong table in silence. Layer 1: library parsers (``--candidates``,
``--gpu``, ``--temperature``, ``--run``, ``kjv:BOOK,...``) and the CLI (``qkit.cli.common``) call these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from qkit.errors import InputError

_SHOWN = 60  # characters of a value quoted in a message: a 100 kB value stays a one-line message


def shown(text: str) -> str:
    """``text`` quoted for a one-line message: ``repr`` (control characters escaped), cut to ``_SHOWN``."""
    r = repr(str(text))
    return r if len(r) <= _SHOWN else f"{r[:_SHOWN - 4]}...{r[-1]} ({len(str(text)):,} characters)"


def empty(option: str, what: str, where: str = "", *, one: bool = False) -> InputError:
    """The refusal of an empty value: ``--schemes is empty; name at least one scheme (...), or leave the
    option out for the default``. ``one``: a repeatable option's value names one ``what``, not a list."""
    hint = f" ({where})" if where else ""
    leave = "the option" if option.startswith("-") else "it"
    return InputError(f"{option} is empty; name {'a' if one else 'at least one'} {what}{hint}, "
                      f"or leave {leave} out for the default")


def split_list(text: str, option: str, *, what: str = "name", where: str = "", spaces: bool = False) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]``: the entries between commas, stripped; ``spaces``: also split at
    whitespace (``--candidates "q4_k q6_k"``). ``InputError`` for an empty value (no entry at all) and for
    an empty entry (two commas in a row, or one at an end), each naming ``option``."""
    pieces = [p.strip() for p in str(text).split(",")]
    if not any(pieces):
        raise empty(option, what, where)
    if not all(pieces):
        raise InputError(f"{option} {shown(text)} has an empty entry (two commas in a row, or one at an end); "
                         "separate the entries by single commas")
    return [w for p in pieces for w in p.split()] if spaces else pieces


def split_values(values: Iterable[str], option: str, *, what: str = "name", where: str = "",
                 spaces: bool = False) -> list[str]:
    """The values of an option both repeatable and comma-separated (``-s nf4 -s int8-row,int4-g64``, or the
    words a script passes as a sequence, each of which may hold several) -> every entry, each value split by
    ``split_list`` (an empty value or entry refused, naming ``option``). No values at all: ``[]``."""
    return [w for v in values for w in split_list(v, option, what=what, where=where, spaces=spaces)]


def check_words(values: Iterable[str], option: str, *, what: str = "name", where: str = "") -> list[str]:
    """The values of a repeatable option (or the entries a script passes as a sequence), as given: each
    must hold more than whitespace (``--include ''`` is refused, naming ``option``). An empty sequence is
    the option left out: the caller's default."""
    words = [str(v) for v in values]
    if not all(w.strip() for w in words):
        raise empty(option, what, where, one=True)
    return words


def numbers(text: str, option: str, kind: Callable[[str], float] = float, example: str = "1,2,4") -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (``kind``: ``int`` or ``float``), by ``split_list``; a word that is not
    a number is refused in one line."""
    words = split_list(text, option, what="number", where=f"e.g. {example}")
    try:
        return [kind(w) for w in words]
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise InputError(f"{option} must be comma-separated {noun}, e.g. {example} (got {shown(text)})") from None


__all__ = ["check_words", "empty", "numbers", "shown", "split_list", "split_values"]
