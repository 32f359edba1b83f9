"""One registry idiom for every kind of named thing: schemes, methods, runtimes, eval rows, export formats.

Layer 1 (beside ``errors``): it knows nothing of what it holds. A kind makes one ``Registry`` and its
modules register into it at import::

    REGISTRY: Registry[Format] = Registry("format", error=InputError)
    REGISTRY.register("gguf", GGUF_FORMAT)
    REGISTRY.get("ggfu")   # InputError: unknown format 'ggfu'; did you mean gguf? use one of: qkit, ..., gguf

Names are matched after ``normalize`` (by default: stripped, lower case, ``_`` read as ``-``), so
``Q4_K_M`` and ``q4-k-m`` name the same entry when a kind asks for that. A *family* is a pattern plus a
factory for names that are too many to list (``int4-g64``, ``int8-g128``): ``get`` tries the listed
names first, then each family in registration order. ``names()`` lists registered names in
registration order (families are not enumerated); that order is what help texts and docs tables show.

``unregister`` takes a name (and its aliases) out again, and ``temporarily(name, value)`` registers a value
for the length of a ``with`` block: how a test puts a stand-in (a fake engine) beside the real entries
without touching the registry's insides.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from qkit.errors import InputError, QkitError

T = TypeVar("T")


def _default_key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def unknown_name(kind: str, name: str, listed: Sequence[str], *, guesses: Mapping[str, str] | None = None,
                 hint: str = "", normalize: Callable[[str], str] = _default_key) -> str:
    """The one wording of every unknown name: "unknown KIND 'x'; did you mean y? use one of: a, b, c{hint}".

    ``listed``: what the message lists; ``guesses``: normalized word -> the name suggested for it (default: the
    listed names), the closest to ``normalize(name)`` suggested. ``Registry.unknown`` says it for one registry;
    a refusal over several (an eval row: a scheme, a named row or a preset) says it too."""
    guesses = guesses if guesses is not None else {normalize(n): n for n in listed}
    close = difflib.get_close_matches(normalize(str(name)), list(guesses), n=1, cutoff=0.6)
    guess = f"did you mean {guesses[close[0]]}? " if close else ""
    return f"unknown {kind} {name!r}; {guess}use one of: {', '.join(listed)}{hint}"


class Registry(Generic[T]):
    """Names -> values of one kind, with aliases, pattern families and "did you mean" errors."""

    def __init__(
        self,
        kind: str,
        *,
        error: type[QkitError] = InputError,
        normalize: Callable[[str], str] = _default_key,
        hint: str = "",
    ) -> None:
        self.kind = kind
        self.error = error
        self.normalize = normalize
        self.hint = hint  # appended to an unknown-name error, e.g. "; int{4,8}-gN for any group size N"
        self._entries: dict[str, T] = {}  # canonical name -> value, in registration order
        self._keys: dict[str, str] = {}  # normalized name or alias -> canonical name
        self._families: list[tuple[re.Pattern[str], Callable[[re.Match[str]], T], str]] = []

    # ------------------------------------------------------------------ registering

    def register(self, name: str, value: T, *, aliases: tuple[str, ...] = ()) -> T:
        """Register ``value`` under ``name`` (and ``aliases``); a name taken twice is a programming error."""
        for key in (name, *aliases):
            k = self.normalize(key)
            if k in self._keys and self._keys[k] != name:
                raise ValueError(f"{self.kind} {key!r} is registered twice ({self._keys[k]!r} and {name!r})")
            self._keys[k] = name
        self._entries[name] = value
        return value

    def unregister(self, name: str) -> T:
        """Take ``name`` (a registered name, not an alias) and its aliases out; returns its value. An
        unknown name is a programming error (``KeyError``)."""
        value = self._entries.pop(name)
        for key in [k for k, canonical in self._keys.items() if canonical == name]:
            del self._keys[key]
        return value

    @contextlib.contextmanager
    def temporarily(self, name: str, value: T, *, aliases: tuple[str, ...] = ()) -> Iterator[T]:
        """Register ``value`` under ``name`` for the ``with`` block, then unregister it: the registry is as
        it was afterwards, even on an exception. A name already taken is refused as ``register`` refuses it."""
        if self.canonical(name) is not None:
            raise ValueError(f"{self.kind} {name!r} is registered already; temporarily registers a new name")
        self.register(name, value, aliases=aliases)
        try:
            yield value
        finally:
            self.unregister(name)

    def decorator(self, name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[T], T]:
        """``@REGISTRY.decorator("name")`` over a class or function registers it under ``name``."""

        def wrap(value: T) -> T:
            return self.register(name, value, aliases=aliases)

        return wrap

    def register_family(self, pattern: str, factory: Callable[[re.Match[str]], T], example: str = "") -> None:
        """Names matching ``pattern`` (a regular expression over the normalized name, matched whole) are
        made by ``factory(match)``; ``example`` is how the family is written in error messages."""
        self._families.append((re.compile(pattern), factory, example))

    # ------------------------------------------------------------------ looking up

    def find(self, name: str) -> T | None:
        """The value called ``name`` (a registered name, an alias or a family member), or None."""
        k = self.normalize(str(name))
        if k in self._keys:
            return self._entries[self._keys[k]]
        for pattern, factory, _ in self._families:
            m = pattern.fullmatch(k)
            if m:
                return factory(m)
        return None

    def get(self, name: str) -> T:
        """The value called ``name``, or ``self.error``: "unknown KIND 'x'; did you mean y? use one of: ..."
        (``unknown_name``, the one wording of every kind)."""
        value = self.find(name)
        if value is None:
            raise self.error(self.unknown(name))
        return value

    def unknown(self, name: str) -> str:
        """The one-line message for an unknown ``name`` (``unknown_name``: every name and alias is a guess)."""
        families = [ex for _, _, ex in self._families if ex]
        return unknown_name(self.kind, name, [*self._entries, *families], guesses=self._keys, hint=self.hint,
                            normalize=self.normalize)

    def canonical(self, name: str) -> str | None:
        """The registered name ``name`` (or its alias) stands for, or None (families have no canonical name)."""
        return self._keys.get(self.normalize(str(name)))

    def names(self) -> list[str]:
        """Registered names in registration order (aliases and family members not included)."""
        return list(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["Registry", "unknown_name"]
