"""The JSON inputs of ``qkit report``, one small document of every kind, in the shapes the commands write
them (the shapes were taken from real ``--json`` outputs of the default model): the fixtures of
``tests/test_report.py``, ``tests/test_report_browser.py`` and the adversarial report cases. No tests here."""

from __future__ import annotations

import json
from pathlib import Path

from qkit.version import __version__

MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)"
MATS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")


def _row(name, bits, kld, kld_se, dppl, dppl_se, *, plan=None, runtime="torch", refused=None, versus_torch=None, engine=None):
    return {"scheme": name, "bits_per_weight": bits, "size_bytes": int(bits * 1e6), "perplexity": None if dppl is None else 10 * (1 + dppl / 100),
            "perplexity_se": 0.3, "perplexity_change_pct": dppl, "perplexity_change_se_pct": dppl_se, "kld": kld,
            "kld_se": kld_se, "top1_match": 0.9, "battery_correct": 10, "battery_total": 12, "battery_ci95": [0.5, 0.9],
            "agreement": 30, "agreement_total": 36, "spec": {"name": name, "scheme": None if plan else name, "plan": plan,
                                                             "simulation": [], "method": "rtn"},
            "runtime": runtime, "refused": refused, "versus_torch": versus_torch or {}, "engine": engine or {}}


