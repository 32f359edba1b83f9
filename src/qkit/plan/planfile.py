"""A plan: per tensor, the chosen type, its exact bytes and its predicted cost, as a versioned JSON file.

``qkit plan`` writes it; ``qkit quantize --plan`` reads it back and writes exactly those types. A plan
names the model it was made for by a fingerprint of every tensor's name and shape (``qkit.transform.shapes_fingerprint``):
one made for another model is refused in one line, naming the first tensor that differs.

Layout (``format: "qkit-plan"``, ``format_version: 1``, keys sorted)::

    model, model_fingerprint, format (gguf | compressed-tensors | qkit), method, imatrix,
    target {bits | size | scheme, budget_bytes, file_bytes, outside_bytes, outside_tensors, weights, counts},
    tensors {name: {type, scheme (the scheme's dict, or null: unquantized), shape, bytes, predicted_kl,
                    lossless, candidates {type: [bytes, predicted_kl]}}},
    totals {bytes, weights, bits_per_weight, predicted_kl},
    check {measured_kl, measured_kl_se, positions, ...}, sensitivity {...}, solver {...}
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkit import jsontext, reading
from qkit.bounds import MAX_BYTES
from qkit.errors import InputError, SchemeError
from qkit.jsonfields import show
from qkit.plan.candidates import KEEP, ladder, native, plan_formats, stored_nbytes
from qkit.schemes.base import Scheme
from qkit.schemes.ggml import GGMLScheme
from qkit.schemes.registry import scheme_from_dict
from qkit.staging import write_text
from qkit.transform import shapes_fingerprint

PLAN_FORMAT = "qkit-plan"
PLAN_VERSION = 1



@dataclass
class TensorChoice:
    """One planned tensor: ``type`` (a scheme name or ``none``), ``scheme`` (None: kept unquantized)."""

    type: str
    scheme: Scheme | None
    shape: tuple[int, ...]
    nbytes: int
    predicted_kl: float
    lossless: bool = False
    candidates: dict[str, tuple[int, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "scheme": self.scheme.to_dict() if self.scheme is not None else None,
                "shape": list(self.shape), "bytes": self.nbytes, "predicted_kl": self.predicted_kl,
                "lossless": self.lossless, "candidates": {k: [b, c] for k, (b, c) in sorted(self.candidates.items())}}


@dataclass
class Plan:
    """What ``qkit plan`` chose (see the module docstring for the file)."""

    model: str
    model_fingerprint: str
    format: str
    method: str
    target: dict[str, Any]
    tensors: dict[str, TensorChoice]
    imatrix: dict | None = None
    sensitivity: dict[str, Any] = field(default_factory=dict)
    solver: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    qkit_version: str = ""
    path: Path | None = None  # where it was read from or written to

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def weights(self) -> int:
        n = 0
        for t in self.tensors.values():
            k = 1
            for d in t.shape:
                k *= d
            n += k
        return n

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / max(1, self.weights)

    @property
    def predicted_kl(self) -> float:
        return float(sum(t.predicted_kl for t in self.tensors.values()))

    def schemes(self) -> dict[str, Scheme | None]:
        """``{tensor: scheme}`` (None: kept unquantized) for the transform."""
        return {n: t.scheme for n, t in self.tensors.items()}

    def sha256(self) -> str:
        return hashlib.sha256(jsontext.dumps(self.to_dict(), what="the plan").encode()).hexdigest()

    def to_dict(self, timings: bool = False) -> dict[str, Any]:
        """The plan file's document. The same model, options and inputs give the same document, so the same
        file bytes and ``sha256``: how long each step took and a memory budget read from the machine are
        left out (``stable``); ``timings`` keeps them, for a ``--json`` report."""
        records = (self.sensitivity, self.solver, self.check)
        sensitivity, solver, check = records if timings else (stable(r) for r in records)
        return {
            "format": PLAN_FORMAT, "format_version": PLAN_VERSION, "qkit_version": self.qkit_version,
            "model": self.model, "model_fingerprint": self.model_fingerprint, "target_format": self.format,
            "method": self.method, "imatrix": self.imatrix, "target": self.target,
            "tensors": {n: t.to_dict() for n, t in sorted(self.tensors.items())},
            "totals": {"bytes": self.nbytes, "weights": self.weights, "bits_per_weight": self.bits_per_weight,
                       "predicted_kl": self.predicted_kl},
            "sensitivity": sensitivity, "solver": solver, "check": check,
        }

    def record(self) -> dict[str, Any]:
        """What a checkpoint's manifest says of the plan it was written from."""
        types: dict[str, int] = {}
        for t in self.tensors.values():
            types[t.type] = types.get(t.type, 0) + 1
        return {"sha256": self.sha256(), "file": str(self.path) if self.path else None, "target": self.target,
                "format": self.format, "bytes": self.nbytes, "predicted_kl": self.predicted_kl,
                "measured_kl": self.check.get("measured_kl"), "types": dict(sorted(types.items())),
                "lossless": sum(t.lossless and t.scheme is not None for t in self.tensors.values()),
                "method": self.method, "dtype": self.sensitivity.get("dtype"),
                **({"gptq": self.sensitivity["feedback"]["gptq"]} if self.method == "gptq" else {})}


