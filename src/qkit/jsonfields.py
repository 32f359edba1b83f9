"""Typed reads of the JSON files qkit did not write itself: a field of the wrong type is one line.

Layer 1 (beside ``errors``): ``checkpoint`` (3), ``models`` (4) and the exporters (5) use it.

A model's ``config.json``, its ``tokenizer_config.json``, a shard index, an export record: each is a
JSON document whose fields qkit reads with ``.get``. A hand-edited file can hold any JSON value in any
field (``"quantization_config": "abc"``), and a reader written for an object then fails with an
``AttributeError`` far from the cause. Every such read goes through ``check`` (a whole document against
a ``Kind``, e.g. a schema table of ``obj({key: kind})``) or ``field`` (one key), which refuse a wrong
type with one line naming the file, the field and what it should be::

    /m/config.json: quantization_config is 'abc' (a string), not an object or null; fix the config

A ``Kind`` is a JSON type with a name (``STRING``, ``OBJECT``, ``list_of(STRING)``, ``obj({...})``);
``a | b`` accepts either. Objects and lists are checked all the way down, so the line names the nested
field (``quantization_config.config_groups.group_0.weights.num_bits``). Keys a schema does not name are
not checked: qkit does not read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qkit.errors import ModelLoadError, QkitError


@dataclass(frozen=True)
class Kind:
    """A JSON type: ``name`` ("a string"), ``plural`` ("strings"), ``test`` on the value itself, and for
    an object the ``fields`` it names (checked when present) and the kind of ``values`` every other value
    has; for a list the kind of its ``items``."""

    name: str
    plural: str
    test: Callable[[Any], bool]
    fields: Mapping[str, Kind] | None = None
    values: Kind | None = None
    items: Kind | None = None

    def named(self, name: str) -> Kind:
        """This kind under another name in refusals ("an auto_map: an object or a list of class names")."""
        return Kind(name, self.plural, self.test, self.fields, self.values, self.items)

    def __or__(self, other: Kind) -> Kind:
        return Kind(f"{self.name} or {other.name}", f"{self.plural} or {other.plural}",
                    lambda v: self.test(v) or other.test(v),
                    self.fields or other.fields, self.values or other.values, self.items or other.items)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # bool is an int in Python; JSON's true is not


STRING = Kind("a string", "strings", lambda v: isinstance(v, str))
BOOL = Kind("a boolean", "booleans", lambda v: isinstance(v, bool))
INT = Kind("an integer", "integers", _is_int)
NUMBER = Kind("a number", "numbers", lambda v: _is_int(v) or isinstance(v, float))
NULL = Kind("null", "nulls", lambda v: v is None)
OBJECT = Kind("an object", "objects", lambda v: isinstance(v, dict))
LIST = Kind("a list", "lists", lambda v: isinstance(v, list))


# Bounded numbers, as a report reads them (``qkit.report.inputs``, the eval measures' ``fields``). What each
# number means bounds it: a standard error (drawn as an error bar), a measured error or KL (drawn on a log
# colour scale), seconds: never negative, and far from float overflow (1e30: a sum of a million of them stays
# finite). A perplexity is at least 1; its change at least -100%; a probability in [0, 1].
COUNT = Kind("a whole number from 0 to 2**53", "whole numbers from 0 to 2**53", lambda v: _is_int(v) and 0 <= v <= 2**53)


def ranged(lo: float, hi: float) -> Kind:
    """A finite number from ``lo`` to ``hi``, or null (not measured). NaN and infinities fail: a number a page
    shows or draws is in its range, never a 309-digit figure or a negative KL."""
    return Kind(f"a number from {lo:g} to {hi:g} or null", f"numbers from {lo:g} to {hi:g}",
                lambda v: v is None or ((_is_int(v) or isinstance(v, float)) and lo <= v <= hi))


MEASURE = ranged(0, 1e30)
PERPLEXITY = ranged(1, 1e30)
CHANGE_PCT = ranged(-100, 1e30)
SIGNED = ranged(-1e30, 1e30)
PROBABILITY = ranged(0, 1)


def obj(fields: Mapping[str, Kind] | None = None, values: Kind | None = None) -> Kind:
    """An object whose named ``fields`` (where present) and every other value (``values``) are checked."""
    name = f"an object of {values.plural}" if values is not None and not fields else "an object"
    return Kind(name, "objects", OBJECT.test, dict(fields) if fields else None, values)


def list_of(items: Kind) -> Kind:
    return Kind(f"a list of {items.plural}", f"lists of {items.plural}", LIST.test, items=items)


def describe(value: Any) -> str:
    """The JSON type of ``value`` in words: "a string", "a number", "an object", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def show(value: Any, limit: int = 60) -> str:
    """``value`` as the line shows it: JSON's words for null and booleans, a repr cut at ``limit``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check(value: Any, kind: Kind, where: str, name: str = "", *, error: type[QkitError] = ModelLoadError,
          fix: str = "fix the file") -> Any:
    """``value`` when it is of ``kind`` (and everything inside it, as the kind says); else ``error``, one line::

        {where}: {name} is {value} ({its type}), not {kind}; {fix}

    ``where``: the file (its path); ``name``: the field's path in it ("" for the whole document).
    """
    if not kind.test(value):
        what = f"{where}: {name}" if name else where
        raise error(f"{what} is {show(value)} ({describe(value)}), not {kind.name}; {fix}")
    if isinstance(value, dict):
        for key, v in value.items():
            sub = (kind.fields or {}).get(key, kind.values)
            if sub is not None:
                check(v, sub, where, f"{name}.{key}" if name else str(key), error=error, fix=fix)
    elif isinstance(value, list) and kind.items is not None:
        for i, v in enumerate(value):
            check(v, kind.items, where, f"{name}[{i}]", error=error, fix=fix)
    return value


def field(doc: Mapping[str, Any], key: str, kind: Kind, where: str, *, default: Any = None,
          error: type[QkitError] = ModelLoadError, fix: str = "fix the file", prefix: str = "") -> Any:
    """``doc[key]`` checked to be of ``kind`` (``check``), or ``default`` when the key is absent.

    ``doc`` must be an object (checked: a document read as JSON may be anything); ``prefix`` names where
    ``doc`` sits in its file (``"quantization_config"``), so the line names the full path of the field.
    """
    check(doc, OBJECT, where, prefix, error=error, fix=fix)
    if key not in doc:
        return default
    return check(doc[key], kind, where, f"{prefix}.{key}" if prefix else key, error=error, fix=fix)


__all__ = ["BOOL", "CHANGE_PCT", "COUNT", "INT", "LIST", "MEASURE", "NULL", "NUMBER", "OBJECT", "PERPLEXITY",
           "PROBABILITY", "SIGNED", "STRING", "Kind", "check", "describe", "field", "list_of", "obj", "ranged", "show"]
