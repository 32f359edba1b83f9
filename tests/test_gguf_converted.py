"""``qkit quantize --format gguf`` of an architecture qkit's own GGUF writer does not name (``qkit.converted``):
llama.cpp's converter writes the F32 GGUF, and qkit writes llama-quantize's file from it.

The file the command writes is checked tensor for tensor against ``tests/golden/requantize.json``, the
bytes llama-quantize wrote from the same F32 file (``test_golden_requantize.py`` records them), so the
command line, the conversion and the requantization are checked together, for a dense model (qwen3, q4_k_m)
and a mixture-of-experts one (qwen3_moe, mxfp4_moe). The refusals come in one line, exit 2, before any work.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers_archs import make_arch_model, spm_tokenizer
from helpers_requantize import SPM_ARCHS, file_digest, seeded_imatrix
from typer.testing import CliRunner

from qkit.cli import app
from qkit.export.gguf import read_kv_fields
from qkit.export.gguf.metadata import RECORD_KEY
from qkit.export.gguf.reader import read_header
from qkit.export.gguf.requantize import output_fields

GOLDEN = json.loads((Path(__file__).parent / "golden" / "requantize.json").read_text())


@pytest.fixture(scope="module")
def models(default_model_dir, tmp_path_factory):
    """The golden test's models: qwen3 and qwen3_moe with the default model's tokenizer, gemma2 and phi3 with
    ``spm_tokenizer``'s (``helpers_requantize.SPM_ARCHS``)."""
    work = tmp_path_factory.mktemp("converted")
    spm = spm_tokenizer(work / "spm")
    return {arch: make_arch_model(work / arch, arch, spm if arch in SPM_ARCHS else default_model_dir)
            for arch in ("qwen3", "qwen3_moe", "gemma2", "phi3")}


@pytest.mark.parametrize(("arch", "scheme"), [("qwen3", "q4_k_m"), ("qwen3_moe", "mxfp4_moe"), ("gemma2", "q4_k_m"),
                                              ("phi3", "q4_k_m")])
def test_the_command_writes_llama_quantizes_file_for_another_architecture(models, tmp_path, arch, scheme):
    """A recipe on dense models (gemma2 and phi3 with a SentencePiece tokenizer), and MXFP4_MOE (its experts
    in MXFP4, the rest Q8_0) on a mixture-of-experts one."""
    out = tmp_path / f"{arch}.gguf"
    r = CliRunner().invoke(app, ["quantize", str(models[arch]), "-s", scheme, "--format", "gguf", "-o", str(out)])
    assert r.exit_code == 0, r.output
    golden = GOLDEN["archs"][arch]["files"][scheme]["tensors"]
    assert file_digest(out)["tensors"] == golden
    assert "written from llama.cpp's converter's F32 GGUF" in r.output
    assert RECORD_KEY in read_header(out).fields  # qkit's record, the one difference from llama-quantize's file


@pytest.mark.parametrize(("extra", "says"), [
    (["--method", "awq"], "--method awq with --format gguf writes llama and qwen2 models"),
    (["--keep", "none:*.down_proj.weight"], "--keep with --format gguf is for llama and qwen2 models"),
    (["--tensor-type", "attn_v=q8_0"], "--tensor-type with --format gguf is for llama and qwen2 models"),
])
def test_what_the_converted_route_does_not_take_is_refused_in_one_line(models, tmp_path, extra, says):
    out = tmp_path / "x.gguf"
    r = CliRunner().invoke(app, ["quantize", str(models["qwen3"]), "-s", "q4_k_m", "--format", "gguf", "-o", str(out),
                                 *extra])
    assert r.exit_code == 2, r.output
    assert says in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_the_tokenizer_fields_of_a_source_gguf_replace_the_converters(models):
    """A model converted from a GGUF keeps that GGUF's tokenizer: the F32's ``tokenizer.*`` fields are dropped
    and the source's written after the other fields, before the ones llama-quantize appends."""
    from qkit.export.gguf.converter import convert_f32

    f32 = read_header(convert_f32(models["qwen3"]))
    ours = [("tokenizer.ggml.model", 8, b"llama", None), ("tokenizer.ggml.tokens", 9, [b"a", b"b"], 8)]
    fields = output_fields(f32, 15, None, ours)
    keys = [f[0] for f in fields]
    assert [f for f in fields if f[0].startswith("tokenizer.")] == ours
    assert keys[-2:] == ["general.quantization_version", "general.file_type"]
    assert keys.index("tokenizer.ggml.model") > max(i for i, k in enumerate(keys) if k.startswith("qwen3."))
    assert any(k.startswith("tokenizer.") for k, *_ in read_kv_fields(convert_f32(models["qwen3"])))


