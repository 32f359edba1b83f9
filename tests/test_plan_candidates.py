"""The planner's candidates (``qkit.plan.candidates``): which types each format offers a tensor, and
their exact stored bytes, checked three ways: hand-written lists and golden byte counts for the default
model's four shapes, the schemes' own ``nbytes_for``, and the bytes of real mixed checkpoints written by
``quantize_model`` and read back with the ``gguf`` package's reader and safetensors' headers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import pytest
import torch
from conftest import make_tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from qkit.api import QuantizeOptions, quantize_model
from qkit.checkpoint import read_manifest, tensor_shapes
from qkit.errors import InputError
from qkit.export import compressed_tensors
from qkit.export.gguf import types as gguf_types
from qkit.plan.candidates import (
    KEEP,
    plan_formats,
    Candidate,
    candidates,
    check_format,
    ladder,
    parse_allowed,
)
from qkit.schemes import get_scheme
from qkit.transform import is_block_projection

F32 = torch.float32
# The default model's block projections: q/o (576, 576), k/v (192, 576), gate/up (1536, 576), down (576, 1536).
UP, KV, O, DOWN = (1536, 576), (192, 576), (576, 576), (576, 1536)
DEFAULT_SHAPES = (UP, KV, O, DOWN)

# ---------------------------------------------------------------------------------------------- by hand

# 576 = 18 * 32 is not a multiple of 256: no k-quant, no iq4_xs (they would fall back to another type).
GGUF_576 = ["iq4_nl", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", KEEP]
GGUF_1536 = ["q2_k", "q3_k", "iq4_xs", "iq4_nl", "q4_0", "q4_k", "q4_1", "q5_0", "q5_k", "q5_1", "q6_k", "q8_0", KEEP]
# 576 = 4.5 * 128: no int4-g128 (a short last group) on the 576-wide matrices.
CT_576 = ["int4-row", "mxfp4", "nvfp4", "int4-g64", "int4-g32", "int8-row", KEEP]
CT_1536 = ["int4-row", "mxfp4", "int4-g128", "nvfp4", "int4-g64", "int4-g32", "int8-row", KEEP]
QKIT_576 = ["int4-tensor", "int4-row", "int4-g64", "mxfp4", "nf4", "int4-g32", "iq4_nl", "q4_0", "nvfp4", "q4_1",
            "q5_0", "q5_1", "int8-tensor", "int8-row", "int8-g64", "int8-g32", "q8_0", KEEP]
QKIT_1536 = ["q2_k", "q3_k", "int4-tensor", "int4-row", "int4-g128", "int4-g64", "iq4_xs", "mxfp4", "nf4", "int4-g32",
             "iq4_nl", "q4_0", "q4_k", "nvfp4", "q4_1", "q5_0", "q5_k", "q5_1", "q6_k", "int8-tensor", "int8-row",
             "int8-g128", "int8-g64", "int8-g32", "q8_0", KEEP]
BY_HAND = {
    "gguf": {UP: GGUF_576, KV: GGUF_576, O: GGUF_576, DOWN: GGUF_1536},
    "compressed-tensors": {UP: CT_576, KV: CT_576, O: CT_576, DOWN: CT_1536},
    "qkit": {UP: QKIT_576, KV: QKIT_576, O: QKIT_576, DOWN: QKIT_1536},
}


@pytest.mark.parametrize("fmt", plan_formats())
@pytest.mark.parametrize("shape", DEFAULT_SHAPES)
def test_default_model_candidate_names(fmt, shape):
    got = candidates(fmt, shape, F32)
    assert [c.name for c in got] == BY_HAND[fmt][shape]
    assert [(c.nbytes, c.name) for c in got] == sorted((c.nbytes, c.name) for c in got)
    assert all((c.scheme is None) == (c.name == KEEP) for c in got)
    assert all(c.scheme is None or c.scheme.name == c.name for c in got)


def test_ladders_by_hand():
    assert ladder("gguf") == ("q2_k", "q3_k", "iq4_xs", "iq4_nl", "q4_0", "q4_k", "q4_1", "q5_0", "q5_k", "q5_1",
                              "q6_k", "q8_0", KEEP)
    assert ladder("ct") == ladder("compressed-tensors") == (
        "int4-row", "int4-g128", "mxfp4", "int4-g64", "nvfp4", "int4-g32", "int8-row", KEEP)
    assert set(ladder("qkit")) == set(QKIT_1536)  # every qkit candidate fits a 1536-wide matrix
    assert ladder("qkit")[-1] == KEEP and ladder("qkit")[:2] == ("q2_k", "q3_k")
    assert not {"q4_k_m", "q2_k-llama", "q3_k_m"} & set(ladder("qkit"))  # recipes are mixes, not types


# Golden byte counts, each worked out from the format's layout.
GOLDEN = [
    # gguf: rows * (cols / block) * type_size
    ("gguf", "q4_k", DOWN, F32, "fp16", 576 * 6 * 144),  # 497,664
    ("gguf", "q2_k", DOWN, F32, "fp16", 576 * 6 * 84),  # 290,304
    ("gguf", "q6_k", DOWN, F32, "fp16", 576 * 6 * 210),  # 725,760
    ("gguf", "q8_0", UP, F32, "fp16", 1536 * 18 * 34),  # 940,032
    ("gguf", "q4_0", KV, F32, "fp16", 192 * 18 * 18),  # 62,208
    (
        "gguf", KEEP, O, F32, "fp16", 576 * 576 * 4),  # F32: 1,327,104
    ("gguf", KEEP, O, torch.bfloat16, "fp16", 576 * 576 * 2),  # BF16
    # compressed-tensors: packed int32 words + weight_scale in the weight dtype + weight_shape int64[2]
    ("compressed-tensors", "int4-g64", UP, F32, "fp16", 1536 * 72 * 4 + 1536 * 9 * 4 + 16),  # 497,680
    ("compressed-tensors", "int4-g64", UP, torch.bfloat16, "bf16", 1536 * 72 * 4 + 1536 * 9 * 2 + 16),  # 470,032
    ("compressed-tensors", "int4-row", UP, F32, "fp16", 1536 * 72 * 4 + 1536 * 4 + 16),  # 448,528
    ("compressed-tensors", "int4-g128", DOWN, F32, "fp16", 576 * 192 * 4 + 576 * 12 * 4 + 16),  # 470,032
    ("compressed-tensors", "int8-row", DOWN, F32, "fp16", 576 * 384 * 4 + 576 * 4 + 16),  # 887,056
    ("compressed-tensors", "nvfp4", KV, F32, "fp16", 192 * 288 + 192 * 36 + 4),  # 62,212
    ("compressed-tensors", "mxfp4", DOWN, F32, "fp16", 576 * 768 + 576 * 48),  # 470,016
    ("compressed-tensors", KEEP, KV, F32, "fp16", 192 * 576 * 4),  # 442,368
    # qkit: what ShardWriter stores, scales in the scale dtype
    ("qkit", "int4-g64", UP, F32, "fp16", 1536 * 576 // 2 + 1536 * 9 * 2),  # 470,016
    ("qkit", "int4-g64", UP, F32, "fp32", 1536 * 576 // 2 + 1536 * 9 * 4),  # 497,664
    ("qkit", "int4-tensor", UP, F32, "fp16", 1536 * 576 // 2 + 2),  # 442,370
    ("qkit", "int8-row", UP, F32, "fp16", 1536 * 576 + 1536 * 2),  # 887,808
    ("qkit", "nf4", O, F32, "fp16", 576 * 576 // 2 + 576 * 576 // 64 * 2),  # 176,256
    ("qkit", "nvfp4", O, F32, "fp16", 576 * 288 + 576 * 36 + 4),  # 186,628
    ("qkit", "q4_k", DOWN, F32, "fp16", 576 * 6 * 144),  # 497,664
    ("qkit", KEEP, DOWN, torch.float16, "fp16", 576 * 1536 * 2),
]


@pytest.mark.parametrize(("fmt", "name", "shape", "dtype", "scale_dtype", "want"), GOLDEN)
def test_golden_bytes(fmt, name, shape, dtype, scale_dtype, want):
    got = {c.name: c for c in candidates(fmt, shape, dtype, scale_dtype=scale_dtype)}
    assert got[name].nbytes == want


def test_golden_compressed_tensors_function():
    assert compressed_tensors.stored_nbytes(get_scheme("int4-g64"), UP, F32) == 497_680
    assert gguf_types.tensor_nbytes(get_scheme("q4_k").ggml_type, DOWN) == 497_664


@pytest.mark.parametrize("fmt", ["gguf", "qkit"])
@pytest.mark.parametrize("shape", DEFAULT_SHAPES)
def test_nbytes_equal_schemes_own_count(fmt, shape):
    """GGUF's and qkit's stored bytes are the scheme's ``nbytes_for`` wherever the shape takes it natively."""
    for c in candidates(fmt, shape, F32):
        if c.scheme is not None:
            assert c.nbytes == c.scheme.nbytes_for(shape), c.name


