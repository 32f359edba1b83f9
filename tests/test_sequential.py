"""The layer-by-layer walker: block inputs equal the model's own hidden states; changes propagate."""

from __future__ import annotations

import os

import pytest
import torch

from qkit.errors import InputError
from qkit.methods.sequential import BlockInputs, capture_block_inputs, find_blocks, release_parameters, walk_blocks


@pytest.fixture()
def tiny(tiny_model_dir):
    from qkit.models import load

    return load(tiny_model_dir, device="cpu").model


def ids(n: int = 5, length: int = 16) -> torch.Tensor:
    return torch.randint(3, 300, (n, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("batch_size", [2, 5])
def test_each_block_sees_the_model_hidden_states(tiny, batch_size):
    x = ids()
    with torch.no_grad():
        expected = tiny(input_ids=x, output_hidden_states=True).hidden_states
    seen = []

    def process(i: int, block, inputs: BlockInputs):
        assert inputs.prefix == f"model.layers.{i}."
        seen.append(i)
        torch.testing.assert_close(torch.cat(inputs.hidden), expected[i], rtol=0, atol=1e-5)
        assert set(inputs.linears()) >= {"self_attn.q_proj", "mlp.down_proj"}

    progress = []
    assert walk_blocks(tiny, x, process, batch_size=batch_size, on_block=lambda d, t: progress.append((d, t))) == 2
    assert seen == [0, 1] and progress == [(1, 2), (2, 2)]


def test_changes_a_block_makes_reach_the_next_block(tiny):
    x = ids()
    got = {}

    def process(i, block, inputs):
        got[i] = torch.cat(inputs.hidden)
        if i == 0:
            block.mlp.down_proj.weight.data.zero_()  # block 0 now adds no MLP output

    walk_blocks(tiny, x, process, batch_size=2)
    layer0 = tiny.model.layers[0]
    with torch.no_grad():  # block 0 with its zeroed down_proj, run by hand on the captured inputs
        emb = tiny.model.embed_tokens(x)
        pos = torch.arange(x.shape[1])[None]
        out = layer0(emb, position_embeddings=tiny.model.rotary_emb(emb, pos), position_ids=pos)
    torch.testing.assert_close(got[1], out[0] if isinstance(out, tuple) else out, rtol=0, atol=1e-5)


def test_returned_outputs_replace_the_rerun(tiny):
    x = ids()
    got = {}

    def process(i, block, inputs):
        got[i] = torch.cat(inputs.hidden)
        if i == 0:
            return [torch.full_like(h, 0.5) for h in inputs.hidden]
        return None

    walk_blocks(tiny, x, process, batch_size=3)
    assert torch.all(got[1] == 0.5)


def test_record_and_forward_hooks(tiny):
    x = ids()

    def process(i, block, inputs):
        lin = inputs.linears()
        rec = inputs.record({"mlp.down_proj": lin["mlp.down_proj"]})
        assert rec["mlp.down_proj"].shape == (5, 16, tiny.config.intermediate_size)
        outs = []
        ys = inputs.forward(on_output=lambda n, y: outs.append(y.shape), modules={"mlp": block.mlp})
        assert len(ys) == len(inputs.hidden) and outs == [h.shape for h in inputs.hidden]
        y = inputs.run_module(block.mlp.down_proj, [rec["mlp.down_proj"]])
        assert y[0].shape == (5, 16, tiny.config.hidden_size)

    walk_blocks(tiny, x, process, batch_size=2)


def _resident_bytes_of(name_part: str) -> int:
    """Resident bytes of this process's mappings whose path contains ``name_part`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms offset dev inode path"
                inside = name_part in line
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_release_hands_back_the_pages_of_a_bf16_file_mapping(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=512)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    kept = {n: p.detach().clone() for n, p in model.model.layers[1].named_parameters()}
    for p in model.parameters():  # touch every page
        p.float().sum()
    block = model.model.layers[0]
    block_bytes = sum(p.numel() * 2 for p in block.parameters())  # 4*256^2 + 3*256*1024 weights + norms
    before = _resident_bytes_of("model.safetensors")
    assert before >= 2 * block_bytes  # views of the file's mapping (what release must reach)
    released = release_parameters(block)
    assert 0.95 * block_bytes <= released <= block_bytes
    assert before - _resident_bytes_of("model.safetensors") >= 0.95 * block_bytes
    assert all(p.numel() == 0 and p.dtype == torch.bfloat16 for p in block.parameters())
    for n, p in model.model.layers[1].named_parameters():  # the other block's bytes are untouched
        assert torch.equal(p, kept[n])


def test_release_of_memory_not_from_a_file_only_drops_it():
    lin = torch.nn.Linear(512, 512)
    assert release_parameters(lin) == 0
    assert lin.weight.numel() == 0 and lin.bias.numel() == 0


def test_refuses_models_without_blocks_and_bad_ids():
    with pytest.raises(InputError, match="transformer blocks"):
        find_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(InputError, match="samples, seqlen"):
        walk_blocks(torch.nn.Linear(2, 2), torch.zeros(3, dtype=torch.long), lambda *a: None)


@pytest.mark.cuda
def test_gptq_on_cuda_matches_cpu(tiny_model_dir, tmp_path):
    from conftest import TINY_TEXT

    from qkit.api import QuantizeOptions, quantize_model

    cal = tmp_path / "cal.txt"
    cal.write_text(TINY_TEXT * 30)
    opts = {"calibration": str(cal), "calibration_samples": 4, "calibration_seqlen": 64}
    cpu = quantize_model(tiny_model_dir, output=tmp_path / "cpu", scheme="int8-row", method="gptq",
                         method_options=opts, collect=True, options=QuantizeOptions(device="cpu"))
    gpu = quantize_model(tiny_model_dir, output=tmp_path / "gpu", scheme="int8-row", method="gptq",
                         method_options=opts, collect=True, options=QuantizeOptions(device="cuda"))
    for name, qt in cpu.quantized.items():
        assert gpu.quantized[name].qweight.device.type == "cpu"
        diff = (gpu.quantized[name].dequantize(torch.float32) - qt.dequantize(torch.float32)).abs()
        step = qt.scales.float().max()
        assert float(diff.max()) <= float(step) + 1e-6  # at most one step apart (fp32 reductions differ)


def test_each_block_gets_the_arguments_of_its_own_attention_type():
    """A model with layers of two attention types (Qwen2: the first full, the others a sliding window of 8,
    shorter than the 16-token windows): every block's walked inputs equal the model's own hidden states bit
    for bit, which needs the sliding layers' own mask (one mask captured at block 0 for every block gave
    block 2 inputs off by 1e-2). Tensors shared between blocks' arguments are moved once and stay shared."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=8,
                      max_window_layers=1)
    m = Qwen2ForCausalLM(cfg).eval()
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
    real: dict[int, list[torch.Tensor]] = {}
    hooks = [b.register_forward_pre_hook(lambda _m, a, kw, i=i: real.setdefault(i, []).append(kw.get("hidden_states", a[0] if a else None)),
                                         with_kwargs=True) for i, b in enumerate(m.model.layers)]
    with torch.no_grad():
        m(ids, use_cache=False)
    for h in hooks:
        h.remove()
    walked = {}
    walk_blocks(m, ids, lambda i, _b, inputs: walked.__setitem__(i, torch.cat(inputs.hidden)), batch_size=2)
    assert all(torch.equal(walked[i], torch.cat(real[i])) for i in range(3))
    hidden, kwargs = capture_block_inputs(m, ids, torch.device("cpu"), batch_size=3)
    assert len(hidden) == 1 and [len(k) for k in kwargs] == [1, 1, 1]
    masks = [k[0]["attention_mask"] for k in kwargs]
    assert masks[1] is not None and masks[1] is masks[2] and masks[0] is not masks[1]  # the sliding layers share theirs
    assert kwargs[0][0]["position_embeddings"][0] is kwargs[2][0]["position_embeddings"][0]
    assert list(m.model.layers) and all(type(b).__name__ == "Qwen2DecoderLayer" for b in m.model.layers)
