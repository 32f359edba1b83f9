"""What an eval's rows were measured on: the provenance ``qkit eval`` records beside its table.

Layer 6 (``evaluation``): plain facts read from what the steps before it built (the models, the inputs,
the reference, the engines); ``EvalReport.provenance`` holds them, ``--json`` writes them.
"""

from __future__ import annotations

import platform
import time

import torch

from qkit.evaluation.engines import TORCH, Engine, EngineOptions
from qkit.evaluation.engines.worker import engine_python
from qkit.evaluation.inputs import Inputs, Models
from qkit.evaluation.measuring import Reference
from qkit.evaluation.report import Row
from qkit.version import __version__


def provenance(rows: list[Row], reference: Reference, inputs: Inputs, models: Models, engines: list[Engine],
               engine: EngineOptions, scale_dtype: str, seed: int) -> dict:
    """The model and its source, a saved checkpoint, the corpus, the calibration texts, the tokenizer, the
    tokens and window, the battery's and agreement's settings, the versions, device, dtype and threads, the
    runtimes and each worker engine's facts, and the seconds since the reference began to be measured."""
    tok, corpus = inputs.tokenizer, reference.corpus
    return {
        "model": models.ref.spec,
        "model_kind": models.ref.kind,
        "model_source": models.ref.provenance,
        "checkpoint": str(models.checkpoint.directory) if models.checkpoint else None,
        "corpus": inputs.corpus.provenance(),
        # an eval suite's domains: each text, its tokens and its scored positions (one text: [])
        "domains": [{**t.provenance(), "tokens": n, "scored_tokens": scored}
                    for t, (_, n), (_, scored) in zip(inputs.texts, inputs.segments, corpus.domains)],
        "calibration": inputs.calibrations,
        "tokenizer": getattr(tok, "name_or_path", None) or type(tok).__name__,
        "tokenizer_class": type(tok).__name__,
        "tokens": int(inputs.ids.numel()),
        "scored_tokens": corpus.scored_tokens,
        "window": inputs.window,
        "battery": {"questions": len(reference.battery), "max_new_tokens": reference.battery_tokens,
                    "repetition_penalty": reference.repetition_penalty,
                    "chat_template": bool(getattr(tok, "chat_template", None))},
        "agreement": {"prompts": len(reference.prompts), "tokens_per_prompt": reference.continuation.n},
        "scale_dtype": scale_dtype,
        "seed": seed,
        "qkit_version": __version__,
        "torch_version": torch.__version__,
        "device": reference.device,
        "dtype": engine.dtype,
        "runtimes": [e.name for e in engines],
        "engines": engine_provenance(engines, rows, engine),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "seconds_total": time.perf_counter() - reference.started,
    }


def engine_provenance(engines: list[Engine], rows: list[Row], options: EngineOptions) -> dict:
    """Per worker engine: the format it loaded, whether it gave the full distribution, its version (from
    the rows it ran; None when it ran none) and the interpreter its worker ran in. (Torch's facts are the
    provenance's own: ``torch_version``, ``device``, ``dtype``.)"""
    out = {}
    for e in (e for e in engines if e.name != TORCH):
        versions = sorted({r.engine["version"] for r in rows if r.runtime == e.name and r.engine.get("version")})
        out[e.name] = {"format": e.format, "extra": e.extra, "full_distribution": e.full_distribution,
                       "version": versions[0] if versions else None, "python": engine_python(options.python)}
    return out


__all__ = ["engine_provenance", "provenance"]