@settings(max_examples=150, deadline=None, derandomize=True)
@given(rows=st.integers(1, 300), cols=st.one_of(st.integers(1, 1200), st.integers(1, 40).map(lambda k: 16 * k)),
       fmt=st.sampled_from(plan_formats()),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_native_only_property(rows, cols, fmt, dtype):
    """Only native fits: every candidate's ``resolve`` is itself and its blocks / groups divide the width;
    KEEP is always there with the source dtype's bytes; the list is sorted and within the ladder."""
    scale = "bf16" if dtype == torch.bfloat16 else "fp16"
    got = candidates(fmt, (rows, cols), dtype, scale_dtype=scale)
    names = [c.name for c in got]
    assert set(names) <= set(ladder(fmt)) and len(set(names)) == len(names)
    assert [(c.nbytes, c.name) for c in got] == sorted((c.nbytes, c.name) for c in got)
    keep = next(c for c in got if c.name == KEEP)
    assert keep.nbytes == rows * cols * dtype.itemsize
    for c in got:
        if c.scheme is None:
            continue
        assert c.scheme.resolve((rows, cols)) == c.scheme
        if fmt != "compressed-tensors":  # GGUF and qkit store exactly the scheme's own count
            assert c.nbytes == c.scheme.nbytes_for((rows, cols)), c.name
        block = getattr(c.scheme, "block_size", None) if c.scheme.kind in ("ggml", "fp4") else None
        group = getattr(getattr(c.scheme, "granularity", None), "size", None)
        for b in (block, group):
            assert b is None or cols % b == 0, (c.name, cols)
    every = {"gguf": {256: {"q2_k", "q3_k", "iq4_xs", "q4_k", "q5_k", "q6_k"}, 32: {"q4_0", "iq4_nl", "q8_0"}},
             "compressed-tensors": {128: {"int4-g128"}, 64: {"int4-g64"}, 32: {"int4-g32", "mxfp4"}, 16: {"nvfp4"},
                                    1: {"int4-row", "int8-row"}},
             "qkit": {256: {"q6_k", "iq4_xs"}, 128: {"int8-g128"}, 64: {"int4-g64"}, 32: {"q8_0", "mxfp4"},
                      16: {"nvfp4"}, 1: {"nf4", "int4-tensor", "int8-row"}}}[fmt]
    for width, some in every.items():
        assert (some <= set(names)) == (cols % width == 0), (width, some)
        assert not (some & set(names)) or cols % width == 0


# ---------------------------------------------------------------------------------------------- allowed


def test_allowed_restricts_and_orders():
    got = candidates("gguf", DOWN, F32, allowed=["Q6_K,q4_k", "none", "q4_k"])
    assert [c.name for c in got] == ["q4_k", "q6_k", KEEP]
    assert parse_allowed("gguf", ["q8_0 q4_k", "none"]) == ("q4_k", "q8_0", KEEP)
    assert parse_allowed("ct", ["NVFP4", "int4-g64"]) == ("int4-g64", "nvfp4")
    # A shape none of the allowed types fits natively, but KEEP is allowed: KEEP only.
    assert candidates("gguf", O, F32, allowed=["q4_k", "none"]) == [Candidate(KEEP, None, 576 * 576 * 4)]


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg.strip() == msg
    return msg


def test_nothing_allowed_fits():
    with pytest.raises(InputError) as exc:
        candidates("gguf", O, F32, allowed=["q4_k", "q6_k"])
    msg = _one_line(exc)
    assert "[576, 576]" in msg and "q4_k, q6_k" in msg and "iq4_nl, q4_0, q4_1, q5_0, q5_1, q8_0, none" in msg


# ---------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("word", ["bitsandbytes", "bnb", " BitsAndBytes "])
def test_bitsandbytes_refused(word):
    with pytest.raises(InputError) as exc:
        check_format(word)
    assert _one_line(exc) == ("--format bitsandbytes stores one type (nf4: transformers) and cannot mix types; "
                              "plan for qkit, compressed-tensors, gguf")


def test_formats():
    assert check_format("CT") == check_format("compressed-tensors") == "compressed-tensors"
    assert check_format("gguf") == "gguf" and check_format("qkit") == "qkit"
    with pytest.raises(InputError) as exc:
        candidates("ggfu", O, F32)
    # the format registry's one wording (bitsandbytes is a format, refused then for storing one type)
    assert _one_line(exc) == "unknown format 'ggfu'; did you mean gguf? use one of: qkit, compressed-tensors, bitsandbytes, gguf"


@pytest.mark.parametrize(("fmt", "word", "expect"), [
    ("gguf", "q4k", "unknown candidate 'q4k'; did you mean q4_k?"),
    ("qkit", "nf5", "unknown candidate 'nf5'; did you mean nf4?"),
    ("compressed-tensors", "blah", "unknown candidate 'blah'; --format compressed-tensors offers: int4-row, int4-g128"),
])
def test_unknown_candidate(fmt, word, expect):
    with pytest.raises(InputError) as exc:
        parse_allowed(fmt, [word])
    assert _one_line(exc).startswith(expect)


@pytest.mark.parametrize(("fmt", "word"), [
    ("gguf", "nf4"), ("gguf", "mxfp4"), ("gguf", "int8-row"), ("compressed-tensors", "nf4"),
    ("compressed-tensors", "int4-g16"), ("compressed-tensors", "int8-g128"), ("compressed-tensors", "q4_k"),
    ("compressed-tensors", "int4-tensor"), ("qkit", "int4-g16"), ("qkit", "q4_k_m"), ("gguf", "q4_k_m"),
])
def test_candidate_not_in_ladder(fmt, word):
    with pytest.raises(InputError) as exc:
        parse_allowed(fmt, ["q8_0" if fmt == "gguf" else "int8-row", word])
    msg = _one_line(exc)
    assert msg.startswith(f"candidate {word} ") and f"--format {fmt}" in msg
    assert msg.endswith(", ".join(ladder(fmt)))
    if word == "q4_k_m":
        assert "recipe" in msg


@pytest.mark.parametrize("words", [[], [""], [" , "]])
def test_empty_candidates(words):
    with pytest.raises(InputError) as exc:
        parse_allowed("gguf", words)
    assert "names no candidate" in _one_line(exc)


def test_float_words_point_to_keep():
    with pytest.raises(InputError) as exc:
        parse_allowed("gguf", ["f16"])
    assert "candidate none" in _one_line(exc)


def test_compressed_tensors_scales_the_weight_dtype_cannot_hold():
    with pytest.raises(InputError) as exc:
        candidates("compressed-tensors", UP, torch.bfloat16, scale_dtype="fp16")
    assert "--scale-dtype bf16" in _one_line(exc)
    # FP4 scales are their own types (E4M3 / E8M0): an FP4-only plan does not need the scale dtype.
    got = candidates("compressed-tensors", UP, torch.bfloat16, scale_dtype="fp16", allowed=["nvfp4", "none"])
    assert [c.name for c in got] == ["nvfp4", KEEP]


@pytest.mark.parametrize(("shape", "dtype"), [((576,), F32), ((0, 576), F32), ((2, 3, 4), F32), (O, torch.int8),
                                              ((True, 32), F32)])
def test_bad_tensor(shape, dtype):
    with pytest.raises(InputError) as exc:
        candidates("qkit", shape, dtype)
    _one_line(exc)


# ---------------------------------------------------------------------------------------------- the written files

# Widths 288 (= 9 * 32: 32-blocks, FP4, int4-g32, but no k-quant and no group of 64 or 128) and 512 (every
# candidate), rows 144 / 288 / 512: each tensor gets every candidate its shape takes, mixed with the others.
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1}
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def mixed_model(request, tmp_path_factory) -> tuple[Path, torch.dtype]:
    d = tmp_path_factory.mktemp("plan") / "model"
    make_tiny_llama(d, hidden=288, intermediate=512, layers=2, dtype=request.param)
    return d, request.param


