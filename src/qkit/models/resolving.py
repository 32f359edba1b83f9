"""Resolve a MODEL argument (a directory, a hub id, a ``.gguf`` file, a qkit checkpoint, a pinned model's name,
or nothing) to a ``ModelRef``: a local directory, its kind, its provenance, and whether its own code may run.

In order: nothing is the default pinned model; a path that exists is read as what it is (so a local file or
directory named like a pinned model wins over the name); a pinned model's name (``qkit.pinned_models``) is
fetched, checked and converted once; a hub-id-shaped spec goes to the hub.

Layer 4 (``models``): above ``checkpoint`` and ``transform`` (3), ``schemes`` (2) and ``assets`` (1); below
methods, export, simulate, serving (5), evaluation (6), inspect, api and cli (7).
"""

from __future__ import annotations

import difflib
import errno
import os
import re
from pathlib import Path

from qkit import assets, pinned_models, reading
from qkit.checkpoint import weight_files
from qkit.errors import InputError, ModelLoadError
from qkit.models.files import (
    _PICKLED,
    ModelRef,
    _check_weights,
    _denied,
    check_remote_code,
    quiet_progress,
    read_config,
)
from qkit.models.gguf import _gguf_directory
from qkit.pinned_models import PINNED_MODELS, PinnedModel

_MODEL_FIX = "pass a model directory, a .gguf file, a hub id or a pinned model's name"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _exists(path: Path) -> str | None:
    """``"file"``, ``"dir"``, another kind, or None; a path qkit may not look at is a permission error, a
    symbolic link loop or a FIFO, socket or device is refused in one line (``qkit.reading``), never opened."""
    try:
        if path.is_dir():
            return "dir"
        if path.is_file():
            return "file"
        if reading.is_link_loop(path):
            raise reading.refusal(str(path), "a symbolic link loop", _MODEL_FIX)
        if path.exists():
            raise reading.refusal(str(path), reading.kind_of(path.stat()) or "not a regular file", _MODEL_FIX)
        return None
    except PermissionError as exc:
        raise _denied(path, exc) from exc

def _local_lookalike(spec: str) -> Path | None:
    """For a hub-id-shaped spec (``models/x``): the local directory its first part names, if one exists.

    A ``models/x`` whose ``models/`` exists here is a local path that is missing, not a hub id."""
    first = Path(spec.split("/", 1)[0])
    return first if _exists(first) == "dir" else None