@pytest.mark.parametrize(("arch", "scheme"), [("mistral", "q4_k"), ("qwen3_moe", "q4_k"), ("gpt_oss", "q4_k"),
                                            ("phi3", "q4_k_m")])
def test_gptq_codes_land_where_the_converter_puts_their_rows(default_model_dir, tmp_path, monkeypatch, arch, scheme):
    """mistral: llama.cpp permutes its q/k rows; qwen3_moe: it stacks each layer's experts into one tensor,
    and each expert's importance is its own row of the stacked entry; gpt_oss: it transposes each fused
    ``[experts, in, out]`` tensor and splits gate_up_proj by alternate columns, so GGUF row ``(e, j)`` of
    ``ffn_gate_exps`` holds row ``j`` of GPTQ's codes for expert ``e``'s gate matrix (the even columns); phi3:
    it keeps the fused ``qkv_proj`` and ``gate_up_proj`` fused (``attn_qkv``, ``ffn_up``: the rows in order),
    and Q4_K_M's rules give its matrices Q4_K or Q6_K (llama-quantize's --dry-run types, recorded in
    requantize.json). ``--method gptq --format gguf`` writes, in each GGUF tensor, exactly the block rows GPTQ
    chose for the Hugging Face matrix, each at the row the converter's map says, GPTQ ran each matrix at its
    GGUF tensor's type, and it was given, for each matrix, the importance row qkit's own route gives it
    (``quant_weights_for``, llama-quantize's slicing)."""
    from qkit.checkpoint import tensor_shapes
    from qkit.export.gguf.converter import convert_f32, row_map
    from qkit.export.gguf.types import ggml_blocks
    from qkit.methods.gptq import GPTQMethod
    from qkit.methods.imatrix import quant_weights_for, read
    from qkit.methods.imatrix.file import write_gguf
    from qkit.models import read_config

    # phi3: its BPE tokenizer named as Phi-4's, the embedding tied (half the bytes of this 49,152-token vocabulary)
    model = make_arch_model(tmp_path / arch, arch, default_model_dir, tie=arch == "phi3")
    small = ["--calibration-samples", "4", "--calibration-seqlen", "128"]
    if arch in ("qwen3_moe", "gpt_oss"):  # an importance matrix whose expert rows all differ, one expert reached by no token
        write_gguf(seeded_imatrix(convert_f32(model), 3), tmp_path / "m.imatrix.gguf")
        small += ["--imatrix", str(tmp_path / "m.imatrix.gguf")]
    seen = {}
    run = GPTQMethod.run

    def spy(self, ref, targets, options, **kw):  # the one GPTQ run the command makes, kept to compare with
        seen.update(targets=targets, weights=kw.get("quant_weights"), done=run(self, ref, targets, options, **kw))
        return seen["done"]

    monkeypatch.setattr(GPTQMethod, "run", spy)
    gguf_out = tmp_path / "g.gguf"
    r = CliRunner().invoke(app, ["quantize", str(model), "-s", scheme, "--method", "gptq", "--format", "gguf",
                                 "-o", str(gguf_out), *small])
    assert r.exit_code == 0, r.output
    codes = {n: ggml_blocks(qt).numpy() for n, qt in seen["done"].quantized.items()}
    if arch in ("qwen3_moe", "gpt_oss"):
        theirs = quant_weights_for(read(tmp_path / "m.imatrix.gguf"), read_config(model), dict(tensor_shapes(model)),
                                   seen["targets"])
        assert sorted(seen["weights"]) == sorted(theirs) and len(theirs) == 32  # 8 attention, 24 expert matrices
        assert all(torch.equal(seen["weights"][n], theirs[n]) for n in theirs)
    rows = row_map(model)
    header = read_header(gguf_out)
    data = gguf_out.read_bytes()
    names = list(rows.hf)
    checked, types = 0, {}
    for info in header.tensors:
        g = rows.gguf.get(info.name)
        if g is None or g.kind != "rows" or not all(names[int(k)] in codes for k in np.unique(g.src)):
            continue
        per_row = codes[names[int(g.src[0])]].shape[-1]
        expect = np.stack([codes[names[int(k)]].reshape(-1, per_row)[int(f)] for k, f in zip(g.src, g.flat)])
        start = header.data_offset + info.offset
        assert data[start:start + expect.nbytes] == expect.tobytes(), info.name
        assert {seen["targets"][names[int(k)]].ggml_type for k in np.unique(g.src)} == {info.ggml_type}, info.name
        types[info.name] = gguf.GGMLQuantizationType(info.ggml_type).name
        checked += 1
    offsets = {info.name: header.data_offset + info.offset for info in header.tensors}
    split = [(i, g, m) for i in range(2) for g, m in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))]
    for i, g, m in split if arch == "gpt_oss" else []:  # by hand, not by the row map: expert e's rows, in order
        name = f"blk.{i}.ffn_{g}_exps.weight"
        assert rows.gguf[name].kind == "transposed"
        expect = np.concatenate([codes[f"model.layers.{i}.mlp.experts.{e}.{m}.weight"] for e in range(4)])
        assert data[offsets[name]:offsets[name] + expect.nbytes] == expect.tobytes(), name
        checked += 1
    if arch == "phi3":  # 2 layers x qkv, o, gate_up, down: each fused matrix one tensor, at llama-quantize's type
        dry = GOLDEN["archs"]["phi3"]
        want = dict(zip(dry["order"], dry["dry_run"]["Q4_K_M"]))
        assert checked == 8 and types == {n: want[n] for n in types}
        assert set(types.values()) == {"Q4_K", "Q6_K"}  # each matrix calibrated at its own tensor's type
        qkv = rows.gguf["blk.0.attn_qkv.weight"]
        assert np.array_equal(qkv.flat, np.arange(len(qkv.flat)))  # q, k, v rows kept in order, in one tensor
        return
    assert checked == 14  # 2 layers x q, k, v, o, gate, up, down (stacked experts: one tensor each)
    if arch == "mistral":
        q = rows.gguf["blk.0.attn_q.weight"]
        assert not np.array_equal(q.flat, np.arange(len(q.flat)))  # the permutation was exercised
    elif arch == "qwen3_moe":
        assert len(np.unique(rows.gguf["blk.1.ffn_down_exps.weight"].src)) == 4  # four experts' matrices stacked
    else:  # gpt_oss: GPTQ solved the experts routers reach, rtn wrote the others (their codes checked alike)
        fell = seen["done"].record["experts"]["rtn_fallback"]
        solved = [n for n, r in seen["done"].record["layers"].items() if ".experts." in n and "gptq_error" in r]
        assert len(fell) + len(solved) == 24 and solved
        assert all(seen["done"].record["layers"][n]["gptq_error"] < seen["done"].record["layers"][n]["rtn_error"]
                   for n in solved)


def test_codes_that_decode_to_zeros_are_refused_before_the_file_is_in_place(models, tmp_path):
    """Every quantized tensor of a converted file is checked against its source (``fidelity.check_written``),
    a method's codes included: block bytes of zeros for one tensor are refused, naming it, and no file is left."""
    from qkit.errors import QkitError
    from qkit.export.gguf.converter import convert_f32
    from qkit.export.gguf.requantize import quantize_gguf

    out = tmp_path / "zeros.gguf"

    def zeros(name, t):
        if name != "blk.0.ffn_up.weight":
            return None
        info = next(i for i in read_header(f32).tensors if i.name == name)
        from qkit.export.gguf.requantize import tensor_bytes
        return np.zeros(tensor_bytes(t, info.ne), dtype=np.uint8)

    f32 = convert_f32(models["qwen3"])
    with pytest.raises(QkitError) as exc:
        quantize_gguf(f32, out, "Q4_K_M", blocks=zeros)
    assert "blk.0.ffn_up.weight" in str(exc.value) and "\n" not in str(exc.value)
    assert not out.exists()
