"""llama.cpp's own Hugging Face -> GGUF converter, pinned, run in a subprocess: what it knows about an
architecture (tensor names, row permutations, expert stacking, fused splits, metadata, tokenizer) is
reused, never copied into a qkit table.

* **The converter** (``CONVERTER``): ``convert_hf_to_gguf.py``, its ``conversion/`` package, its own
  ``gguf-py`` and the chat templates it reads, from the llama-cpp-python 0.3.36 sdist (the llama.cpp commit
  of ``qkit.schemes.kquants.LLAMA_CPP_COMMIT``): the archive checked by sha256, the extracted tree by its
  digest on every use (``assets.PinnedTree``). Offline once cached. Nothing of it is in this repository.
* **Refusals before any work** (``check_model``: instant, from the config and the converter's source read
  statically, ``known_architectures``): an architecture the converter does not register, one it converts
  only as a vision/audio projector, a ``tokenizer.model`` when ``sentencepiece`` is not installed. In the
  subprocess, before any tensor is read: the converter's own ``set_vocab`` (a BPE tokenizer whose
  pre-tokenizer it does not recognize fails there), in one line.
* **Running it** (``convert``): one subprocess for any number of models (``_converter_worker.py``, through
  ``qkit.processes``), with ``PYTHONPATH`` = a shim (a stub ``sentencepiece`` when the real one is not
  installed: the converter imports it before looking for ``tokenizer.model``), its ``gguf-py`` (which
  clashes with the installed ``gguf``), its folder. ``convert_f32`` is its F32 GGUF, the bytes
  ``convert_hf_to_gguf.py MODEL --outtype f32`` writes, cached by the digest of the model's files;
  ``row_map`` is where it puts every row (``rowmap.RowMap``), cached by the config and the tensors' shapes.
  A second process wanting the same entry waits for the first (``assets.cache_lock``) and reuses it.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from qkit import assets, processes, reading
from qkit.checkpoint import tensor_shapes
from qkit.errors import ExportError, ModelLoadError
from qkit.export.gguf.rowmap import RowMap
from qkit.schemes.kquants import LLAMA_CPP_COMMIT

_log = logging.getLogger("qkit")

CONVERTER = assets.PinnedTree(
    name="llama-cpp-converter",
    package="llama-cpp-python",
    version="0.3.36",  # vendors llama.cpp at LLAMA_CPP_COMMIT
    archive="llama_cpp_python-0.3.36.tar.gz",
    archive_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    root="llama_cpp_python-0.3.36/vendor/llama.cpp/",
    members=("LICENSE", "convert_hf_to_gguf.py", "conversion/", "gguf-py/LICENSE", "gguf-py/gguf/", "models/templates/"),
    tree_sha256="5dbc4b169eb7f3daef35ba8958d0d36c42edad74c51c77f25a324eeba92e1626",
)
WHO = f"llama.cpp's converter (llama-cpp-python {CONVERTER.version}, llama.cpp {LLAMA_CPP_COMMIT[:10]})"
_WORKER = Path(__file__).with_name("_converter_worker.py")
_STUB_MARK = "qkit-sentencepiece-stub"  # _converter_worker.STUB_MARK: the stub's error names it
_STUB = (f'"""{_STUB_MARK}: sentencepiece is not installed; qkit put this stub here for llama.cpp\'s converter."""\n\n\n'
         "class SentencePieceProcessor:\n    def __init__(self, *args, **kwargs):\n"
         f"        raise ImportError(\"{_STUB_MARK}: sentencepiece is not installed\")\n")
_SENTENCEPIECE = "pip install sentencepiece"


# --- what the converter knows, read from its source without running it -----------------------------


@dataclass(frozen=True)
class Architectures:
    """The Hugging Face architecture names the converter registers: ``text`` (name -> its class), those it
    converts only as a vision/audio projector (``mmproj_only``), and those it routes on the top-level name
    even when the config has a ``text_config`` (``top_level``)."""

    text: dict[str, str]
    mmproj_only: frozenset[str]
    top_level: frozenset[str]


def converter_root() -> Path:
    """The verified converter tree in qkit's cache (fetched once: ``AssetError`` when it cannot be)."""
    return assets.fetch(CONVERTER)


