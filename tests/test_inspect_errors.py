"""``qkit inspect errors`` / ``matrix``: statistics computed by hand, errors against independent oracles."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from qkit.checkpoint import ShardWriter, iter_tensors
from qkit.cli import app
from qkit.errors import InputError
from qkit.inspect.errors import (
    inspect_matrix,
    int4_tensor_levels,
    matrix_stats,
    split_model_and_name,
    top_matrices,
    weight_errors,
)
from qkit.transform import is_block_projection

PLANTED = "model.layers.1.mlp.down_proj.weight"  # [64, 160] in the tiny model
SMALL, HUGE = 2.0**-7, 4.0  # exactly representable in fp32 and fp16


def planted_weight(shape=(64, 160)) -> torch.Tensor:
    """Half the weights +2^-7, half -2^-7 (row-major), then the first one replaced by 4.0."""
    n = shape[0] * shape[1]
    w = torch.cat([torch.full((n // 2,), SMALL), torch.full((n // 2,), -SMALL)])
    w[0] = HUGE
    return w.reshape(shape)


def hand_stats(n=64 * 160):
    # values: one 4.0, n/2 - 1 of +2^-7, n/2 of -2^-7
    total = HUGE + (n // 2 - 1) * SMALL - (n // 2) * SMALL
    mean = total / n
    ex2 = (HUGE**2 + (n - 1) * SMALL**2) / n
    std = math.sqrt(ex2 - mean**2)
    mean_abs = (HUGE + (n - 1) * SMALL) / n
    return mean, std, mean_abs


@pytest.fixture(scope="module")
def planted_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with PLANTED replaced by planted_weight()."""
    import shutil

    d = tmp_path_factory.mktemp("planted") / "model"
    shutil.copytree(tiny_model_dir, d)
    (d / "model.safetensors").unlink()
    writer = ShardWriter(d)
    for name, t in iter_tensors(tiny_model_dir):
        writer.add(name, planted_weight(tuple(t.shape)) if name == PLANTED else t)
    writer.close()
    return d


def test_stats_of_a_planted_matrix_match_the_hand_computation():
    mean, std, mean_abs = hand_stats()
    s = matrix_stats(planted_weight(), "w")
    assert s.std == pytest.approx(std, rel=1e-12)
    assert s.mean_abs == pytest.approx(mean_abs, rel=1e-12)
    assert s.max_abs == HUGE
    assert s.max_over_std == pytest.approx(HUGE / std, rel=1e-12)  # about 99.3
    assert 99 < s.max_over_std < 100
    # |4 - mean| > 6 std; every |±2^-7 - mean| is far below it: exactly one weight beyond 6 sigma
    assert s.beyond_6sigma == 1
    assert s.share_beyond_6sigma == 1 / (64 * 160)


def test_six_sigma_count_on_a_second_hand_example():
    # 1000 values: 61, 499 x (+1), 500 x (-1): mean 0.06, E[w^2] = 4.72, std = sqrt(4.72 - 0.0036)
    w = torch.cat([torch.tensor([61.0]), torch.ones(499), -torch.ones(500)]).reshape(40, 25)
    s = matrix_stats(w)
    assert s.std == pytest.approx(math.sqrt(4.7164), rel=1e-12)
    assert s.mean_abs == pytest.approx(1.06, rel=1e-12)
    assert s.beyond_6sigma == 1
    w[1, 0] = -20.0  # |-20 - mean'| vs 6 std': std' = sqrt((3721 + 400 + 998)/1000 - 0.039^2) = 2.2624
    assert matrix_stats(w).beyond_6sigma == 2


def test_int4_per_tensor_flattens_the_planted_matrix():
    lv = int4_tensor_levels(planted_weight())
    # step = 4 / 7 (fp16); every +-2^-7 rounds to 0: the typical weights use one level, all weights two (0 and 7)
    assert lv["scale"] == pytest.approx(float(torch.tensor(4 / 7, dtype=torch.float16)), rel=0)
    assert lv["typical_levels_used"] == 1
    assert lv["levels_used"] == 2
    assert lv["zero_share"] == 1 - 1 / (64 * 160)


