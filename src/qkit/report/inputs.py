"""The JSON files a report is built from: what each is (detected from its content), checked to belong together.

Every qkit command's ``--json`` has a shape of its own, so a file's kind is read from its keys, never from
its name:

========================  ================================================================  ==========
kind                      written by                                                        recognised by
========================  ================================================================  ==========
``eval``                  ``qkit eval --json``                                              ``rows`` and ``provenance.qkit_version``
``errors``                ``qkit inspect errors --json``                                    ``matrices`` with ``rel_error``, ``schemes``
``outliers``              ``qkit inspect outliers --json``                                  ``per_layer``, ``outlier_dims``, ``histogram``, ``int8``
``sensitivity``           ``qkit inspect sensitivity --json``                               ``units``, ``by``, ``scheme``, ``suggestion``
``plan``                  ``qkit plan -o``                                                  ``"format": "qkit-plan"``
``kv``                    ``qkit kv --json``                                                ``architecture``, ``bytes_per_token``, ``variants``
``budget``                ``qkit budget --json``                                            ``tables``, ``models``, ``formats``, ``reserve_gib``
========================  ================================================================  ==========

Refused in one line each (``InputError``), before any work: a file that is missing, unreadable or not JSON,
a JSON no qkit command writes, two files of one kind, a file that records another ``qkit_version`` (every
``--json`` records it; an older inspect, kv or budget JSON without one is not checked), and files of
different models. A
model is named by what the user passed (``ModelRef.spec``), so a path is compared by where it resolves.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkit import reading
from qkit.errors import InputError
from qkit.evaluation.measures import json_fields
from qkit.jsontext import first_nonfinite
from qkit.jsonfields import (
    BOOL,
    CHANGE_PCT,
    COUNT,
    LIST,
    MEASURE,
    NULL,
    NUMBER,
    SIGNED,
    STRING,
    Kind,
    check,
    list_of,
    obj,
    ranged,
)
from qkit.plan.planfile import PLAN_FORMAT, PLAN_VERSION
from qkit.version import __version__

KINDS = ("eval", "errors", "outliers", "sensitivity", "plan", "kv", "budget")
# The command that writes each kind (for messages and the page's notes).
COMMANDS = {
    "eval": "qkit eval --json EVAL.json",
    "errors": "qkit inspect errors --json ERRORS.json",
    "outliers": "qkit inspect outliers --json OUTLIERS.json",
    "sensitivity": "qkit inspect sensitivity --scheme SCHEME --json SENSITIVITY.json",
    "plan": "qkit plan --target-bits B -o PLAN.json",
    "kv": "qkit kv --json KV.json",
    "budget": "qkit budget default --json BUDGET.json",
}
_MAX_BYTES = 256 * 1024**2  # a qkit JSON is far smaller; a larger file is not one


# --------------------------------------------------------------------------- the fields the page reads, per kind
#
# Every field ``qkit.report.data`` and ``page`` read, with the JSON type it must have (``qkit.jsonfields``):
# a hand-edited or foreign file of the right kind but the wrong shape is one line naming the field, before
# any step runs, never a traceback while the page is drawn. Fields the page indexes directly are required
# (``_needs``); numbers it converts to integers or plots are finite and bounded.


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# a plotted number: finite and far from overflow (a 400-digit JSON integer is compared exactly, never made a float)
FINITE = Kind("a number from -1e30 to 1e30", "numbers from -1e30 to 1e30",
              lambda v: (_is_int(v) or isinstance(v, float)) and -1e30 <= v <= 1e30)
SCALAR = STRING | NUMBER | BOOL | NULL  # shown as text (``str()``): anything but an object or a list
TEXT = STRING | NULL


# What each number means bounds it (``qkit.jsonfields``: MEASURE, PERPLEXITY, CHANGE_PCT, SIGNED, PROBABILITY,
# COUNT); bits per weight at most 64 (no stored type takes more); sizes whole bytes up to 1 EiB.
BITS = ranged(0, 64)
BYTES = Kind("a whole number from 0 to 2**60 or null", "whole numbers from 0 to 2**60",
             lambda v: v is None or (_is_int(v) and 0 <= v <= 2**60))


def _needs(kind: Kind, *keys: str) -> Kind:
    """``kind`` (an object) that also has every key of ``keys``."""
    return Kind(f"{kind.name} with {', '.join(keys)}", kind.plural, lambda v: kind.test(v) and all(k in v for k in keys),
                kind.fields, kind.values, kind.items)


_ARCH = obj({"name": SCALAR}) | NULL
# a row's spec names its simulations ``simulation``; an eval JSON written before they had that word, ``runtime``
_SPEC = obj({"plan": SCALAR, "simulation": LIST | SCALAR, "runtime": LIST | SCALAR}) | NULL
# a row's measures (perplexity, KL, battery, ...) give their own fields' types (``evaluation.measures``)
_ROW = obj({"scheme": SCALAR, "runtime": TEXT, "refused": SCALAR, "spec": _SPEC,
            "bits_per_weight": BITS, "size_bytes": BYTES, **json_fields(),
            "versus_torch": obj({"against": SCALAR, "perplexity_change_pct": CHANGE_PCT, "perplexity_change_se_pct": MEASURE,
                                 "kld_change": SIGNED, "kld_change_se": MEASURE}) | NULL,
            "engine": obj({"version": SCALAR}) | NULL})
_TYPICAL = list_of(_needs(obj({"dim": SCALAR, "levels": SCALAR}), "dim", "levels"))
_INT8_PART = obj({"levels_used": SCALAR, "levels_total": SCALAR, "typical": _TYPICAL | NULL, "scale": MEASURE}) | NULL
SCHEMAS: dict[str, Kind] = {
    "eval": obj({"rows": list_of(_ROW), "notes": list_of(SCALAR) | NULL,
                 "provenance": obj({"model": SCALAR, "qkit_version": TEXT, "torch_version": SCALAR, "window": SCALAR,
                                    "scored_tokens": COUNT | SCALAR, "seconds_total": MEASURE,
                                    "corpus": obj({"name": SCALAR, "sha256": SCALAR}) | NULL,
                                    "model_source": obj({"sha256": SCALAR}) | NULL})}),
    "errors": obj({"model": SCALAR, "seconds": MEASURE,
                   "matrices": list_of(_needs(obj({"name": STRING, "scheme": SCALAR, "rel_error": MEASURE}), "name", "scheme")),
                   "schemes": list_of(_needs(obj({"scheme": STRING, "matrices": SCALAR, "worst_matrix": SCALAR, "bits_per_weight": BITS,
                                                  "mean": MEASURE, "median": MEASURE, "worst": MEASURE}), "scheme"))}),
    "outliers": obj({"model": SCALAR, "layer": SCALAR, "hidden": SCALAR, "tokens": SCALAR, "source": SCALAR, "threshold": SCALAR,
                     "seconds": MEASURE,
                     "histogram": list_of(_needs(obj({"lo": FINITE, "hi": FINITE, "count": COUNT}), "lo", "hi", "count")),
                     "per_layer": list_of(_needs(obj({"layer": COUNT, "median_dim_max": FINITE}), "layer", "median_dim_max")),
                     "outlier_dims": list_of(_needs(obj({"dim": COUNT, "values": list_of(FINITE) | NULL, "layers": LIST | NULL,
                                                         "peak": MEASURE,
                                                         "n_layers": COUNT | NULL, "layer_ranges": SCALAR, "peak_layer": SCALAR,
                                                         "near_peak_layers": SCALAR}), "dim")),
                     "int8": obj({"excluded_dims": LIST | NULL, "all": _INT8_PART, "without_top": _INT8_PART}) | NULL}),
    "sensitivity": obj({"model": SCALAR, "by": TEXT, "scheme": SCALAR, "tokens": SCALAR, "source": SCALAR, "note": SCALAR,
                        "seconds": MEASURE,
                        "suggestion": obj({"sentence": SCALAR}) | NULL,
                        "units": list_of(obj({"name": SCALAR, "kl": MEASURE, "rel_error": MEASURE, "input_outlier_dims": LIST | NULL}))}),
    "plan": obj({"model": SCALAR, "model_fingerprint": SCALAR, "target_format": SCALAR, "target": obj(values=SCALAR) | NULL,
                 "tensors": obj(values=_needs(obj({"type": SCALAR, "shape": list_of(COUNT), "bytes": COUNT}), "shape", "bytes")) | NULL,
                 "totals": obj({"bytes": COUNT | NULL, "predicted_kl": MEASURE, "bits_per_weight": BITS}) | NULL}),
    "kv": obj({"architecture": _ARCH, "tokens": COUNT, "users": SCALAR, "dtype": SCALAR,
               "variants": list_of(_needs(obj({"attention": STRING, "kv_heads": COUNT, "bytes_per_token": COUNT,
                                               "total_bytes": COUNT}), "attention", "kv_heads", "bytes_per_token", "total_bytes"))}),
    "budget": obj({"conversation": COUNT, "reserve_gib": SCALAR, "kv_dtype": SCALAR,
                   "models": list_of(obj({"label": SCALAR, "architecture": _ARCH})),
                   "tables": list_of(_needs(obj({"gpu_gib": ranged(0, 2**20), "rows": list_of(_needs(obj({
                       "model": SCALAR, "format": SCALAR, "status": SCALAR, "max_tokens": COUNT, "weight_bytes": COUNT,
                       "conversations": COUNT}), "format", "max_tokens", "weight_bytes", "conversations"))}), "gpu_gib"))}),
}


@dataclass
class Inputs:
    """The report's data: ``docs[kind]`` is the parsed JSON of that kind; ``paths[kind]`` where it came from
    (``None``: computed by this run); ``seconds[kind]`` how long a computed step took."""

    docs: dict[str, dict] = field(default_factory=dict)
    paths: dict[str, str | None] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def get(self, kind: str) -> dict | None:
        return self.docs.get(kind)

    def model(self) -> str | None:
        """The model every document is of (the first one that names it), or None when none does."""
        for kind in KINDS:
            doc = self.docs.get(kind)
            if doc is not None:
                names = model_names(kind, doc)
                if names:
                    return names[0]
        return None


def detect_kind(doc: Any) -> str | None:
    """The kind (one of ``KINDS``) of a parsed qkit JSON, from its keys; None for anything else."""
    if not isinstance(doc, dict):
        return None
    keys = set(doc)
    prov = doc.get("provenance")
    if isinstance(doc.get("rows"), list) and isinstance(prov, dict) and "qkit_version" in prov:
        return "eval"
    if doc.get("format") == PLAN_FORMAT:
        return "plan"
    if {"per_layer", "outlier_dims", "histogram", "int8", "layer", "hidden"} <= keys:
        return "outliers"
    if {"units", "by", "scheme", "suggestion"} <= keys and isinstance(doc["units"], list):
        return "sensitivity"
    if {"matrices", "schemes", "model"} <= keys and isinstance(doc["matrices"], list) and all(
            isinstance(m, dict) and "rel_error" in m and "scheme" in m for m in doc["matrices"]):
        return "errors"
    if {"architecture", "bytes_per_token", "variants", "equivalent_splits"} <= keys:
        return "kv"
    if {"tables", "models", "formats", "reserve_gib"} <= keys:
        return "budget"
    return None


def model_names(kind: str, doc: dict) -> list[str]:
    """The model(s) a document is of: one name, or for ``budget`` every model it tabulates."""
    if kind == "eval":
        name = (doc.get("provenance") or {}).get("model")
    elif kind == "kv":
        name = (doc.get("architecture") or {}).get("name")
    elif kind == "budget":
        return [str((m.get("architecture") or {}).get("name")) for m in doc.get("models") or []
                if isinstance(m, dict) and (m.get("architecture") or {}).get("name")]
    else:
        name = doc.get("model")
    return [str(name)] if name else []


def version_of(kind: str, doc: dict) -> str | None:
    """The ``qkit_version`` a document records (eval: in ``provenance``; every other kind at the top:
    ``--json`` adds it), else None (a file written before the inspect, kv and budget JSONs recorded it)."""
    if kind == "eval":
        return (doc.get("provenance") or {}).get("qkit_version")
    return doc.get("qkit_version") or None


def same_model(a: str, b: str) -> bool:
    """Whether two recorded model names are one model: equal, or paths resolving to the same place."""
    if a == b:
        return True
    try:
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def read_json(path: str | os.PathLike) -> tuple[str, dict]:
    """``(kind, document)`` of one file; refused in one line if it is not a qkit JSON of this version."""
    p = Path(path)
    try:
        if p.is_dir():
            raise InputError(f"{p} is a directory; give the JSON files qkit eval, inspect, plan, kv or budget wrote")
        fix = "give the --json output of a qkit command"
        size = reading.check_file(p, str(p), fix).st_size  # a FIFO or a device: refused before it is opened
        if size > _MAX_BYTES:
            raise InputError(f"{p} is larger than any qkit JSON ({size:,} bytes); {fix}")
        doc = json.loads(reading.read_bytes(p, str(p), fix, limit=_MAX_BYTES))
    except RecursionError:
        raise InputError(f"{p} is nested too deeply to be a qkit JSON; give the --json output of a qkit command") from None
    except FileNotFoundError:
        raise InputError(f"{p}: no such file; give the --json output of qkit eval, inspect, plan, kv or budget") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or "not JSON"
        raise InputError(f"{p} is not a readable JSON file ({why}); give the --json output of a qkit command") from None
    kind = detect_kind(doc)
    if kind is None:
        raise InputError(f"{p} is not a JSON that qkit eval, inspect errors/outliers/sensitivity, plan, kv or budget "
                         "writes; give one of those")
    if kind == "plan" and doc.get("format_version") != PLAN_VERSION:
        raise InputError(f"{p} is a plan of format_version {doc.get('format_version')!r}; this qkit reads "
                         f"{PLAN_VERSION}: re-plan with this qkit")
    check(doc, SCHEMAS[kind], str(p), error=InputError, fix=f"give the file {COMMANDS[kind].split(' --')[0]} wrote")
    nonfinite = first_nonfinite(doc)  # NaN or Infinity anywhere else: qkit writes null, never these (qkit.jsontext)
    if nonfinite is not None:
        raise InputError(f"{p}: {nonfinite[0]} is {nonfinite[1]!r}, not a finite number; give the file "
                         f"{COMMANDS[kind].split(' --')[0]} wrote")
    version = version_of(kind, doc)
    if version is not None and version != __version__:
        raise InputError(f"{p} was written by qkit {version}, this is qkit {__version__}: its numbers may not mean "
                         f"the same; re-run it with this qkit ({COMMANDS[kind]})")
    return kind, doc


def read_inputs(paths: list[str | os.PathLike]) -> Inputs:
    """Read, classify and cross-check every file (see the module docstring); nothing heavy is done."""
    inputs = Inputs()
    for path in paths:
        kind, doc = read_json(path)
        if kind in inputs.docs:
            raise InputError(f"{path} and {inputs.paths[kind]} are both {kind} JSONs; give one file of each kind")
        inputs.docs[kind], inputs.paths[kind] = doc, os.fspath(path)
    check_one_model(inputs)
    return inputs


def check_one_model(inputs: Inputs) -> None:
    """Refuse documents of different models (a budget may tabulate several models: one must be this one)."""
    first: tuple[str, str] | None = None  # (model, kind)
    for kind in KINDS:
        doc = inputs.docs.get(kind)
        if doc is None or kind == "budget":
            continue
        for name in model_names(kind, doc):
            if first is None:
                first = (name, kind)
            elif not same_model(name, first[0]):
                raise InputError(f"{_where(inputs, kind)} is of model {name!r} but {_where(inputs, first[1])} is of "
                                 f"{first[0]!r}; a report is of one model: give files of one model")
    budget = inputs.docs.get("budget")
    if budget is not None and first is not None:
        names = model_names("budget", budget)
        if not any(same_model(n, first[0]) for n in names):
            raise InputError(f"{_where(inputs, 'budget')} tabulates {', '.join(map(repr, names)) or 'no model'}, not "
                             f"{first[0]!r} ({_where(inputs, first[1])}); run qkit budget on that model")


def _where(inputs: Inputs, kind: str) -> str:
    p = inputs.paths.get(kind)
    return p if p else f"the {kind} step this run computed"


__all__ = ["COMMANDS", "KINDS", "SCHEMAS", "Inputs", "check_one_model", "detect_kind", "model_names", "read_inputs",
           "read_json", "same_model", "version_of"]