def _gguf_name(name: str) -> str:
    parts = name.split(".")  # model.layers.N.<module>.<proj>.weight
    return f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:5])]}.weight"


def _stored_gguf(path: Path, targets: list[str]) -> dict[str, tuple[int, str]]:
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    return {n: (int(tensors[_gguf_name(n)].n_bytes), tensors[_gguf_name(n)].tensor_type.name) for n in targets}


def _stored_safetensors(directory: Path, targets: list[str]) -> dict[str, tuple[int, list[str]]]:
    """Per module: the bytes (numel * itemsize from the headers) and suffixes of every key it stores."""
    keys: dict[str, tuple[int, str]] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                keys[k] = (math.prod(sl.get_shape()) * ITEMSIZE[sl.get_dtype()], sl.get_dtype())
    out = {}
    for n in targets:
        module = n.removesuffix(".weight") + "."
        mine = sorted(k for k in keys if k.startswith(module))
        out[n] = (sum(keys[k][0] for k in mine), [k[len(module):] for k in mine])
    return out


PARTS = {  # what each kind of candidate stores per module, by format
    "compressed-tensors": {"int": ["weight_packed", "weight_scale", "weight_shape"], "nvfp4":
                           ["weight_global_scale", "weight_packed", "weight_scale"],
                           "mxfp4": ["weight_packed", "weight_scale"], KEEP: ["weight"]},
}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", plan_formats())
def test_candidate_bytes_equal_written_files(fmt, mixed_model, tmp_path):
    """THE check: every candidate of every format, on every tensor whose shape takes it, mixed with the other
    candidates in one checkpoint, stores exactly ``Candidate.nbytes`` bytes in the file ``quantize_model`` writes."""
    model, dtype = mixed_model
    scale_dtype = {"compressed-tensors": "bf16", "qkit": "fp32"}.get(fmt, "fp16") if dtype == torch.bfloat16 else "fp16"
    shapes = {n: s for n, s in tensor_shapes(model) if is_block_projection(n, s)}
    targets = sorted(shapes)
    assert len(targets) == 14 and {s[1] for s in shapes.values()} == {288, 512}
    offered = {n: candidates(fmt, shapes[n], dtype, scale_dtype=scale_dtype) for n in targets}
    assert {c.name for c in offered["model.layers.0.mlp.down_proj.weight"]} == set(ladder(fmt))  # 512 wide
    assert len(offered["model.layers.0.mlp.up_proj.weight"]) < len(ladder(fmt))  # 288 wide: fewer
    seen: set[tuple[str, int]] = set()
    runs = max(len(c) for c in offered.values())
    for i in range(runs):
        plan = {n: offered[n][(i + j) % len(offered[n])] for j, n in enumerate(targets)}
        keep = tuple(f"{c.name}:{n}" for n, c in plan.items())
        out = tmp_path / (f"run{i}.gguf" if fmt == "gguf" else f"run{i}")
        default = {"gguf": "q8_0", "compressed-tensors": "int8-row", "qkit": "int8-row"}[fmt]  # every tensor overridden
        quantize_model(str(model), output=out, options=QuantizeOptions(
            scheme=default, scale_dtype=scale_dtype, keep=keep, format=fmt))
        if fmt == "gguf":
            stored = _stored_gguf(out, targets)
            for n, c in plan.items():
                want_type = (c.scheme.ggml_type.name if c.scheme is not None
                             else {torch.float32: "F32", torch.bfloat16: "BF16"}[dtype])
                assert stored[n] == (c.nbytes, want_type), (n, c.name)
        else:
            stored = _stored_safetensors(out, targets)
            if fmt == "qkit":
                written = read_manifest(out)["tensors"]
            else:
                written = json.loads((out / "qkit-export.json").read_text())["tensors"]
            for n, c in plan.items():
                nbytes, parts = stored[n]
                assert nbytes == c.nbytes, (n, c.name, parts)
                if c.scheme is None:
                    assert n not in written and parts == ["weight"]  # as read, in the source dtype
                    continue
                assert written[n]["scheme"]["name"] == c.name
                if fmt == "compressed-tensors":
                    kind = c.name if c.name in ("nvfp4", "mxfp4") else "int"
                    assert parts == PARTS[fmt][kind], (n, c.name)
                else:
                    assert parts == sorted(f"weight.{p}" for p in c.scheme.parts), (n, c.name)
        seen.update((c.name, shapes[n][1]) for n, c in plan.items())
    # Every candidate was written on the 512-wide tensors, and every one the 288-wide ones take on those.
    for width in (288, 512):
        want = {c.name for n in targets if shapes[n][1] == width for c in offered[n]}
        assert {name for name, w in seen if w == width} == want


