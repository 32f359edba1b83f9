"""bitsandbytes NF4: the layout transformers loads with ``BitsAndBytesConfig(load_in_4bit=True)``.

Matched against what bitsandbytes 0.50.2 + transformers 5.24 themselves save for a ``Linear4bit``
(``QuantState.as_dict(packed=True)``); a test compares qkit's file with theirs byte for byte. Per
quantized linear weight ``W`` (``[out, in]``, ``n = out * in``):

* ``W``: uint8 ``[ceil(n/2), 1]``: NF4 codes of the row-major flattened weight, two per byte, the even
  element in the high nibble: the very bytes of qkit's ``qweight``;
* ``W.absmax``: float32 ``[ceil(n/64)]``, one per flattened block of 64 (qkit's scales, widened to fp32:
  exact for any qkit scale dtype);
* ``W.quant_map``: float32 ``[16]``, the NF4 levels;
* ``W.quant_state.bitsandbytes__nf4``: uint8, the UTF-8 bytes of
  ``{"quant_type": "nf4", "blocksize": 64, "dtype": "<weight dtype>", "shape": [out, in]}``.

Dequantization on the library side is ``quant_map[code] * absmax`` in fp32, cast to the weight dtype:
qkit's own ``dequantize`` computes the same fp32 product, so the two agree exactly in fp32 and up to
that one final rounding in fp16/bf16. Config: ``quant_method: "bitsandbytes"``, ``load_in_4bit``,
``bnb_4bit_quant_type: "nf4"``, no double quantization, ``llm_int8_skip_modules`` = the linears left
unquantized. Only nf4 is written; other schemes are refused with the format that takes them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping

import torch

from qkit.errors import ExportError
from qkit.export.common import ModelLayout, SafetensorsFormat, check_linear_targets, dtype_name
from qkit.granularity import PerGroup, PerRow
from qkit.schemes import AbsmaxScheme, NF4Scheme, QuantizedTensor, Scheme
from qkit.schemes.ggml import GGMLScheme
from qkit.schemes.nf4 import NF4_LEVELS

NAME = "bitsandbytes"
QUANT_STATE = "quant_state.bitsandbytes__nf4"
STORED = ("weight", "weight.absmax", "weight.quant_map", f"weight.{QUANT_STATE}")
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' quantize_4bit block sizes on every backend


def quant_state_bytes(blocksize: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The packed quant state exactly as bitsandbytes writes it (``json.dumps`` in its key order)."""
    text = json.dumps({"quant_type": "nf4", "blocksize": blocksize, "dtype": dtype_name(dtype), "shape": list(shape)},
                      allow_nan=False)  # strict JSON (no floats here); key order as bitsandbytes writes it, not sorted
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


