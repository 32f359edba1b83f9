"""``qkit eval``'s checks that need no model loaded: calibration texts, a checkpoint against its reference
(from headers only); the window and corpus tokens are ``perplexity``'s (``check_corpus_tokens``, ``choose_window``).

Layer 6 (``evaluation``). ``inputs.check_inputs`` calls these before the reference model is loaded, so
every refusal costs milliseconds, not a model load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkit.checkpoint import read_manifest, tensor_shapes
from qkit.errors import CheckpointError, InputError
from qkit.evaluation.specs import RowSpec
from qkit.methods import get_method, make_options
from qkit.methods.calibration import calibration_ids, check_fits
from qkit.models import ModelRef
from qkit.simulate import get_simulation
from qkit.transform import entry_to_spec


def read_config(ref: ModelRef):
    """The reference's transformers config (no weights read), or None when transformers cannot build it
    (``load`` then refuses with its own one-line message). Never runs repository code."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(ref.directory), trust_remote_code=ref.trust_remote_code)
    except Exception:
        return None


def check_calibrations(specs: list[RowSpec], tokenizer, corpus, config=None,
                       simulation_options: Callable[[RowSpec], dict] | None = None) -> list[dict]:
    """Every calibrated row's calibration text (a calibrated method's, and a simulation's such as
    ``act-int8-static``'s scales), read, checked disjoint from the eval ``corpus`` (one text, or the suite's
    texts) and sampled
    (``qkit.methods.calibration.calibration_ids``) before the model is loaded, so an unreadable, overlapping
    or too short text, or windows beyond the model's context (``config``), is refused in one line before
    the reference row. ``simulation_options(spec)``: the options each row's simulations are built with. Returns
    each distinct text's provenance (the row reads and samples it again when it is built: milliseconds
    next to a row)."""
    seen: dict[Any, dict] = {}
    for spec in specs:
        method = get_method(spec.method)
        calibrated = method is not None and method.calibrated
        chosen = [make_options(method, dict(spec.method_options)).calibration_options()] if calibrated else []
        for name in spec.simulation:  # a simulation that calibrates (static activation scales) says with what
            simulation = get_simulation(name, simulation_options(spec) if simulation_options else dict(spec.simulation_options))
            wants = getattr(simulation, "calibration_options", None)
            if callable(wants) and wants() is not None:
                chosen += [wants()]
        for options in chosen:
            options = options.fitted(config)  # the window the row will use: a default fitted to the context
            if options not in seen:
                check_fits(options, config)
                seen[options] = calibration_ids(tokenizer, options, evaluation=corpus)[1]
    return list(seen.values())


def stored_weights(directory: Path) -> dict[str, tuple[int, ...]]:
    """A checkpoint's weights by name and shape from its headers and manifest: a quantized weight's stored
    parts (``W.qweight``, ``W.scales``, ...) stand for ``W`` with its original shape."""
    entries = (read_manifest(directory) or {}).get("tensors") or {}
    if not isinstance(entries, dict):
        raise CheckpointError(f"checkpoint {directory}: the manifest's 'tensors' is not a JSON object; re-create it")
    out: dict[str, tuple[int, ...]] = {}
    parts: dict[str, set[str]] = {}
    for key, shape in tensor_shapes(directory):
        base, dot, part = key.rpartition(".")
        if dot and base in entries:
            parts.setdefault(base, set()).add(part)
        else:
            out[key] = tuple(shape)
    lacking = []
    for name, entry in entries.items():
        try:
            scheme, shape, _dtype = entry_to_spec(entry)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint {directory}: malformed manifest entry for {name} ({exc!r}); re-create it") from exc
        if set(scheme.parts) - parts.get(name, set()):  # iter_quantized would find this only after the model loads
            lacking.append(f"{name}.{'/'.join(sorted(set(scheme.parts) - parts.get(name, set())))}")
        out[name] = shape
    if lacking:
        raise CheckpointError(f"checkpoint {directory} lacks stored parts {', '.join(sorted(lacking)[:3])}"
                              + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "") + "; re-create it")
    return out


def check_checkpoint_matches(checkpoint: ModelRef, ref: ModelRef, config=None) -> None:
    """Refuse, from both headers and before anything is loaded, a checkpoint whose weights are not the
    reference's: every tensor the reference stores must be in the checkpoint (quantized or as stored) with the
    same shape, and nothing else (a tied ``lm_head.weight`` may be stored on one side only)."""
    have = stored_weights(checkpoint.directory)
    want = dict(tensor_shapes(ref.directory))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    optional = {n for n in {*have, *want} if tied and n.endswith("lm_head.weight")}
    missing = sorted(n for n in want.keys() - have.keys() if n not in optional)
    extra = sorted(n for n in have.keys() - want.keys() if n not in optional)
    wrong = sorted(n for n in want.keys() & have.keys() if tuple(want[n]) != tuple(have[n]))
    if not (missing or extra or wrong):
        return

    def some(names: list[str], fmt=lambda n: n) -> str:
        return ", ".join(fmt(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    parts = ([f"missing {some(missing)}"] if missing else []) + ([f"extra {some(extra)}"] if extra else []) + (
        [f"shape of {some(wrong, lambda n: f'{n} {list(have[n])} (reference {list(want[n])})')}"] if wrong else [])
    raise InputError(
        f"checkpoint {checkpoint.spec} does not match the reference {ref.spec} ({'; '.join(parts)}); "
        "pass the --reference it was made from, or re-create the checkpoint"
    )


__all__ = ["check_calibrations", "check_checkpoint_matches", "read_config",
           "stored_weights"]