def _np_absmax(w: np.ndarray, bits: int, unit: str, group: int = 128) -> np.ndarray:
    """Independent numpy absmax: fp16 scales, round half to even, clamp; per tensor, row or group."""
    qmax = 2 ** (bits - 1) - 1
    rows, cols = w.shape
    if unit == "tensor":
        units = w.reshape(1, -1)
    elif unit == "row":
        units = w
    else:
        pad = (-cols) % group
        units = np.pad(w, ((0, 0), (0, pad))).reshape(-1, group)
    scale = (np.abs(units).max(axis=1, keepdims=True) / qmax).astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, 1)
    q = np.clip(np.round(units / safe), -qmax - 1, qmax)
    out = (q * scale).astype(np.float32)
    if unit == "group":
        out = out.reshape(rows, -1)[:, :cols]
    return out.reshape(rows, cols)


def test_per_matrix_errors_match_an_independent_computation(tiny_model_dir):
    report = weight_errors(tiny_model_dir, schemes=["int8-row", "int4-tensor", "int4-g128"])
    got = {(m.name, m.scheme): m.rel_error for m in report.matrices}
    weights = {n: t.numpy() for n, t in iter_tensors(tiny_model_dir) if is_block_projection(n, tuple(t.shape))}
    assert len(weights) == 14 and len(got) == 14 * 3
    for name, w in weights.items():
        for scheme, (bits, unit) in {"int8-row": (8, "row"), "int4-tensor": (4, "tensor"), "int4-g128": (4, "group")}.items():
            w_hat = _np_absmax(w, bits, unit)
            expect = np.linalg.norm((w - w_hat).astype(np.float64)) / np.linalg.norm(w.astype(np.float64))
            assert got[(name, scheme)] == pytest.approx(expect, rel=1e-6), (name, scheme)


def test_nf4_errors_match_bitsandbytes(tiny_model_dir):
    bnbf = pytest.importorskip("bitsandbytes.functional")
    report = weight_errors(tiny_model_dir, schemes=["nf4"], scale_dtype="fp32")
    for m in report.matrices:
        w = dict(iter_tensors(tiny_model_dir))[m.name]
        # bitsandbytes' blocks run over the flattened tensor; its CPU dequantize_4bit (0.50.2) returns wrong
        # values for a 2-D [64, 160] input, so the oracle is given the flat tensor.
        packed, state = bnbf.quantize_4bit(w.reshape(-1), blocksize=64, quant_type="nf4")
        w_hat = bnbf.dequantize_4bit(packed, state).reshape(w.shape)
        expect = torch.linalg.vector_norm((w - w_hat).double()) / torch.linalg.vector_norm(w.double())
        assert m.rel_error == pytest.approx(float(expect), rel=1e-7)


def test_summary_rows_bits_and_ratio_sentence(tiny_model_dir):
    r = weight_errors(tiny_model_dir)
    sums = {s.scheme: s for s in r.summaries()}
    assert list(sums) == ["int8-tensor", "int8-row", "int4-tensor", "int4-row", "int4-g128", "nf4"]
    assert all(s.matrices == 14 for s in sums.values())
    assert sums["nf4"].bits_per_weight == 4.25  # 64 | every tiny matrix size
    assert sums["int8-tensor"].bits_per_weight == pytest.approx(8 + 16 * 14 / sums["int8-tensor"].parameters)
    errs = [m.rel_error for m in r.for_scheme("int4-row")]
    assert sums["int4-row"].mean == pytest.approx(sum(errs) / len(errs))
    assert sums["int4-row"].worst == max(errs)
    ratios = {(x["from"], x["to"]): x["factor"] for x in r.granularity_ratios()}
    assert set(ratios) == {("int8-tensor", "int8-row"), ("int4-tensor", "int4-row"), ("int4-row", "int4-g128"), ("int4-g128", "nf4")}
    assert ratios[("int4-tensor", "int4-row")] == pytest.approx(sums["int4-tensor"].mean / sums["int4-row"].mean)
    s = r.ratio_sentence()
    assert s.startswith("int8: per-row divides the per-tensor mean error by ")
    assert "int4: per-row divides the per-tensor mean error by" in s and "per-group-128 by a further" in s