class BitsAndBytesFormat(SafetensorsFormat):
    """The ``Format`` of ``--format bitsandbytes`` (``bnb``); see the module docstring."""

    name = NAME
    library = "bitsandbytes"
    help = "nf4: transformers"
    compares_before_forward = True  # a forward on CPU may repack the weight (library_setup)

    def reader(self, quantization_config: dict) -> SafetensorsFormat | None:
        qc = quantization_config
        ours = qc.get("quant_method") == NAME and qc.get("load_in_4bit") and qc.get("bnb_4bit_quant_type") == "nf4"
        return self if ours else None

    def stored_parts(self, keys: list[str]) -> dict[str, str]:
        """Stored key -> module: the four ``STORED`` tensors of every module that has a quant state."""
        modules = {k.removesuffix(f".weight.{QUANT_STATE}") for k in keys if k.endswith(f".weight.{QUANT_STATE}")}
        out = {}
        for k in keys:
            for part in STORED:
                module = k.removesuffix("." + part)
                if module != k and module in modules:
                    out[k] = module
        return out

    def parts_per_module(self, parts_of: dict[str, str]) -> Mapping[str, int]:
        return defaultdict(lambda: len(STORED))  # every module stores all four; fewer is refused as incomplete

    def stored_dtype(self, tensors: dict[str, torch.Tensor]) -> torch.dtype:
        return getattr(torch, self.quant_state(tensors)["dtype"])

    def library_setup(self, model: torch.nn.Module, fast_cpu_kernel: bool) -> torch.dtype | None:
        """Unless ``fast_cpu_kernel``, read through bitsandbytes' generic CPU path (``dequantize_4bit`` +
        matmul, the same on every machine): on a CPU with AVX512-BF16 ``Linear4bit.forward`` repacks the
        weight into a bf16 kernel layout. With it, the logits are held to the bf16 tolerance."""
        if fast_cpu_kernel:
            return torch.bfloat16
        for m in model.modules():
            if hasattr(m, "support_avx512bf16_for_cpu"):  # bitsandbytes' Linear4bit (0.50.2) attribute
                m.support_avx512bf16_for_cpu = False
        return None

    def library_weight(self, model: torch.nn.Module, module: str) -> torch.Tensor:
        import bitsandbytes.functional as bnbf  # an optional dependency (qkit[test]), needed only to verify

        m = model.get_submodule(module)
        return bnbf.dequantize_4bit(m.weight.data, m.weight.quant_state)

    def refusal(self, scheme: Scheme, tensor: str | None = None) -> str | None:
        """None for NF4 with a block size bitsandbytes takes; else the one-line reason and what would work."""
        s = scheme
        if isinstance(s, NF4Scheme):
            if s.block_size in BLOCK_SIZES:
                return None
            return (f"bitsandbytes takes NF4 block sizes {', '.join(map(str, BLOCK_SIZES))}, not "
                    f"{s.block_size}; quantize with nf4 (block 64)")
        granularity = s.granularity if isinstance(s, AbsmaxScheme) else None  # block formats have none
        if isinstance(s, GGMLScheme):
            fix = f"use nf4 here, or --format gguf for {s.name}"
        elif granularity is None or isinstance(granularity, (PerGroup, PerRow)):
            fix = f"use nf4 here, or --format compressed-tensors for {s.name}"
        else:
            fix = f"use nf4 here, or --format compressed-tensors with int{s.bits}-row"
        return f"--format bitsandbytes writes nf4 only, not {s.name}; {fix}"

    def check(self, layout: ModelLayout) -> None:
        check_linear_targets(layout, NAME)
        for tensor, s in sorted(layout.targets.items()):
            why = self.refusal(s, tensor)
            if why is not None:
                raise ExportError(why)
        # The format itself lets a block cross a row, and bitsandbytes' own quantizer makes such blocks, but
        # its CPU dequantize kernel (0.50.2) restarts the blocks at each row and silently misreads them
        # (measured: 0.029 max error on a 160-wide matrix). Refuse rather than write a file that loads wrong.
        bad = sorted(t for t, s in layout.targets.items() if layout.shapes[t][-1] % s.block_size)
        if bad:
            t, s = bad[0], layout.targets[bad[0]]
            w = layout.shapes[t][-1]
            glob = "*." + t.rsplit(".", 2)[-2] + ".weight"
            raise ExportError(
                f"bitsandbytes' CPU kernels read NF4 blocks of {s.block_size} within a row, so every quantized "
                f"matrix's input width must be a multiple of {s.block_size}: {t} is {w} wide; leave such "
                f"matrices unquantized with --keep none:'{glob}', or use --format compressed-tensors"
            )

    def encode(self, name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {
            name: qt.qweight.reshape(-1, 1),
            f"{name}.absmax": qt.scales.to(torch.float32),
            f"{name}.quant_map": torch.tensor(NF4_LEVELS, dtype=torch.float32),
            f"{name}.{QUANT_STATE}": quant_state_bytes(qt.scheme.block_size, qt.dtype, qt.shape),
        }

    def decode(self, tensors: dict[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype, *,
               shape: tuple[int, ...] | None = None) -> QuantizedTensor:
        """``tensors``: ``weight``, ``weight.absmax``, ``weight.quant_map``, ``weight.quant_state...`` of one module."""
        state = self.quant_state(tensors)
        if not isinstance(scheme, NF4Scheme) or scheme.block_size != state["blocksize"]:
            raise ExportError(f"a bitsandbytes module with block size {state['blocksize']} is not {scheme.name}; "
                              "re-export the checkpoint")
        if not torch.equal(tensors["weight.quant_map"].float(), torch.tensor(NF4_LEVELS, dtype=torch.float32)):
            raise ExportError("this checkpoint's quant_map is not the NF4 codebook qkit uses; verify an NF4 export")
        absmax = tensors["weight.absmax"]
        scales = absmax.to(scheme.scale_dtype)
        if not torch.equal(scales.float(), absmax.float()):
            raise ExportError(f"absmax does not fit {scheme.scale_dtype} exactly; the checkpoint was changed after export")
        shape = tuple(int(d) for d in state["shape"])
        return QuantizedTensor(scheme, tensors["weight"].reshape(-1), scales, shape, dtype)

    def infer_scheme(self, quantization_config: dict, module: str, tensors: dict[str, torch.Tensor]) -> Scheme:
        """The qkit scheme of a module of a bitsandbytes checkpoint that qkit did not write."""
        state = self.quant_state(tensors)
        if state.get("quant_type") != "nf4" or state["blocksize"] not in BLOCK_SIZES:
            raise ExportError(f"qkit reads bitsandbytes nf4 modules, not {state}; verify an nf4 checkpoint")
        return NF4Scheme(block_size=int(state["blocksize"]), scale_dtype=torch.float32)

    @staticmethod
    def quant_state(tensors: dict[str, torch.Tensor]) -> dict:
        if "weight.nested_absmax" in tensors:
            raise ExportError("qkit reads bitsandbytes checkpoints without double quantization; "
                              "verify one saved with bnb_4bit_use_double_quant=False")
        raw = tensors.get(f"weight.{QUANT_STATE}")
        if raw is None:
            raise ExportError("a bitsandbytes module lacks its quant_state.bitsandbytes__nf4; re-export the checkpoint")
        return json.loads(bytes(raw.to(torch.uint8).tolist()).decode("utf-8"))

    def quantization_config(self, layout: ModelLayout) -> dict:
        return {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": False,
            "bnb_4bit_compute_dtype": dtype_name(layout.model_dtype),
            "bnb_4bit_quant_storage": "uint8",
            "llm_int8_skip_modules": layout.kept_linears,
            "llm_int8_enable_fp32_cpu_offload": False,
            "llm_int8_has_fp16_weight": False,
            "llm_int8_threshold": 6.0,
        }


FORMAT = BitsAndBytesFormat()