def stable(record: Any) -> Any:
    """``record`` without what differs between two identical runs: every ``seconds`` (how long a step took,
    at any depth) and a memory budget read from the machine (a record with ``budget_from: available
    memory`` loses its ``budget_bytes``; one from ``--max-memory`` keeps it: the user gave it)."""
    if isinstance(record, dict):
        out = {k: stable(v) for k, v in record.items() if k != "seconds"}
        if out.get("budget_from") == "available memory":
            out.pop("budget_bytes", None)
        return out
    if isinstance(record, list):
        return [stable(v) for v in record]
    return record


def plan_llama_types(plan: Plan, names: Mapping[str, str], dtypes: Mapping[str, torch.dtype | None]) -> dict[str, str]:
    """``{llama.cpp name: ggml type}`` of every planned tensor (``names``: its llama.cpp name; a kept one: its
    source float type, as qkit's GGUF writer stores it), for ``llama-quantize --tensor-type-file``."""
    floats = {torch.float16: "F16", torch.bfloat16: "BF16"}
    out = {}
    for name, t in plan.tensors.items():
        s = t.scheme
        out[names[name]] = s.ggml_type.name if isinstance(s, GGMLScheme) else floats.get(dtypes.get(name), "F32")
    return out


MAX_KL = 1e30  # a predicted or measured KL (nats/token) a plan may hold: past any model's, far below overflow
MAX_PLAN_BYTES = 256 * 1024**2  # a plan of 50,000 tensors with every candidate is ~50 MB; a larger file is not one
PLAN_METHODS = ("rtn", "imatrix", "gptq")  # what ``qkit plan`` measures candidates by (``qkit plan --method``)
_SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the source dtypes a kept tensor's bytes may count


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON's true is not the integer 1


def _is_finite(v: Any) -> bool:
    """A number within ``MAX_KL``: finite, and summed over any plan's tensors still finite (1e308 + 1e308 is
    infinity: a plan of finite KLs near a float's limit wrote ``Infinity`` into config.json). A JSON integer
    of 400 digits is compared exactly, never made a float."""
    return (_is_int(v) or isinstance(v, float)) and -MAX_KL <= v <= MAX_KL