def test_inspect_matrix_on_a_planted_checkpoint(planted_dir):
    r = inspect_matrix(planted_dir, name="model.layers.1.mlp.down_proj")  # ".weight" optional
    _, std, _ = hand_stats()
    assert r.stats.name == PLANTED
    assert r.stats.max_over_std == pytest.approx(HUGE / std, rel=1e-12)
    assert r.stats.beyond_6sigma == 1
    assert r.int4_tensor["typical_levels_used"] == 1
    # int4 per tensor keeps only the 4.0: the error is the norm of everything else over the total norm
    n = 64 * 160
    assert r.errors["int4-tensor"] == pytest.approx(math.sqrt((n - 1) * SMALL**2 / (HUGE**2 + (n - 1) * SMALL**2)), rel=1e-6)
    # int8 per row: row 0 (step 4/127) loses its 159 small weights (2^-7 / (4/127) rounds to 0); the other
    # 63 rows keep theirs up to the fp16 rounding of their step (relative 2^-11, negligible here)
    assert r.errors["int8-row"] == pytest.approx(math.sqrt(159 * SMALL**2 / (HUGE**2 + (n - 1) * SMALL**2)), rel=1e-3)
    top = top_matrices(planted_dir, top=3)
    assert top[0].name == PLANTED and len(top) == 3
    assert top[0].max_over_std > top[1].max_over_std


def test_typo_gets_a_close_match_suggestion(tiny_model_dir):
    with pytest.raises(InputError, match="did you mean model.layers.1.mlp.down_proj.weight"):
        inspect_matrix(tiny_model_dir, name="model.layers.1.mlp.down_prj.weight")


def test_split_model_and_name(tmp_path):
    assert split_model_and_name([]) == (None, None)
    assert split_model_and_name(["model.layers.0.mlp.up_proj.weight"]) == (None, "model.layers.0.mlp.up_proj.weight")
    assert split_model_and_name([str(tmp_path)]) == (str(tmp_path), None)
    assert split_model_and_name(["org/model"]) == ("org/model", None)
    assert split_model_and_name(["m", "n"]) == ("m", "n")
    with pytest.raises(InputError):
        split_model_and_name(["a", "b", "c"])


def test_cli_errors_json_and_table(tiny_model_dir, tmp_path):
    out = tmp_path / "e.json"
    res = CliRunner().invoke(app, ["inspect", "errors", str(tiny_model_dir), "-s", "int4-tensor,int4-row", "--per-matrix", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "int4: per-row divides the per-tensor mean error by" in res.output
    assert "model.layers.0.self_attn.q_proj.weight" in res.output  # --per-matrix
    d = json.loads(out.read_text())
    assert len(d["matrices"]) == 28
    assert {"name", "scheme", "shape", "rel_error"} <= set(d["matrices"][0])
    assert [s["scheme"] for s in d["schemes"]] == ["int4-tensor", "int4-row"]


def test_cli_matrix_typo_is_one_line(tiny_model_dir):
    res = CliRunner().invoke(app, ["inspect", "matrix", str(tiny_model_dir), "model.layers.0.mlp.up_projj"])
    assert res.exit_code == 2
    assert "did you mean model.layers.0.mlp.up_proj.weight" in res.output
    assert "Traceback" not in res.output


def test_cli_unknown_scheme_is_one_line(tiny_model_dir):
    res = CliRunner().invoke(app, ["inspect", "errors", str(tiny_model_dir), "-s", "int3"])
    assert res.exit_code == 2 and "unknown scheme" in res.output and "Traceback" not in res.output


@pytest.mark.slow
def test_default_model_error_ordering(default_model_dir):
    r = weight_errors(default_model_dir, schemes=["int4-tensor", "int4-row", "int4-g128", "nf4"])
    m = {s.scheme: s.mean for s in r.summaries()}
    assert m["int4-tensor"] > m["int4-row"] > m["int4-g128"] > m["nf4"]
    assert len(r.stats) == 210


def test_a_recipe_is_bound_to_the_model_as_quantize_binds_it(tiny_model_dir, tmp_path):
    # q4_k_m chooses each tensor's type from the model's layer count: inspect errors measures the very
    # types (and bytes) qkit quantize writes, tensor by tensor.
    from qkit.api import quantize_model

    report = weight_errors(tiny_model_dir, schemes=["q4_k_m"])
    written = quantize_model(model=tiny_model_dir, output=tmp_path / "q", scheme="q4_k_m", collect=True)
    measured = {m.name: m.nbytes for m in report.matrices}
    assert measured == {n: q.nbytes for n, q in written.quantized.items() if n in measured}
    assert len(measured) == 14