def resolve(model: str | Path | ModelRef | None = None, *, allow_pickle: bool = False,
            trust_remote_code: bool = False) -> ModelRef:
    """Turn a MODEL argument into a local directory (fetching or converting once, then cached).

    A model that needs its own Python (``custom_code``) is refused unless ``trust_remote_code``; the
    returned ref carries that permission to ``load``. A ``ModelRef`` is returned as it is: a command
    may resolve first (to refuse a bad MODEL before its status line) and pass the ref on as MODEL.
    """
    if isinstance(model, ModelRef):
        return model
    if model is not None and not str(model).strip():  # an empty shell variable, most likely: not the default
        raise InputError("MODEL is empty; name a model directory, .gguf file, hub id or pinned model, or leave MODEL "
                         "out for the pinned default model")
    if model is None:
        return _pinned(pinned_models.DEFAULT)
    spec = str(model)
    path = Path(spec).expanduser()
    kind = _exists(path)
    if kind == "file" and path.suffix == ".gguf":
        try:
            sha = assets.sha256_file(path)
        except PermissionError as exc:
            raise _denied(path, exc) from exc
        return ModelRef("gguf", spec, _gguf_directory(path, sha), {"gguf": str(path), "sha256": sha})
    if kind == "dir":
        try:  # a FIFO among the model's files would block whichever library opens it: refused up front
            reading.check_entries(path, spec, "a model directory holds regular files")
        except PermissionError as exc:
            raise _denied(path, exc) from exc
        config = read_config(path)
        check_remote_code(path, spec, trust_remote_code, config)
        try:
            _check_weights(path, allow_pickle)
            # safetensors reports an unreadable shard as corrupt: name the real cause first (cheap: no open)
            unreadable = [p for p in weight_files(path) if not os.access(p, os.R_OK)]
        except PermissionError as exc:
            raise _denied(path, exc) from exc
        if unreadable:
            raise _denied(path, PermissionError(errno.EACCES, "Permission denied", str(unreadable[0])))
        kind = "qkit" if (config.get("quantization_config") or {}).get("quant_method") == "qkit" else "directory"
        return ModelRef(kind, spec, path, {"path": str(path.resolve())}, trust_remote_code)
    if kind is not None:
        named = PINNED_MODELS.canonical(spec)
        also = f" (a file here is named like the pinned model {named}: it wins over the name; to use the model, run " \
               "where no such file is)" if named else ""
        raise InputError(f"{spec} is neither a model directory nor a .gguf file; pass one of those{also}")
    pinned = PINNED_MODELS.find(spec)
    if pinned is not None:
        return _pinned(pinned)
    if _HUB_ID.match(spec) and not spec.startswith((".", "~")):
        local = _local_lookalike(spec)
        if local is not None:
            raise InputError(f"no such file or directory: {spec} ({local}/ exists here but holds no "
                             f"{spec.split('/', 1)[1]}, so it is not fetched from the hub); pass an existing model directory")
        return _from_hub(spec, allow_pickle, trust_remote_code)
    close = difflib.get_close_matches(PINNED_MODELS.normalize(spec), PINNED_MODELS.names(), n=1, cutoff=0.8)
    guess = f" (did you mean the pinned model {close[0]}?)" if close else ""
    raise InputError(f"no such file or directory: {spec}{guess}; pass a model directory, a .gguf file, a hub id or a "
                     f"pinned model's name ({', '.join(PINNED_MODELS.names())})")


def pinned_of(ref: ModelRef) -> PinnedModel | None:
    """The pinned model ``ref`` was resolved from (by its name, or as the default), or None."""
    return pinned_models.titled(ref.spec) if ref.kind in ("default", "pinned") else None


def _pinned(model: PinnedModel) -> ModelRef:
    """A pinned model: its GGUF fetched (or assembled) and checked, then converted once into the cache. Its
    kind is ``default`` for the default model, by either way of asking for it, else ``pinned``."""
    directory = _gguf_directory(model.fetch(), model.asset.sha256)
    kind = "default" if model.name == pinned_models.DEFAULT.name else "pinned"
    return ModelRef(kind, model.title, directory, model.provenance())

def _from_hub(repo_id: str, allow_pickle: bool, trust_remote_code: bool = False) -> ModelRef:
    from huggingface_hub import constants, snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    if allow_pickle:
        patterns += list(_PICKLED)
    quiet_progress()
    try:
        with assets.quiet_hub():
            local = snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10)
    except Exception as exc:  # huggingface_hub raises many types (network, auth, not found)
        if constants.HF_HUB_OFFLINE:
            raise ModelLoadError(
                f"cannot fetch {repo_id}: HF_HUB_OFFLINE is set and the local hub cache does not hold it; "
                "pass a local model directory or .gguf file, or unset HF_HUB_OFFLINE to download it"
            ) from exc
        # the first line says what failed ("... ConnectError: Name or service not known"); the rest is advice
        first = next((" ".join(line.split()) for line in str(exc).splitlines() if line.strip()), type(exc).__name__)[:160]
        raise ModelLoadError(
            f"cannot fetch {repo_id} from the Hugging Face hub ({first}); "
            "pass a local model directory or .gguf file instead"
        ) from exc
    check_remote_code(Path(local), repo_id, trust_remote_code)  # named by its hub id, not the snapshot path
    ref = resolve(local, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    return ModelRef("hub" if ref.kind == "directory" else ref.kind, repo_id, ref.directory,
                    {"hub_id": repo_id, "snapshot": local}, ref.trust_remote_code)
