"""llama.cpp's converter, run for qkit in a subprocess of its own. Never imports qkit.

Started by ``qkit.export.gguf.converter`` as ``python _converter_worker.py JOB.json`` with ``PYTHONPATH`` =
a shim folder (a stub ``sentencepiece`` when the real one is not installed), the converter's own
``gguf-py`` (it clashes with the ``gguf`` package qkit installs) and the converter's folder. The job names
models, and for each what to do; the result (``JOB.json``'s ``result`` path) says, per model, what was
done or why not (``error``: ``kind`` and a one-line ``message``), and the process's peak memory.

Per model, in this order, so that a model the converter refuses costs no tensor work:

1. **class**: the architecture (``get_model_architecture``) and the converter's class for it.
2. **vocab**: the class's ``set_vocab`` on an instance of its own (its writer thrown away): a tokenizer
   the converter cannot convert fails here, before any tensor is read. A job with ``"vocab": false`` (a
   model converted from a GGUF, whose own ``tokenizer.*`` fields the caller copies) skips it, and its F32
   file has no ``tokenizer.*`` field.
3. **convert** (``f32``: the output path): exactly what ``convert_hf_to_gguf.py MODEL --outtype f32
   --outfile OUT`` does with every other option at its default: the class instantiated the same way,
   ``write()`` under ``torch.inference_mode()``.
4. **rows** (an output prefix): where the converter puts each Hugging Face tensor's rows. The class's own
   ``prepare_tensors`` (so its ``filter_tensors``, ``modify_tensors``, expert buffers, fused splits and
   skips, exactly) runs three times on *probe* tensors of each tensor's real shape instead of its data:
   ``S`` (every element the tensor's index + 0.5), ``R`` (its row: the flat index over all dimensions but
   the last; a 1-D tensor's element index), ``C`` (its column; 0 for a 1-D tensor), all float32, exact
   below 2**24. Each tensor the converter adds is reduced at once to per-row summaries (first value, whether
   the row is constant, whether it counts up by one), so memory stays that of one tensor. Combined: a GGUF
   row that is constant in ``S`` and ``R`` and counts 0, 1, ... in ``C`` is one Hugging Face row moved whole
   (``rows``); constant in ``S`` and ``C`` and counting up in ``R`` is one column of one expert's matrix
   (``transposed``); anything else (a value changed, as Gemma's norm + 1, or columns reordered) is
   ``other``. Written as ``PREFIX.json`` and ``PREFIX.npz`` (plain integer arrays).
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

STUB_MARK = "qkit-sentencepiece-stub"  # the stub's error says this (the shim's sentencepiece/__init__.py)
EXACT = 1 << 24  # float32 holds every integer below this exactly


class Refused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"


def model_class(model: Path):
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    try:
        hparams = ModelBase.load_hparams(model, False)
        arch = get_model_architecture(hparams, ModelType.TEXT)
    except Exception as exc:  # noqa: BLE001 - the converter raises many types for a config it cannot read
        raise Refused("config", one_line(exc)) from None
    try:
        return arch, get_model_class(arch, mmproj=False)
    except (NotImplementedError, KeyError):
        raise Refused("architecture", arch) from None


def instance(cls, model: Path, out: Path, *, eager: bool = False):
    import gguf

    return cls(model, gguf.LlamaFileType.ALL_F32, out, eager=eager)


def check_vocab(cls, model: Path, scratch: Path) -> None:
    try:
        instance(cls, model, scratch / "vocab.gguf").set_vocab()
    except Exception as exc:  # noqa: BLE001 - every tokenizer failure becomes one line
        kind = "sentencepiece" if STUB_MARK in str(exc) else "tokenizer"
        raise Refused(kind, one_line(exc)) from None


def convert(cls, model: Path, out: Path, *, vocab: bool = True) -> None:
    """``vocab=False``: no ``tokenizer.*`` field (``set_vocab`` not run): the caller has the model's own."""
    converter = instance(cls, model, out)
    if not vocab:
        converter.set_vocab = lambda: None  # the instance's own: the class is the converter's, unchanged
    with torch.inference_mode():
        converter.write()


# --- the row map -----------------------------------------------------------------------------------


def rows_view(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, 1) if a.ndim <= 1 else a.reshape(-1, a.shape[-1])