def _string_map(tree: ast.Module, name: str) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return ast.literal_eval(node.value)
    raise ExportError(f"{WHO} has no {name} in conversion/__init__.py: the pinned converter changed (a qkit bug)")


def _classes(tree: ast.Module) -> dict[str, tuple[list[str], str | None, list[str]]]:
    """Each class of one module: its bases, its own ``model_arch`` (source text) and the names it registers
    with ``@ModelBase.register(...)``."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            arch = next((ast.unparse(s.value) for s in node.body if isinstance(s, ast.Assign)
                         and any(isinstance(t, ast.Name) and t.id == "model_arch" for t in s.targets)), None)
            names = [a.value for d in node.decorator_list if isinstance(d, ast.Call)
                     and ast.unparse(d.func) == "ModelBase.register" for a in d.args
                     if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            out[node.name] = ([ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases], arch, names)
    return out


def _registered(classes: dict[str, tuple[list[str], str | None, list[str]]]) -> dict[str, str]:
    """Name -> class of the language-model registrations: ``ModelBase.register`` files a class under MMPROJ
    when its ``model_arch`` (its own or inherited, as ``MmprojModel``'s) is ``MODEL_ARCH.MMPROJ``, else
    under TEXT."""

    def arch(name: str, seen: frozenset[str] = frozenset()) -> str:
        if name not in classes or name in seen:
            return ""
        bases, own, _ = classes[name]
        return own if own is not None else next((a for b in bases if (a := arch(b, seen | {name}))), "")

    return {n: cls for cls, (_, _, names) in classes.items() if not arch(cls).endswith("MODEL_ARCH.MMPROJ")
            for n in names}


def _top_level(base: ast.Module) -> frozenset[str]:
    """The names ``get_model_architecture`` returns before looking at ``text_config``."""
    for node in ast.walk(base):
        if isinstance(node, ast.FunctionDef) and node.name == "get_model_architecture":
            for cmp in ast.walk(node):
                if (isinstance(cmp, ast.Compare) and isinstance(cmp.ops[0], ast.In)
                        and isinstance(cmp.comparators[0], ast.Tuple)):
                    return frozenset(ast.literal_eval(cmp.comparators[0]))
    return frozenset()


def _scan(root: Path) -> Architectures:
    package = root / "conversion"
    init = ast.parse((package / "__init__.py").read_text(encoding="utf-8"))
    text_map, mmproj_map = _string_map(init, "TEXT_MODEL_MAP"), _string_map(init, "MMPROJ_MODEL_MAP")
    classes: dict[str, tuple[list[str], str | None, list[str]]] = {}
    for path in sorted(package.glob("*.py")):
        classes.update(_classes(ast.parse(path.read_text(encoding="utf-8"))))
    registered = _registered(classes)
    text = {n: registered[n] for n in text_map if n in registered}  # what get_model_class(n) finds
    top = _top_level(ast.parse((package / "base.py").read_text(encoding="utf-8")))
    return Architectures(text=dict(sorted(text.items())), mmproj_only=frozenset(set(mmproj_map) - set(text)), top_level=top)


@lru_cache(maxsize=1)
def known_architectures() -> Architectures:
    """What the pinned converter registers, read statically from its ``conversion/`` (``TEXT_MODEL_MAP``,
    ``MMPROJ_MODEL_MAP`` and each module's ``@ModelBase.register(...)``): parsed once, then kept beside the
    tree in the cache as JSON, so a refusal costs a file read."""
    root = converter_root()
    saved = root.parent / f"{root.name}.architectures.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        d = json.loads(saved.read_text(encoding="utf-8"))
        return Architectures(text=d["text"], mmproj_only=frozenset(d["mmproj_only"]), top_level=frozenset(d["top_level"]))
    found = _scan(root)
    with contextlib.suppress(OSError):
        tmp = saved.with_name(saved.name + f".part-{os.getpid()}")
        tmp.write_text(json.dumps({"text": found.text, "mmproj_only": sorted(found.mmproj_only),
                                   "top_level": sorted(found.top_level)}, sort_keys=True), encoding="utf-8")
        os.replace(tmp, saved)
    return found


def _config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config = json.loads(reading.read_text(path, "the model's config.json", limit=reading.MAX_JSON_BYTES))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path} ({exc}); the converter needs a Hugging Face model directory") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object; the converter needs a Hugging Face config.json")
    return config


def architecture_of(config: dict[str, Any], known: Architectures) -> str:
    """The name the converter picks (``get_model_architecture``): ``architectures[0]``, replaced by the
    ``text_config``'s unless it is one the converter routes on its top-level name."""
    arches = config.get("architectures")
    arch = arches[0] if isinstance(arches, list) and arches and isinstance(arches[0], str) else None
    text = config.get("text_config")
    if arch not in known.top_level and isinstance(text, dict):
        inner = text.get("architectures")
        if isinstance(inner, list) and inner and isinstance(inner[0], str):
            arch = inner[0]
    if arch is None:
        raise ExportError("the model's config.json names no architecture (\"architectures\"); "
                          f"{WHO} picks its class by that name")
    return arch


def sentencepiece_installed() -> bool:
    return importlib.util.find_spec("sentencepiece") is not None


def _nested_architectures(config: dict[str, Any]) -> list[str]:
    """``architectures[0]`` of every config nested one or two levels down (``text_config``, ``llm_config``,
    ``thinker_config.text_config``, ...): where the converter's ``load_hparams`` finds a multimodal
    model's language model under another key."""
    found = []
    for value in config.values():
        for sub in (value, *(value.values() if isinstance(value, dict) else ())):
            arches = sub.get("architectures") if isinstance(sub, dict) else None
            if isinstance(arches, list) and arches and isinstance(arches[0], str):
                found.append(arches[0])
    return found


def check_model(model_dir: Path, *, tokenizer: bool = True) -> str:
    """The converter's class name for ``model_dir``, or ``ExportError`` in one line: an architecture it does
    not register (named), one it converts only as a vision/audio projector, a ``tokenizer.model`` without
    ``sentencepiece``. Reads only the config and the converter's cached list: instant. (A language model
    nested under another key than ``text_config`` is accepted when its name is registered: the subprocess
    resolves it exactly, and refuses in one line if the converter does not find it.)"""
    known = known_architectures()
    config = _config(model_dir)
    arch = architecture_of(config, known)
    cls = known.text.get(arch) or next((known.text[n] for n in _nested_architectures(config) if n in known.text), None)
    if cls is None and arch in known.mmproj_only:
        raise ExportError(f"{arch} is converted by {WHO} only as a vision/audio projector (mmproj), not as a "
                          "language model; qkit writes GGUF for text models")
    if cls is None:
        raise ExportError(f"{WHO} does not convert architecture {arch!r} ({len(known.text)} architectures are "
                          "registered; `python convert_hf_to_gguf.py --print-supported-models` lists them): "
                          "no GGUF can be written for this model")
    if tokenizer and (model_dir / "tokenizer.model").is_file() and not sentencepiece_installed():
        raise ExportError(f"{model_dir / 'tokenizer.model'} is a SentencePiece tokenizer, which {WHO} reads "
                          f"with the sentencepiece package: {_SENTENCEPIECE}")
    return cls


# --- running it --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversion:
    """What ``convert`` made for one model: the F32 GGUF and the row map (None where not asked), and the
    record of the run that made them (architecture, converter class, seconds per step: ``import`` (torch,
    transformers and the converter, once per subprocess), ``checks`` (class and tokenizer), ``f32``,
    ``rows``; the subprocess's peak resident memory in bytes; a cached entry keeps its first run's record)."""

    model: Path
    f32: Path | None
    rows: RowMap | None
    record: dict[str, Any] = field(default_factory=dict)


@lru_cache(maxsize=1)
def _runner_digest() -> str:
    """The converter's tree digest and the worker's sha256: what a cached result was made by."""
    return f"{CONVERTER.tree_sha256}:{assets.sha256_file(_WORKER)}"


def _files_digest(model_dir: Path) -> str:
    """sha256 over the directory's name and every regular file in it (name and sha256): what the converter
    reads (config, tokenizer, weights, model card; the name is the GGUF's ``general.name`` when nothing
    else gives one), and what runs it (``_runner_digest``)."""
    h = hashlib.sha256(f"{_runner_digest()}\n{model_dir.resolve().name}\n".encode())
    for p in sorted(model_dir.iterdir()):
        if not p.name.startswith(".") and reading.is_regular(p):
            h.update(f"{p.name}\t{assets.sha256_file(p)}\n".encode())
    return h.hexdigest()


def _shapes_digest(model_dir: Path) -> str:
    """sha256 over what the row map depends on: the config, every tensor's name and shape, what runs it."""
    h = hashlib.sha256(f"{_runner_digest()}\n".encode())
    h.update((model_dir / "config.json").read_bytes())
    h.update("".join(f"{n}:{','.join(map(str, s))}\n" for n, s in tensor_shapes(model_dir)).encode())
    return h.hexdigest()


def _cache() -> Path:
    return assets.cache_dir() / "converted"


def environment(scratch: Path) -> dict[str, str]:
    """The environment the converter runs in: ``PYTHONPATH`` = a shim folder in ``scratch`` holding a stub
    ``sentencepiece`` (only when the real one is not installed), the converter's ``gguf-py``, its folder,
    then the caller's ``PYTHONPATH``; the hub offline (it reads local folders only)."""
    root = converter_root()
    paths = [str(root / "gguf-py"), str(root)]
    if not sentencepiece_installed():
        shim = scratch / "shim"
        (shim / "sentencepiece").mkdir(parents=True, exist_ok=True)
        (shim / "sentencepiece" / "__init__.py").write_text(_STUB, encoding="utf-8")
        paths.insert(0, str(shim))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def standalone(model_dir: Path, out_path: Path, scratch: Path) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run the pinned ``convert_hf_to_gguf.py MODEL --outtype f32
    --outfile OUT`` itself, as its README says: what the tests and the benchmark compare ``convert_f32`` with."""
    cmd = [sys.executable, str(converter_root() / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32",
           "--outfile", str(out_path)]
    return cmd, environment(scratch)


def _run(tasks: list[dict[str, Any]], scratch: Path) -> list[dict[str, Any]]:
    """Run the worker on ``tasks`` in one subprocess; its per-model results (``peak_rss_bytes`` on each)."""
    root = converter_root()
    job, result = scratch / "job.json", scratch / "result.json"
    job.write_text(json.dumps({"models": tasks, "result": str(result), "scratch": str(scratch)}), encoding="utf-8")
    # run from a copy: a script's folder is first on its path, and this package's types.py would shadow the stdlib's
    worker = scratch / _WORKER.name
    worker.write_bytes(_WORKER.read_bytes())
    try:
        done = processes.run([sys.executable, str(worker), str(job)], timeout=None, cwd=scratch,
                             env=environment(scratch))
    except OSError as exc:
        raise ExportError(f"cannot start {sys.executable} to run {WHO} ({exc})") from None
    if done.returncode != 0 or not result.is_file():
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ExportError(f"{WHO} stopped without a result ({last[:300]}); run it alone to see why: "
                          f"python {root / 'convert_hf_to_gguf.py'} MODEL --outtype f32")
    report = json.loads(result.read_text(encoding="utf-8"))
    for r in report["models"]:
        r["peak_rss_bytes"] = report["peak_rss_bytes"]
        r["seconds"]["import"] = report["import_seconds"]
    return report["models"]


def _refusal(model: Path, error: dict[str, str]) -> ExportError:
    kind, message = error["kind"], error["message"]
    if kind == "sentencepiece":
        return ExportError(f"{model}: {WHO} reads this model's tokenizer with the sentencepiece package: {_SENTENCEPIECE}")
    if kind == "tokenizer":
        return ExportError(f"{WHO} cannot convert the tokenizer of {model} ({message}); a BPE tokenizer is known to "
                           "llama.cpp by the hash of its tokens for a check text, so only the tokenizers it lists convert")
    if kind == "architecture":
        return ExportError(f"{WHO} does not convert architecture {message!r}: no GGUF can be written for {model}")
    return ExportError(f"{WHO} failed on {model} ({kind}: {message})")


def convert(models: Sequence[Path], *, f32: bool = True, rows: bool = True, vocab: bool = True) -> list[Conversion]:
    """For each model directory, the converter's F32 GGUF (``f32``) and row map (``rows``): from the cache,
    or made by one subprocess for all of them. Every model is checked first (``check_model``); a refusal of
    the converter's (a tokenizer it cannot convert) is ``ExportError`` in one line, before tensor work.
    ``vocab=False``: the F32 file without ``tokenizer.*`` fields and the tokenizer not converted (a model
    converted from a GGUF, whose own fields the caller copies: the converter would read the tokenizer.json
    qkit rebuilt from them, and may take it for another model's by its hash)."""
    models = [Path(m) for m in models]
    for m in models:
        check_model(m, tokenizer=vocab)
    keys = [((_files_digest(m)[:32] + ("" if vocab else "-novocab")) if f32 else None,
             _shapes_digest(m)[:32] if rows else None) for m in models]
    cache = _cache()
    cache.mkdir(parents=True, exist_ok=True)
    paths = [(cache / f"f32-{kf}.gguf" if kf else None, cache / f"rows-{kr}" if kr else None) for kf, kr in keys]
    with contextlib.ExitStack() as locks:
        for name in sorted({k for pair in keys for k in pair if k}):
            locks.enter_context(assets.cache_lock(f"converted-{name}", "running llama.cpp's converter on the same model"))
        pending = [i for i, (pf, pr) in enumerate(paths) if (pf and not pf.is_file()) or (pr and not RowMap.exists(pr))]
        if pending:
            _make(models, paths, pending, cache, vocab)
    return [Conversion(m, pf, RowMap.load(pr) if pr else None, _record(pf, pr)) for m, (pf, pr) in zip(models, paths)]


def _record(pf: Path | None, pr: Path | None) -> dict[str, Any]:
    for p in (pf, pr):
        if p is not None:
            with contextlib.suppress(OSError, ValueError):
                return json.loads(p.with_name(p.name.removesuffix(".gguf") + ".record.json").read_text(encoding="utf-8"))
    return {}


def _make(models: list[Path], paths: list[tuple[Path | None, Path | None]], pending: list[int], cache: Path,
          vocab: bool = True) -> None:
    _log.info("running %s on %d model(s), once (cached in %s)", WHO, len(pending), cache)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".run-{os.getpid()}-") as tmp:
        scratch = Path(tmp)
        tasks = [{"model": str(models[i].resolve()),
                  "f32": str(scratch / f"{i}.gguf") if paths[i][0] and not paths[i][0].is_file() else None,
                  "vocab": vocab,
                  "rows": str(scratch / f"rows-{i}") if paths[i][1] and not RowMap.exists(paths[i][1]) else None}
                 for i in pending]
        for i, task, result in zip(pending, tasks, _run(tasks, scratch)):
            if "error" in result:
                raise _refusal(models[i], result["error"])
            pf, pr = paths[i]
            record = json.dumps({k: result[k] for k in ("architecture", "converter_class", "seconds", "peak_rss_bytes")},
                                sort_keys=True)
            if task["rows"] and pr is not None:
                RowMap.publish(Path(task["rows"]), pr)
                pr.with_name(pr.name + ".record.json").write_text(record, encoding="utf-8")
            if task["f32"] and pf is not None:
                os.replace(task["f32"], pf)
                pf.with_name(pf.name.removesuffix(".gguf") + ".record.json").write_text(record, encoding="utf-8")


def convert_f32(model_dir: Path, out_path: Path | None = None, *, vocab: bool = True) -> Path:
    """The converter's F32 GGUF of ``model_dir`` (``convert_hf_to_gguf.py MODEL --outtype f32``'s bytes),
    cached by the digest of the model's files; copied to ``out_path`` (atomically) when given, which is
    returned, else the cached file's path (read-only use)."""
    (done,) = convert([model_dir], f32=True, rows=False, vocab=vocab)
    assert done.f32 is not None
    if out_path is None:
        return done.f32
    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.part-{os.getpid()}")
    try:
        with open(done.f32, "rb") as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 24):
                dst.write(block)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def row_map(model_dir: Path) -> RowMap:
    """Where the converter puts every row of every Hugging Face tensor of ``model_dir`` (``rowmap.RowMap``),
    cached by its config and its tensors' names and shapes."""
    (done,) = convert([model_dir], f32=False, rows=True)
    assert done.rows is not None
    return done.rows


__all__ = ["CONVERTER", "Architectures", "Conversion", "architecture_of", "check_model", "convert", "convert_f32",
           "converter_root", "environment", "known_architectures", "row_map", "sentencepiece_installed", "standalone"]
