"""What the mixture-of-experts tests share: tiny routed models (``moe_model``; ``moe2``, a saved 2-expert
qwen3_moe), a calibration text disjoint from the eval text (``cal``), and the CLI run and one-line refusal checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_TEXT, make_tokenizer
from typer.testing import CliRunner

from qkit.cli import app

runner = CliRunner()
SAMPLES, SEQLEN = 4, 64  # 256 calibration tokens


def moe_config(arch: str, experts: int = 2, top_k: int = 1):
    """A tiny ``arch`` model's config: hidden 64, each expert 64 wide, 2 layers, ``experts`` experts, ``top_k`` per token."""
    from transformers import AutoConfig

    extra = {"qwen3_moe": {"head_dim": 16, "num_experts": experts, "moe_intermediate_size": 64, "norm_topk_prob": True,
                           "decoder_sparse_step": 1, "mlp_only_layers": []},
             "qwen2_moe": {"num_experts": experts, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
                           "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
             "mixtral": {"num_local_experts": experts},
             "gpt_oss": {"num_local_experts": experts, "head_dim": 16}}[arch]
    return AutoConfig.for_model(arch, vocab_size=304, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                num_experts_per_tok=top_k, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                pad_token_id=0, **extra)


def moe_model(arch: str, experts: int = 2, top_k: int = 1, seed: int = 0):
    """The tiny model, its routers drawn wide (transformers starts them at zero: every token a tie); gpt_oss's
    router bias and expert biases drawn too, and its gate_up_proj x30, so that its SwiGLU's clamp at 7 is reached
    (7% of the gate values, 15% of the up values: a plain SiLU-gate changes the logits by 0.5)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(arch, experts, top_k)).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight", "mlp.router.bias",
                           "experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.normal_(0, 0.5)
            if n.endswith("experts.gate_up_proj") and arch == "gpt_oss":
                p.mul_(30)
    return model


@pytest.fixture(scope="module")
def moe2(tmp_path_factory) -> Path:
    """A saved 2-expert qwen3_moe (one expert per token) with the tiny tokenizer."""
    d = tmp_path_factory.mktemp("moe2") / "m"
    moe_model("qwen3_moe").save_pretrained(str(d))
    make_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def cal(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("cal") / "cal.txt"
    f.write_text(TINY_TEXT * 20)  # disjoint from the eval text (KJV Ruth)
    return f


def cli(*args) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def refused(args, *words) -> None:
    code, text = cli(*args)
    assert code == 2 and len(text.strip().splitlines()) == 1 and "Traceback" not in text, text
    for w in words:
        assert w in text, (w, text)