def summary(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``a`` (1-D: one element a row): its first value, whether it is constant, whether it
    counts up by one from its first value (compared only on the rows that are not constant: a constant row
    of more than one column does not count up)."""
    v = rows_view(a)
    first = v[:, 0].astype(np.float64)
    const = (v == v[:, :1]).all(axis=1)
    step = const.copy() if v.shape[1] == 1 else np.zeros_like(const)
    varied = np.flatnonzero(~const)
    if len(varied):
        step[varied] = (v[varied] == v[varied, :1] + np.arange(v.shape[1], dtype=np.float32)).all(axis=1)
    return first, const, step


def probe(kind: str, index: int, shape: tuple[int, ...]) -> torch.Tensor:
    if kind == "S":
        return torch.full(shape, index + 0.5, dtype=torch.float32)
    if len(shape) <= 1:
        n = shape[0] if shape else 1
        values = torch.arange(n, dtype=torch.float32) if kind == "R" else torch.zeros(n, dtype=torch.float32)
        return values.reshape(shape)
    lead, cols = int(np.prod(shape[:-1])), shape[-1]
    if kind == "R":
        return torch.arange(lead, dtype=torch.float32).reshape(*shape[:-1], 1).expand(shape).contiguous()
    return torch.arange(cols, dtype=torch.float32).expand(shape).contiguous()


def probe_class(cls, names: dict[str, str | None]):
    """``cls`` with ``filter_tensors`` recording each tensor's name after filtering (``names``: the name it
    reads -> the name the class uses, None for a tensor it leaves out)."""

    def filter_tensors(klass, item):
        kept = super(probe_cls, klass).filter_tensors(item)
        names[item[0]] = None if kept is None else kept[0]
        return kept

    probe_cls = type(cls.__name__, (cls,), {"model_arch": cls.model_arch, "filter_tensors": classmethod(filter_tensors)})
    return probe_cls


def probe_pass(cls, model: Path, scratch: Path, kind: str, order: list[str], shapes: dict[str, tuple[int, ...]]):
    """Run the class's ``prepare_tensors`` on ``kind`` probes; return, per tensor it adds (in order), its
    shape, dtype, the tensor being read when it was added, and its summary."""
    import gguf

    inst = instance(cls, model, scratch / "rows.gguf", eager=True)
    if list(inst.model_tensors) != order:
        raise RuntimeError("the converter indexed the tensors differently on a second instance")
    inst.model_tensors = {n: (lambda n=n, i=i: probe(kind, i, shapes[n])) for i, n in enumerate(order)}
    reading: list[str | None] = [None]
    generated: set[str] = set()
    out: dict[str, dict[str, Any]] = {}
    extra = inst.generate_extra_tensors

    def generate_extra_tensors():
        reading[0] = None
        for name, data in extra():
            generated.add(name)
            yield name, data

    def get_tensors():
        for name, gen in inst.model_tensors.items():
            reading[0] = name
            yield name, gen()

    def add_tensor(name, tensor, raw_shape=None, raw_dtype=None, tensor_endianess=None):
        a = np.asarray(tensor)
        f32 = a.dtype == np.float32 and raw_dtype in (None, gguf.GGMLQuantizationType.F32)
        out[name] = {"shape": list(a.shape), "f32": bool(f32), "during": reading[0],
                     "summary": summary(a) if f32 else None}

    inst.generate_extra_tensors = generate_extra_tensors
    inst.get_tensors = get_tensors
    inst.gguf_writer.add_tensor = add_tensor
    with torch.inference_mode():
        inst.prepare_tensors()
    return out, generated


def integral(x: np.ndarray, offset: float = 0.0) -> np.ndarray | None:
    y = x - offset
    k = np.rint(y)
    return k.astype(np.int64) if np.array_equal(k, y) else None


def place(name: str, s, r, c, shape: list[int], sources: list[tuple[int, ...]]) -> dict[str, Any]:
    """One GGUF tensor's placement from its three summaries (see the module's docstring)."""
    m = 1 if len(shape) <= 1 else shape[-1]
    src = integral(s[0], 0.5) if s[1].all() else None
    if src is None or (src < 0).any() or (src >= len(sources)).any():
        return {"kind": "other"}
    hf_rows = [int(np.prod(sources[k][:-1])) if len(sources[k]) > 1 else (sources[k][0] if sources[k] else 1)
               for k in range(len(sources))]
    hf_cols = [sources[k][-1] if len(sources[k]) > 1 else 1 for k in range(len(sources))]
    rows_of, cols_of = np.asarray(hf_rows)[src], np.asarray(hf_cols)[src]
    if r[1].all() and c[2].all() and (c[0] == 0).all() and (cols_of == m).all():
        flat = integral(r[0])
        if flat is not None and (flat >= 0).all() and (flat < rows_of).all():
            return {"kind": "rows", "src": src, "flat": flat}
    if c[1].all() and r[2].all() and len(shape) >= 2:
        col, first = integral(c[0]), integral(r[0])
        inner = np.asarray([sources[k][-2] if len(sources[k]) >= 2 else 0 for k in range(len(sources))])[src]
        if (col is not None and first is not None and (inner == m).all() and (first % np.maximum(inner, 1) == 0).all()
                and (col >= 0).all() and (col < cols_of).all()):
            return {"kind": "transposed", "src": src, "flat": first // inner * cols_of + col}
    return {"kind": "other"}


def row_map(cls, model: Path, scratch: Path, prefix: Path) -> None:
    filtered: dict[str, str | None] = {}
    pcls = probe_class(cls, filtered)
    lazy = instance(pcls, model, scratch / "rows.gguf")
    names = {kept: read for read, kept in filtered.items() if kept is not None}
    order = list(lazy.model_tensors)
    shapes = {n: tuple(int(d) for d in lazy.model_tensors[n]().shape) for n in order}
    too_big = [n for n, s in shapes.items() if max(int(np.prod(s[:-1] or (1,))), s[-1] if s else 1, len(order)) >= EXACT]
    if too_big:
        raise Refused("rows", f"{too_big[0]} has 2**24 rows or columns or more: its probe is not exact in float32")
    passes = {k: probe_pass(pcls, model, scratch, k, order, shapes) for k in "SRC"}
    added, generated = passes["S"]
    if any(list(passes[k][0]) != list(added) for k in "RC"):
        raise RuntimeError("the converter added different tensors on the three probe passes")
    sources = [shapes[n] for n in order]
    entries, arrays = [], {}
    for i, (name, info) in enumerate(added.items()):
        entry = {"name": name, "shape": info["shape"], "during": info["during"]}
        if name in generated:
            entry["kind"] = "generated"
        elif not info["f32"]:
            entry["kind"] = "other"
        else:
            placed = place(name, info["summary"], passes["R"][0][name]["summary"], passes["C"][0][name]["summary"],
                           info["shape"], sources)
            entry["kind"] = placed["kind"]
            if "src" in placed:
                arrays[f"src{i}"] = placed["src"].astype(np.int32)
                arrays[f"flat{i}"] = placed["flat"].astype(np.int64)
        entries.append(entry)
    manifest = {"hf": [[names.get(n, n), n, list(shapes[n])] for n in order], "gguf": entries,
                "left_out": sorted(read for read, kept in filtered.items() if kept is None)}
    prefix.with_name(prefix.name + ".json").write_text(json.dumps(manifest, sort_keys=True))
    np.savez_compressed(prefix.with_name(prefix.name + ".npz"), **arrays)


# --- the job ---------------------------------------------------------------------------------------


def run_model(task: dict[str, Any], scratch: Path) -> dict[str, Any]:
    model = Path(task["model"])
    result: dict[str, Any] = {"model": task["model"], "seconds": {}}
    try:
        t = time.perf_counter()
        arch, cls = model_class(model)
        result.update(architecture=arch, converter_class=cls.__name__)
        if task.get("vocab", True):
            check_vocab(cls, model, scratch)
        result["seconds"]["checks"] = time.perf_counter() - t
        if task.get("f32"):
            t = time.perf_counter()
            convert(cls, model, Path(task["f32"]), vocab=task.get("vocab", True))
            result["seconds"]["f32"] = time.perf_counter() - t
        if task.get("rows"):
            t = time.perf_counter()
            row_map(cls, model, scratch, Path(task["rows"]))
            result["seconds"]["rows"] = time.perf_counter() - t
    except Refused as exc:
        result["error"] = {"kind": exc.kind, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported as one line; the traceback goes to stderr
        traceback.print_exc()
        result["error"] = {"kind": "converter", "message": one_line(exc)}
    return result


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    logging.basicConfig(level=logging.WARNING)
    t = time.perf_counter()
    import conversion  # noqa: F401 - torch, transformers and the converter, once for every model

    imported = time.perf_counter() - t
    scratch = Path(job["scratch"])
    results = [run_model(task, scratch) for task in job["models"]]
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(job["result"]).write_text(json.dumps({"models": results, "peak_rss_bytes": peak_kib * 1024,
                                               "import_seconds": imported}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
