"""``--max-memory`` for ``qkit quantize`` and ``qkit imatrix``: the estimate's parts against hand arithmetic
for a hand-sized model, a budget below it refused in one line before the model loads (nothing written), and
the estimate held above the measured peak of the step it bounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama
from helpers_memory import peak_rss
from typer.testing import CliRunner

from qkit.choice import QuantizeOptions, memory_need, request
from qkit.checkpoint import tensor_shapes
from qkit.cli import app
from qkit.errors import InputError
from qkit.memory import GIB
from qkit.methods.gptq import GPTQMethod, GPTQOptions
from qkit.methods.imatrix import ImatrixOptions, check_collect_memory
from qkit.methods.imatrix.collect import collect_memory
from qkit.methods.memory import BASELINE, Model, Need, check_need, quantized_bytes, stream_parts
from qkit.models import read_config, resolve
from qkit.schemes import get_scheme

runner = CliRunner()

# A hand-sized llama: hidden 64, intermediate 128, 4 heads of 16, 2 key-value heads (kv width 32), 2 layers,
# a vocabulary of 256, the head untied.
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256}
LINEARS = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
           "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
           "mlp.down_proj": (64, 128)}
SHAPES = {"model.embed_tokens.weight": (256, 64), "model.norm.weight": (64,), "lm_head.weight": (256, 64)}
for _i in range(2):
    SHAPES.update({f"model.layers.{_i}.{k}.weight": v for k, v in LINEARS.items()})
    SHAPES.update({f"model.layers.{_i}.input_layernorm.weight": (64,), f"model.layers.{_i}.post_attention_layernorm.weight": (64,)})
TARGETS = [n for n in SHAPES if ".layers." in n and n.endswith("proj.weight")]
# numel: embed and head 16384 each, a block's linears 4096+2048+2048+4096+3*8192 = 36864 and norms 128, the
# final norm 64: 16384*2 + 2*(36864+128) + 64 = 106816.


def _model(stored: torch.dtype, dtype: torch.dtype) -> Model:
    return Model.of(SHAPES, {n: stored for n in SHAPES}, CONFIG, dtype)


def test_the_shape_terms_are_the_hand_arithmetic():
    m = _model(torch.bfloat16, torch.float32)
    assert (m.dims.hidden, m.dims.inter, m.dims.heads, m.dims.kv, m.dims.layers, m.dims.vocab) == (64, 128, 4, 32, 2, 256)
    assert m.loaded() == 4 * 106816 and m.checkpoint == 2 * 106816 and m.load == 2 * 2 * 16384
    assert not m.mapped and _model(torch.bfloat16, torch.bfloat16).mapped == sys.platform.startswith("linux")
    assert m.activations(4, 16) == 2 * 4 * 16 * 64 * 4 == 32768
    # B*T*(4h + 2kv + 3i)*a + B*heads*T^2*4 for 4 windows of 16 tokens in fp32
    assert m.block_forward(4, 16) == 4 * 16 * (256 + 64 + 384) * 4 + 4 * 4 * 256 * 4 == 196608
    # the largest target (8192 numel) as stored (bf16) and its quantize's float32 copies (a llama.cpp type 2,
    # absmax 3, nf4 6), times 1.25; a shard of 1000 bytes held, serialized and freed
    q8 = {n: get_scheme("q8_0") for n in TARGETS}
    assert stream_parts(m, q8, True, 1000) == {"one tensor's quantize": 102400, "the writer's shard": 3000}  # 1.25 * 81920
    for scheme, copies in (("int4-g64", 3), ("nf4", 6)):
        mixed = {**q8, "model.layers.1.mlp.down_proj.weight": get_scheme(scheme)}
        assert stream_parts(m, mixed, False)["one tensor's quantize"] == int(1.25 * (2 * 8192 + copies * 4 * 8192))
    assert stream_parts(m, q8, False)["the writer's shard"] == 0
    # a shard larger than the output holds the output: the targets in q8_0 (2*36864/32 blocks of 34 bytes),
    # the rest as stored (embed, head and norms: 32768 + 2*128 + 64 numel in bf16)
    assert stream_parts(m, q8, True, 10**9)["the writer's shard"] == 3 * (2304 * 34 + 2 * 33088) == 433536
    # a width the scheme cannot store: counted at the load dtype (the step refuses it in its own words)
    odd = Model.of({"model.layers.0.mlp.down_proj.weight": (64, 80)}, {}, CONFIG, torch.float32)  # 2.5 blocks of 32
    mx = {"model.layers.0.mlp.down_proj.weight": get_scheme("mxfp4")}
    # stored dtype unknown: float32; 1.25 * (4 * 5120 + 2 * 4 * 5120)
    assert quantized_bytes(odd, mx) == 64 * 80 * 4 and stream_parts(odd, mx, False)["one tensor's quantize"] == 76800


def test_gptqs_need_is_the_hand_arithmetic():
    opts = GPTQOptions(calibration_samples=4, calibration_seqlen=16)
    q8 = get_scheme("q8_0")
    targets = {n: q8 for n in TARGETS}
    # one block's work: the forward 196608; Grams of the distinct inputs (q, o, gate: 64 wide; down: 128)
    # 4*(3*64^2 + 128^2) = 114688; the solver max(16*128^2, 4*128^2 + 24*8192) = 262144; the largest linear
    # in float32 32768. 1.25 * 606208 = 757760.
    work = int(1.25 * (196608 + 114688 + 262144 + 32768))
    assert work == 757760
    # stored bf16, loaded fp32: the whole model held
    assert GPTQMethod().memory(_model(torch.bfloat16, torch.float32), targets, opts) == {
        "the model's weights in fp32": 427264, "calibration activations": 32768, "one block's Hessians and solve": work}
    if sys.platform.startswith("linux"):
        # stored and loaded bf16, memory-mapped: outside the blocks (embed, head, norm: 32832 numel) and one
        # block (36992) at 2 bytes, the quantized blocks in q8_0 (2*36864/32 blocks of 34 bytes); the forward
        # at 2 bytes: 4*16*704*2 + 16384 = 106496
        assert GPTQMethod().memory(_model(torch.bfloat16, torch.bfloat16), targets, opts) == {
            "the weights outside the blocks and one block in bf16": 2 * (32832 + 36992),
            "the quantized blocks": 2304 * 34, "calibration activations": 32768,
            "one block's Hessians and solve": int(1.25 * (106496 + 114688 + 262144 + 32768))}


def test_awqs_need_is_the_hand_arithmetic():
    from qkit.methods.awq import AWQMethod, AWQOptions

    opts = AWQOptions(calibration_samples=4, calibration_seqlen=16)
    q8 = {n: get_scheme("q8_0") for n in TARGETS}
    # the forward in fp32 4*16*704*4 + 16384 = 196608; the recorded group inputs 4*16*(7*64 + 128)*4 = 147456;
    # the clip search 12 copies of the largest linear (8192) in fp32 and a 2^24-float chunk: 393216 + 268435456
    work = int(1.25 * (196608 + 147456 + 393216 + 268435456))
    need = AWQMethod().memory(_model(torch.bfloat16, torch.float32), q8, opts)
    if sys.platform.startswith("linux"):
        # a bf16 file is mapped in bf16: outside the blocks 32832 numel and one block 36992 at 2 bytes; the
        # same upcast to fp32 but the head (16384): 4 * (16448 + 36992); the quantized blocks in q8_0
        assert need == {"the weights outside the blocks and one block in bf16": 2 * (32832 + 36992),
                        "the same upcast to fp32 (the head aside)": 4 * (16448 + 36992),
                        "the quantized blocks": 2304 * 34, "calibration activations": 32768, "one block's search": work}
    # mixed stored dtypes are loaded whole in fp32
    mixed = Model({**_model(torch.bfloat16, torch.float32).shapes}, {**_model(torch.bfloat16, torch.float32).stored,
                  "model.norm.weight": torch.float32}, torch.float32, _model(torch.bfloat16, torch.float32).dims)
    assert AWQMethod().memory(mixed, q8, opts)["the model's weights in fp32"] == 427264


def test_imatrixs_need_is_the_hand_arithmetic():
    opts = ImatrixOptions(chunk_size=16, chunks=4, batch=2, dtype="bf16")
    m = _model(torch.bfloat16, torch.bfloat16)
    # batch 2 of 16 tokens: the forward 2*16*704*2 + 2*4*256*4 = 53248, the float64 squares of the widest
    # input (128) 2*8*2*16*128 = 65536
    assert collect_memory(m, opts) == {"the model's weights in bf16": 2 * 106816, "one batch's forward": int(1.25 * (53248 + 65536))}


def test_a_need_above_the_budget_is_refused_in_one_line_naming_its_parts(monkeypatch):
    need = Need("this quantize (gptq)", {"the process": BASELINE, "the weights": GIB, "nothing": 0})
    assert need.total == BASELINE + GIB
    check_need(need, 2 * GIB)
    with pytest.raises(InputError) as e:
        check_need(need, GIB, helps="pass --dtype bf16, ")
    assert str(e.value) == ("--max-memory 1.00 GiB is below the 1.75 GiB this quantize (gptq) needs (the process 0.75 GiB, "
                            "the weights 1.00 GiB); pass --dtype bf16, raise --max-memory")
    import qkit.methods.memory as mm
    monkeypatch.setattr(mm, "available_ram", lambda: GIB)
    monkeypatch.setattr(mm, "process_rss", lambda: 0)
    with pytest.raises(InputError, match=r"needs 1.75 GiB .*but only 1.00 GiB is available; free memory \(--max-memory SIZE"):
        check_need(need, None)
    monkeypatch.setattr(mm, "available_ram", lambda: None)  # cannot be told: not refused
    check_need(need, None)


@pytest.mark.parametrize("value", [0, -5, 1.5, True, "8GiB"])
def test_quantize_options_refuse_a_bad_max_memory(value):
    with pytest.raises(InputError, match="--max-memory must be a positive number of bytes"):
        request(QuantizeOptions(scheme="int4-g64", max_memory=value))


@pytest.fixture(scope="module")
def model3(tmp_path_factory):
    d = tmp_path_factory.mktemp("m3")
    make_tiny_llama(d, hidden=256, intermediate=512, layers=2)
    return d


def _tripwires(monkeypatch):
    def tripwire(*a, **k):
        raise AssertionError("the model was read")
    for target in ("qkit.api._load", "qkit.writing.iter_tensors", "qkit.api.load_tokenizer", "qkit.methods.gptq.method.load",
                   "qkit.methods.awq.load", "qkit.methods.smoothquant.load", "qkit.methods.imatrix.method.load"):
        monkeypatch.setattr(target, tripwire)


@pytest.mark.parametrize("argv, line", [
    (["quantize", "{m}", "-o", "{o}", "--scheme", "int4-g64"], "this quantize needs"),
    (["quantize", "{m}", "-o", "{o}", "--scheme", "int4-g64", "--method", "gptq"], "this quantize (gptq) needs"),
    (["quantize", "{m}", "-o", "{o}", "--scheme", "int4-g64", "--method", "awq"], "this quantize (awq) needs"),
    (["quantize", "{m}", "-o", "{o}", "--format", "gguf", "--scheme", "q4_k_m", "--method", "imatrix"],
     "this quantize (imatrix) needs"),
    (["imatrix", "{m}", "-o", "{o}", "--chunk-size", "32"], "this imatrix needs"),
])
def test_a_max_memory_below_the_need_is_refused_before_the_model_is_read(model3, tmp_path, monkeypatch, argv, line):
    _tripwires(monkeypatch)
    out = tmp_path / "out"
    r = runner.invoke(app, [a.format(m=model3, o=out) for a in argv] + ["--max-memory", "100MiB"])
    assert r.exit_code == 2, r.output
    (text,) = r.output.strip().splitlines()
    assert text.startswith("error: --max-memory 0.10 GiB is below the ") and line in text and text.endswith("raise --max-memory")
    assert "the process 0.75 GiB" in text
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_max_memory_above_the_need_runs(model3, tmp_path):
    r = runner.invoke(app, ["quantize", str(model3), "-o", str(tmp_path / "q"), "--scheme", "int4-g64", "--max-memory", "8GiB"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "q" / "model.safetensors").stat().st_size > 0


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc")
def test_the_estimate_is_above_the_measured_peak(memory_model, tmp_path):
    """GPTQ in fp32 (an fp32 file, memory-mapped) and an imatrix collection, each in a child: the measured peak
    below the estimate computed from the shapes, and the estimate within 2.5x of it (a bound, not a guess)."""
    ref = resolve(str(memory_model))
    shapes, config = dict(tensor_shapes(ref.directory)), read_config(ref.directory)
    gptq = ["--scheme", "int4-g64", "--method", "gptq", "--calibration-samples", "4", "--calibration-seqlen", "64"]
    need = memory_need(request(QuantizeOptions(scheme="int4-g64", method="gptq", method_options=GPTQOptions(
        calibration_samples=4, calibration_seqlen=64))), ref, shapes, config).total
    im = ImatrixOptions(chunk_size=64, chunks=4)
    im_need = check_collect_memory(ref.directory, config, im, 64 * GIB, torch.device("cpu")).total
    for args, estimate in ((["quantize", str(memory_model), "-o", str(tmp_path / "g"), *gptq], need),
                           (["imatrix", str(memory_model), "-o", str(tmp_path / "i.gguf"), "--chunk-size", "64", "--chunks", "4"],
                            im_need)):
        peak = peak_rss(["qkit", *args, "--max-memory", str(estimate)])
        assert peak <= estimate <= 2.5 * peak, (args[0], peak / GIB, estimate / GIB)