def _load(p: Path) -> Any:
    """The parsed JSON of ``p``; one line for a missing, oversized, unreadable, non-UTF-8 or too deeply nested file."""
    try:
        if p.is_dir():
            raise InputError(f"--plan {p} is a directory; give the plan file qkit plan -o wrote")
        fix = "give the file qkit plan -o wrote"
        size = reading.check_file(p, f"--plan {p}", fix).st_size  # a FIFO or a device: refused before it is opened
        if size > MAX_PLAN_BYTES:  # refused by its size, before a byte is read
            raise InputError(f"--plan {p} is {size:,} bytes, larger than any plan ({MAX_PLAN_BYTES:,}); {fix}")
        return json.loads(reading.read_bytes(p, f"--plan {p}", fix, limit=MAX_PLAN_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise InputError(f"--plan {p}: no such file; write one with qkit plan") from None
    except RecursionError:
        raise InputError(f"--plan {p}: nested too deeply to be a plan; write one with qkit plan") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        why = getattr(exc, "strerror", None) or (f"not UTF-8: {exc.reason} at byte {exc.start}" if isinstance(exc, UnicodeDecodeError) else exc)
        raise InputError(f"--plan {p}: not a readable JSON file ({why})") from None


def read_plan(path: str | Path) -> Plan:
    """A plan file back, every field checked; a malformed or foreign file is refused in one line."""
    p = Path(path)
    doc = _load(p)
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise InputError(f"--plan {p} is not a qkit plan (no \"format\": \"{PLAN_FORMAT}\"); write one with qkit plan")
    version = doc.get("format_version")
    if not _is_int(version) or version != PLAN_VERSION:
        raise InputError(f"--plan {p} has format_version {version!r}; this qkit reads {PLAN_VERSION}: re-plan")
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise InputError(f"--plan {p} names no tensors; re-plan")
    for name, t in tensors.items():  # each entry's own fields first, then what they mean in the plan's format
        _entry_fields(p, name, t)
    for key, kind in (("model", str), ("model_fingerprint", str), ("target_format", str), ("method", str), ("target", dict)):
        if not isinstance(doc.get(key), kind):
            raise InputError(f"--plan {p}: {key!r} is missing or not a {kind.__name__}; re-plan")
    fmt = doc["target_format"]
    if fmt not in plan_formats():
        raise InputError(f"--plan {p}: target_format {fmt!r} is not one qkit plans for ({', '.join(plan_formats())}); re-plan")
    if doc["method"] not in PLAN_METHODS:
        raise InputError(f"--plan {p}: method {doc['method']!r} is not one qkit plans with ({', '.join(PLAN_METHODS)}); re-plan")
    for key in ("imatrix", "sensitivity", "solver", "check"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise InputError(f"--plan {p}: {key!r} is {type(doc[key]).__name__}, not an object or null; re-plan")
    if doc.get("imatrix") is not None and not isinstance(doc["imatrix"].get("sha256"), str):
        raise InputError(f"--plan {p}: its imatrix record has no sha256; re-plan")
    if doc["method"] == "gptq":  # the GPTQ options its costs were measured with (what quantize must use)
        feedback = (doc.get("sensitivity") or {}).get("feedback")
        options = feedback.get("gptq") if isinstance(feedback, dict) else None
        if not (isinstance(options, dict) and options and all(isinstance(k, str) and isinstance(v, (bool, int, float, str))
                                                               for k, v in options.items())):
            raise InputError(f"--plan {p}: a gptq plan needs sensitivity.feedback.gptq, the GPTQ options it was priced "
                             "with (an object of names and values); re-plan")
    for key in ("measured_kl", "measured_kl_se"):
        v = (doc.get("check") or {}).get(key)
        if v is not None and not (_is_finite(v) and v >= 0):
            raise InputError(f"--plan {p}: check.{key} is {show(v)}, not a number from 0 to {MAX_KL:g}; re-plan")
    if not isinstance(doc.get("qkit_version", ""), str):
        raise InputError(f"--plan {p}: qkit_version is not a string; re-plan")
    nonfinite = jsontext.first_nonfinite(doc)  # NaN, Infinity or 1e999 in a field the checks above do not read
    if nonfinite is not None:  # (the target, the records): it would reach the checkpoint's config.json
        raise InputError(f"--plan {p}: {nonfinite[0]} is {nonfinite[1]!r}, not a finite number; re-plan")
    out: dict[str, TensorChoice] = {name: _choice(p, fmt, name, t) for name, t in tensors.items()}
    return Plan(doc["model"], doc["model_fingerprint"], fmt, doc["method"], doc["target"], out,
                imatrix=doc.get("imatrix"), sensitivity=doc.get("sensitivity") or {}, solver=doc.get("solver") or {},
                check=doc.get("check") or {}, qkit_version=str(doc.get("qkit_version", "")), path=p)


def _entry_fields(path: Path, name: str, t: Any) -> None:
    """One tensor's entry: every field of the right type and range (``_choice`` reads it in its format)."""
    if not name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InputError(f"--plan {path}: the tensor name {name!r} holds control characters; no model has it: re-plan")
    bad = f"--plan {path}: the entry of {name}"
    if not isinstance(t, dict):
        raise InputError(f"{bad} is not an object; re-plan")
    shape, nbytes, kl, type_ = t.get("shape"), t.get("bytes"), t.get("predicted_kl"), t.get("type")
    if not (isinstance(shape, list) and shape and all(_is_int(d) and d > 0 for d in shape)):
        raise InputError(f"{bad} has shape {show(shape)}, not positive integers; re-plan")
    if not (_is_int(nbytes) and nbytes > 0):  # exact: _choice compares it with what the format stores
        raise InputError(f"{bad} has bytes {show(nbytes)}, not a positive integer; re-plan")
    if not (_is_finite(kl) and kl >= 0):
        raise InputError(f"{bad} has predicted_kl {show(kl)}, not a number from 0 to {MAX_KL:g}; re-plan")
    if not isinstance(type_, str):
        raise InputError(f"{bad} has type {type_!r}, not a type name; re-plan")
    if not isinstance(t.get("lossless", False), bool):
        raise InputError(f"{bad} has lossless {t.get('lossless')!r}, not true or false; re-plan")
    cands = t.get("candidates", {})
    if not (isinstance(cands, dict) and all(
            isinstance(v, list) and len(v) == 2 and _is_int(v[0]) and 0 < v[0] <= MAX_BYTES and _is_finite(v[1])
            for v in cands.values())):
        raise InputError(f"{bad} has candidates that are not {{type: [bytes, predicted_kl]}}; re-plan")


def _choice(path: Path, fmt: str, name: str, t: dict) -> TensorChoice:
    bad = f"--plan {path}: the entry of {name}"
    shape, nbytes, kl, type_ = t["shape"], t["bytes"], t["predicted_kl"], t["type"]
    if len(shape) != 2:
        raise InputError(f"{bad} has shape {show(shape)}; a planned tensor is 2-D [out, in]: re-plan")
    if type_ not in ladder(fmt):
        raise InputError(f"{bad} has type {type_!r}, which --format {fmt} does not plan ({', '.join(ladder(fmt))}); re-plan")
    scheme = None
    if t.get("scheme") is not None:
        try:
            scheme = scheme_from_dict(t["scheme"])
        except (SchemeError, InputError, TypeError, KeyError, ValueError, AttributeError) as exc:
            raise InputError(f"{bad}: {exc}") from None
        if scheme.name != type_:
            raise InputError(f"{bad} says type {type_} but stores scheme {scheme.name}; re-plan")
    elif type_ != KEEP:
        raise InputError(f"{bad} has type {type_} and no scheme; re-plan")
    shape2 = (shape[0], shape[1])
    if scheme is not None and not native(fmt, scheme, shape2):
        raise InputError(f"{bad}: {type_} does not store a {show(shape)} tensor as itself; re-plan")
    # the bytes the format writes for it: exact, whatever the source dtype was (only a kept tensor's and
    # compressed-tensors' scales depend on it)
    if nbytes not in {stored_nbytes(fmt, scheme, shape2, d) for d in _SOURCE_DTYPES}:
        raise InputError(f"{bad} has bytes {nbytes:,}, not what --format {fmt} stores for a {show(shape)} {type_} tensor; re-plan")
    return TensorChoice(type_, scheme, shape2, nbytes, float(kl), t.get("lossless", False))


def check_plan_matches(plan: Plan, shapes: Mapping[str, tuple[int, ...]], spec: str) -> None:
    """Refuse a plan made for another model: a planned tensor the model lacks or with another shape."""
    for name, t in sorted(plan.tensors.items()):
        if name not in shapes:
            raise InputError(f"--plan {plan.path or ''} was made for {plan.model}: {name} is not a tensor of {spec}; "
                             "plan for this model with qkit plan")
        if tuple(shapes[name]) != tuple(t.shape):
            raise InputError(f"--plan {plan.path or ''} was made for {plan.model}: {name} is {list(t.shape)} there and "
                             f"{list(shapes[name])} in {spec}; plan for this model with qkit plan")
    if shapes_fingerprint(shapes.items()) != plan.model_fingerprint:
        raise InputError(f"--plan {plan.path or ''} was made for {plan.model}, whose tensors differ from {spec}'s; "
                         "plan for this model with qkit plan")


def write_plan(plan: Plan, path: str | Path) -> None:
    write_text(path, jsontext.dumps(plan.to_dict(), what=f"-o {path}", indent=1) + "\n", what="-o")
    plan.path = Path(path)


def is_plan_file(path: Path) -> bool:
    """Whether ``path`` is a plan qkit wrote (what --force may replace)."""
    try:
        p = Path(path)
        if p.stat().st_size > MAX_PLAN_BYTES:
            return False
        return json.loads(p.read_text(encoding="utf-8")).get("format") == PLAN_FORMAT
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return False


def base_type(plan: Plan) -> str:
    """The type that holds the most planned weights (the plan's "base")."""
    weights: dict[str, int] = {}
    for t in plan.tensors.values():
        weights[t.type] = weights.get(t.type, 0) + math.prod(t.shape)
    return max(sorted(weights), key=lambda k: weights[k])


def lossless_types(plan: Plan) -> dict[str, int]:
    """``{type: tensors}``: the planned types that reproduce their tensors' source weights exactly (predicted
    KL 0: the source already lies on that type's grid, e.g. a model published in it), and how many planned
    tensors each holds so; by count, most first (ties by name). Tensors kept unquantized are not counted."""
    counts: dict[str, int] = {}
    for t in plan.tensors.values():
        if t.lossless and t.scheme is not None:
            counts[t.type] = counts.get(t.type, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def upgrades(plan: Plan) -> list[dict]:
    """Tensors stored in more bytes than the base type would take for them, with why: the predicted KL
    the base type would cost them against what the chosen type costs, per extra byte."""
    base = base_type(plan)
    out = []
    for name, t in sorted(plan.tensors.items()):
        at_base = t.candidates.get(base)
        if at_base is None or t.nbytes <= at_base[0]:
            continue
        out.append({"tensor": name, "type": t.type, "base": base, "extra_bytes": t.nbytes - at_base[0],
                    "kl_at_base": at_base[1], "kl": t.predicted_kl,
                    "kl_saved_per_mb": (at_base[1] - t.predicted_kl) / ((t.nbytes - at_base[0]) / 1e6)})
    return out


__all__ = ["plan_llama_types", "base_type", "lossless_types", "upgrades", "MAX_PLAN_BYTES", "PLAN_FORMAT", "PLAN_METHODS", "PLAN_VERSION", "Plan", "TensorChoice", "check_plan_matches", "is_plan_file",
           "read_plan", "stable", "write_plan"]