def make_docs() -> dict[str, dict]:
    """One small document of every kind, as the commands write them (2 layers x 7 matrices)."""
    rows = [_row("fp", 32.0, 0.0, 0.0, 0.0, 0.0),
            _row("q8_0", 8.5, 0.0012, 0.0001, 0.1, 0.05),
            _row("q4_k_m", 4.89, 0.041, 0.003, 3.2, 0.4),
            _row("plan:gguf@q4_k_m", 4.88, 0.030, 0.002, 2.1, 0.35, plan="gguf@q4_k_m"),
            _row("q4_k_m", 4.89, 0.043, 0.003, 3.4, 0.4, runtime="llama.cpp",
                 versus_torch={"against": "q4_k_m", "perplexity_change_pct": 0.2, "perplexity_change_se_pct": 0.1,
                               "kld_change": 0.002, "kld_change_se": 0.001}, engine={"version": "0.3.36"}),
            _row("q4_0", 4.5, None, None, None, None, runtime="vllm", refused="vLLM cannot load q4_0 GGUF here")]
    eval_doc = {"rows": rows, "notes": ["a note"], "provenance": {
        "model": MODEL, "qkit_version": __version__, "torch_version": "2.9.0", "scored_tokens": 2047, "window": 2048,
        "corpus": {"name": "kjv-ruth", "sha256": "ab" * 32}, "model_source": {"sha256": "cd" * 32}, "seconds_total": 812.5}}
    matrices = []
    for layer in (0, 1):
        for j, m in enumerate(MATS):
            for k, s in enumerate(("int8-row", "q4_k")):
                matrices.append({"name": f"model.layers.{layer}.{m}.weight", "scheme": s, "rel_error": 0.01 * (k * 4 + 1) + 0.001 * j + 0.0001 * layer,
                                 "bytes": 100, "parameters": 100, "max_over_std": 10.0, "shape": [10, 10]})
    errors_doc = {"model": MODEL, "matrices": matrices, "granularity_ratios": [], "seconds": 204.2,
                  "schemes": [{"scheme": "int8-row", "bits_per_weight": 8.02, "matrices": 14, "mean": 0.01, "median": 0.01,
                               "worst": 0.0161, "worst_matrix": "model.layers.1.mlp.down_proj.weight"},
                              {"scheme": "q4_k", "bits_per_weight": 5.25, "matrices": 14, "mean": 0.05, "median": 0.05,
                               "worst": 0.0561, "worst_matrix": "model.layers.1.mlp.down_proj.weight"}]}
    outliers_doc = {"model": MODEL, "hidden": 8, "layer": 1, "source": "corpora/outliers_prompt.txt", "threshold": 20.0, "tokens": 78,
                    "histogram": [{"lo": 0.0, "hi": 1.0, "count": 0}, {"lo": 1.0, "hi": 2.0, "count": 5},
                                  {"lo": 2.0, "hi": 4.0, "count": 2}, {"lo": 4.0, "hi": 8.0, "count": 0},
                                  {"lo": 64.0, "hi": 128.0, "count": 1}],
                    "per_layer": [{"layer": 0, "max": 30.0, "median_dim_max": 1.5, "outliers": [], "top": []},
                                  {"layer": 1, "max": 100.0, "median_dim_max": 1.7, "outliers": [5], "top": []}],
                    "outlier_dims": [{"dim": 5, "values": [30.0, 100.0], "layers": [1], "n_layers": 1, "layer_ranges": "1",
                                      "peak": 100.0, "peak_layer": 1, "near_peak_layers": "1"}],
                    "int8": {"excluded_dims": [5], "all": {"scale": 0.787, "levels_used": 11, "levels_total": 256,
                                                           "typical": [{"dim": 1, "levels": 1, "max_abs": 1.2}]},
                             "without_top": {"scale": 0.03, "levels_used": 80, "levels_total": 256,
                                             "typical": [{"dim": 1, "levels": 40, "max_abs": 1.2}]}},
                    "linear_inputs": []}
    sens_doc = {"model": MODEL, "by": "layer", "scheme": "int4-g128", "keep_scheme": "int8-row", "tokens": 128,
                "source": "pinned corpus", "note": "one measurement", "standard_error": None, "residual_outlier_dims": [5],
                "suggestion": {"sentence": "keep layer 1"},
                "units": [{"name": "model.layers.1", "kl": 0.2, "rel_error": 0.12, "input_outlier_dims": [5]},
                          {"name": "model.layers.0", "kl": 0.05, "rel_error": 0.11, "input_outlier_dims": []}]}
    plan_doc = {"format": "qkit-plan", "format_version": 1, "qkit_version": __version__, "model": MODEL,
                "model_fingerprint": "ef" * 32, "target_format": "gguf", "method": "rtn", "target": {"scheme": "q4_k_m"},
                "tensors": {"model.layers.0.mlp.down_proj.weight": {"type": "q6_k", "shape": [576, 1536], "bytes": 725760, "predicted_kl": 0.001},
                            "model.layers.1.self_attn.q_proj.weight": {"type": "q4_k", "shape": [576, 576], "bytes": 186624, "predicted_kl": 0.002}},
                "totals": {"bytes": 912384, "weights": 1216512, "bits_per_weight": 6.0, "predicted_kl": 0.003}}
    kv_doc = {"architecture": {"name": MODEL, "layers": 30}, "bytes_per_token": 23040, "dtype": "fp16", "tokens": 2048, "users": 1,
              "total_bytes": 47185920, "measured": None, "equivalent_splits": [],
              "variants": [{"attention": "this model", "kv_heads": 3, "bytes_per_token": 23040, "total_bytes": 47185920},
                           {"attention": "MQA (1 kv head)", "kv_heads": 1, "bytes_per_token": 7680, "total_bytes": 15728640}]}
    budget_doc = {"conversation": 4096, "formats": {"fp16": None}, "kv_dtype": "fp16", "reserve_gib": 1.0,
                  "models": [{"label": "default", "architecture": {"name": MODEL}, "parameters": 134515008}],
                  "tables": [{"gpu_gib": g, "sentence": "", "rows": [
                      {"model": "default", "format": f, "max_tokens": int(g * 1000) + i, "weight_bytes": 1000 * (i + 1),
                       "conversations": 7, "status": "fits"} for i, f in enumerate(("fp16", "int8"))]} for g in (8.0, 16.0)]}
    return {"eval": eval_doc, "errors": errors_doc, "outliers": outliers_doc, "sensitivity": sens_doc, "plan": plan_doc,
            "kv": kv_doc, "budget": budget_doc}


def write_docs(tmp_path: Path, docs: dict[str, dict] | None = None) -> dict[str, Path]:
    paths = {}
    for kind, doc in (docs or make_docs()).items():
        p = tmp_path / f"{kind}-data.json"
        p.write_text(json.dumps(doc))
        paths[kind] = p
    return paths
