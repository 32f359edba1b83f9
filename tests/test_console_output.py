"""Readable output in pipes and files: titles on one line, no padding, no progress bars of other libraries."""

from __future__ import annotations

import pytest

from qkit import console


@pytest.fixture
def piped(monkeypatch):
    """The stdout console as a pipe or file sees it (whatever the terminal running the tests)."""
    monkeypatch.setattr(console, "_out", console._console(stderr=False))
    assert not console._out.is_terminal


def test_title_longer_than_the_table_is_one_line(piped, capsys):
    title = "qkit quantize: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)"
    console.table(["", ""], [["output", "out/x"], ["seconds", "0.5"]], title=title, show_header=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == title  # whole, not wrapped at the table's 20 columns, not padded
    assert lines[1].startswith("┌") and len(lines[1]) < len(title)


def test_wide_table_is_not_squeezed_and_caption_wraps_at_120(piped, capsys):
    headers = [f"column {i}" for i in range(30)]  # natural width ~ 360 columns
    caption = "word " * 60
    console.table(headers, [[f"value {i}" for i in range(30)]], caption=caption.strip())
    lines = capsys.readouterr().out.splitlines()
    table = [l for l in lines if l.startswith(("┏", "┃", "┡", "│", "└"))]
    assert len(table) == 5 and len({len(l) for l in table}) == 1 and len(table[0]) > 300  # one row, no wrapping
    captions = lines[lines.index(table[-1]) + 1:]
    assert len(captions) == 1 and captions[0] == caption.strip()  # within the table's width: one line
    console.table(["a", "b"], [["1", "2"]], caption=caption.strip())
    lines = capsys.readouterr().out.splitlines()
    caption_lines = lines[5:]
    assert len(caption_lines) == 3 and max(len(l) for l in caption_lines) <= 120  # a narrow table: 120 columns
    assert all(l == l.rstrip() for l in lines)  # no padding


def test_status_comes_after_what_stdout_printed(piped, capfd):
    console.note("first, on stdout")
    console.status("then, on stderr")
    out, err = capfd.readouterr()
    assert out == "first, on stdout\n" and err == "then, on stderr\n"


def test_library_status_lines(capfd):
    import logging

    console.show_library_status()
    console.show_library_status()  # idempotent: one handler
    logging.getLogger("qkit").info("converting %s", "x.gguf")
    logging.getLogger("qkit").debug("not shown")
    assert capfd.readouterr().err == "converting x.gguf\n"


def test_gguf_conversion_bar_is_replaced(capfd):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from qkit.models.gguf import _no_gguf_bar

    original = gguf_utils.tqdm
    items = list(range(5))
    with _no_gguf_bar():
        assert list(gguf_utils.tqdm(items, desc="Converting and de-quantizing GGUF tensors...")) == items
    assert gguf_utils.tqdm is original
    assert "Converting" not in capfd.readouterr().err
    list(gguf_utils.tqdm(items, desc="Converting and de-quantizing GGUF tensors..."))  # the bar the context hides
    assert "Converting" in capfd.readouterr().err


def test_loading_a_model_draws_no_loading_weights_bar(tiny_model_dir, capfd):
    from transformers.utils import logging as hf_logging

    from qkit.models import load

    hf_logging.enable_progress_bar()  # as a fresh process has it
    capfd.readouterr()
    load(str(tiny_model_dir), device="cpu")
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err
