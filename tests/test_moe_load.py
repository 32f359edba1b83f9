"""``qkit.load`` of a mixture-of-experts qkit checkpoint (issue 51).

transformers 5 holds a layer's experts fused in two 3-D parameters; a qkit checkpoint stores one 2-D matrix
per expert, under the source's names (mixtral: ``block_sparse_moe.experts.E.w1``). ``load`` hands the
dequantized tensors to transformers' own loading, which converts stored names as ``from_pretrained`` does
for the source. The oracles: every tensor ``iter_quantized`` reads back from the file, dequantized, against
the loaded model's tensor of that name (an expert matrix through ``expert_matrices``, qkit's own slicing of
the fused parameters, and one by hand-written index), bit for bit. The models: ``helpers_archs``' tiny
qwen3_moe and mixtral (2 layers, 4 experts) with the tests' 300-token tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_tokenizer
from helpers_archs import INTER, make_arch_model

import qkit
from qkit.api import quantize_model
from qkit.checkpoint import iter_quantized
from qkit.methods.experts import expert_matrices
from qkit.schemes import QuantizedTensor


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    make_tokenizer(root)
    (root / "config.json").write_text('{"vocab_size": 304}')  # the vocabulary make_arch_model gives the model
    return root


@pytest.mark.parametrize(("arch", "stored"), [("qwen3_moe", "mlp.experts.2.up_proj"),
                                              ("mixtral", "block_sparse_moe.experts.2.w3")])
def test_load_puts_every_decoded_expert_matrix_where_the_model_reads_it(tokenizer, tmp_path, arch, stored):
    source = make_arch_model(tmp_path / arch, arch, tokenizer)
    out = tmp_path / "q"
    quantize_model(model=source, output=out, scheme="int4-g128")
    model = qkit.load(out).model
    held = {**dict(model.named_parameters(remove_duplicate=False)), **expert_matrices(model, model.config.to_dict())}
    written = dict(iter_quantized(out))
    quantized = {n for n, v in written.items() if isinstance(v, QuantizedTensor)}
    assert len(quantized) == 32  # 2 layers x (4 attention + 4 experts x 3) matrices
    for name, value in written.items():
        want = value.dequantize(torch.float32) if isinstance(value, QuantizedTensor) else value
        got = held.get(name, held.get(name.replace(".block_sparse_moe.", ".mlp.")))  # mixtral's router is mlp.gate
        assert got is not None and torch.equal(got, want), name
    # by hand: expert 2's up matrix is the second half of its rows in layer 1's fused gate_up_proj
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(fused[2, INTER // 2 if arch == "qwen3_moe" else INTER:],
                       written[f"model.layers.1.{stored}.weight"].dequantize(torch.float32))
