"""``qkit eval``'s checks that need no model loaded: a checkpoint against its reference (from headers only);
the window and corpus tokens are ``windows``' (``check_corpus_tokens``, ``choose_window``), the calibration
texts ``methods.calibration``'s (``check_calibrations``).

Layer 6 (``evaluation``). ``inputs.check_inputs`` calls these before the reference model is loaded, so
every refusal costs milliseconds, not a model load.
"""

from __future__ import annotations

from pathlib import Path

from qkit.checkpoint import read_manifest, tensor_shapes
from qkit.errors import CheckpointError, InputError
from qkit.models import ModelRef
from qkit.transform import entry_to_spec


def read_config(ref: ModelRef):
    """The reference's transformers config (no weights read), or None when transformers cannot build it
    (``load`` then refuses with its own one-line message). Never runs repository code."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(ref.directory), trust_remote_code=ref.trust_remote_code)
    except Exception:
        return None


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


__all__ = ["check_checkpoint_matches", "read_config", "stored_weights"]
