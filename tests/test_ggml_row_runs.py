"""``GGMLScheme.encode`` codes a large tensor a run of rows at a time (``ENCODE_ELEMENTS``), so that its
float32 copy is one run's: every llama.cpp type codes each row by itself, so the bytes must not depend on
the run length. Checked for every registered llama.cpp block type, with and without an importance vector,
against the whole tensor encoded in one run (runs of one row, and of five rows over 37)."""

from __future__ import annotations

import pytest
import torch

import qkit.schemes.ggml as ggml
from qkit.errors import SchemeError
from qkit.schemes import quantize_tensor
from qkit.schemes.ggml import GGMLScheme
from qkit.schemes.registry import get_scheme, scheme_names

TYPES = sorted(n for n in scheme_names() if isinstance(get_scheme(n), GGMLScheme))


@pytest.mark.parametrize("name", TYPES)
def test_the_bytes_do_not_depend_on_the_run_of_rows_encoded_at_once(name, monkeypatch):
    scheme = get_scheme(name)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(37, 512, generator=gen) * 0.05).to(torch.bfloat16)  # 37 rows: the last run is short
    qw = torch.rand(512, generator=gen) + 0.1
    for weights in (None, qw):
        try:
            whole = quantize_tensor(w, scheme, quant_weights=weights).qweight
        except SchemeError as e:  # iq2_xxs, iq2_xs, iq1_s: llama.cpp asserts an importance matrix
            assert weights is None and "needs an importance matrix" in str(e)
            continue
        for elements in (5 * 512, 1):
            monkeypatch.setattr(ggml, "ENCODE_ELEMENTS", elements)
            assert torch.equal(quantize_tensor(w, scheme, quant_weights=weights).qweight, whole), (name, elements)
            monkeypatch.undo()