def test_fused_groups_are_vllms_fused_layers_in_compressed_tensors_only():
    from qkit.plan.candidates import fused_groups

    names = [f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    names.append("model.layers.1.self_attn.q_proj.bias")  # not a weight: alone
    assert fused_groups("ct", names) == [[0, 1, 2], [3], [4, 5], [6], [7, 8, 9], [10], [11, 12], [13], [14]]
    for fmt in ("gguf", "qkit"):
        assert fused_groups(fmt, names) == [[i] for i in range(len(names))]


def test_a_budget_named_by_a_scheme_is_its_bytes_in_the_plans_format():
    """plan:ct@int4-g64 gets what int4-g64 stores in compressed-tensors (scales in the fp32 weight dtype,
    plus weight_shape), not qkit's own fp16-scale bytes: the plan competes with the uniform row's real size."""
    from qkit.plan.budget import budget_bytes
    from qkit.plan.options import PlanOptions

    shapes = {"m.weight": (512, 256)}
    ct = budget_bytes(PlanOptions(format="ct", target_scheme="int4-g64"), 512 * 256, shapes, None, {"m.weight": torch.float32})
    assert ct == 512 * (256 * 4 // 32) * 4 + 512 * (256 // 64) * 4 + 16  # 73,744: int32 words + fp32 scales + shape
    own = budget_bytes(PlanOptions(format="qkit", target_scheme="int4-g64"), 512 * 256, shapes, None, {"m.weight": torch.float32})
    assert own == 512 * 256 // 2 + 512 * (256 // 64) * 2  # 69,632: codes + fp16 scales
    bf16 = budget_bytes(PlanOptions(format="ct", target_scheme="int4-g64"), 512 * 256, shapes, None, {"m.weight": torch.bfloat16})
    assert bf16 == 512 * 32 * 4 + 512 * 4 * 2 + 16
