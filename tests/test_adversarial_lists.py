"""List options, hostile ``--tensor-type`` specs, and the lossless-grid note (issue 33 b, c, f).

Every list option of every command (comma-separated ``metavar="LIST"`` options, repeatable options and
list arguments) refuses an empty value (``""``, ``","``, ``" , "``: usually an empty shell variable) and,
for the comma lists, an empty entry (``"a,,b"``) in one line naming the option, before any model is
touched (MODEL is a path that does not exist: had it been resolved first, the error would name it). The
table of cases is checked against the typer app itself, so a new list option without a case fails here.
"""

from __future__ import annotations

import re

import json
from pathlib import Path

import pytest
import typer
from adversarial import Unchanged, assert_refused, invoke
from conftest import make_tiny_llama

from qkit.cli import app
from qkit.errors import InputError

MISSING = "/nonexistent-qkit-model"


def _argv(tmp: Path) -> dict[tuple[str, str], tuple[str, list[str], str]]:
    """``(command, option) -> (the option's flag, the argv with V where the value goes, a valid a,,b)``."""
    out, plan, html = str(tmp / "out"), str(tmp / "plan.json"), str(tmp / "r.html")
    return {
        ("eval", "--schemes"): ("--schemes", ["eval", MISSING, "--schemes", "V"], "nf4,,int8-row"),
        ("eval", "--methods"): ("--methods", ["eval", MISSING, "--methods", "V"], "rtn,,gptq"),
        ("eval", "--candidates"): ("--candidates", ["eval", MISSING, "--schemes", "plan:gguf@4.5", "--candidates", "V"],
                                   "q4_k,,q8_0"),
        ("eval", "--runtime"): ("--runtime", ["eval", MISSING, "--runtime", "V"], "torch,,vllm"),
        ("quantize", "--candidates"): ("--candidates", ["quantize", MISSING, "-o", out, "--format", "gguf",
                                                        "--target-bits", "4", "--candidates", "V"], "q4_k,,q8_0"),
        ("plan", "--candidates"): ("--candidates", ["plan", MISSING, "-o", plan, "--format", "gguf", "--target-bits", "4",
                                                    "--candidates", "V"], "q4_k,,q8_0"),
        ("budget", "--preset"): ("--preset", ["budget", "--preset", "V"], "7b,,13b"),
        ("budget", "--gpu"): ("--gpu", ["budget", "--gpu", "V"], "8,,16"),
        ("budget", "--formats"): ("--formats", ["budget", "--formats", "V"], "fp16,,int8"),
        ("speculate", "--gamma"): ("--gamma", ["speculate", "--alpha", "0.5", "--gamma", "V"], "1,,2"),
        ("report", "--run"): ("--run", ["report", "-o", html, "--run", "V"], "kv,,budget"),
        ("inspect errors", "--scheme"): ("--scheme", ["inspect", "errors", MISSING, "-s", "V"], "nf4,,int8-row"),
        ("inspect matrix", "--scheme"): ("--scheme", ["inspect", "matrix", MISSING, "-s", "nf4", "-s", "V"], "nf4,,int8-row"),
        ("inspect next-token", "--temperature"): ("--temperature", ["inspect", "next-token", MISSING, "hi", "--temperature", "V"],
                                                  "1,,2"),
        ("quantize", "--calibration"): ("--calibration", ["quantize", MISSING, "-o", out, "--method", "gptq",
                                                          "--calibration", "V"], "a.txt,,b.txt"),
        ("eval", "--calibration"): ("--calibration", ["eval", MISSING, "--methods", "gptq", "--calibration", "V"],
                                    "a.txt,,b.txt"),
        ("imatrix", "--calibration"): ("--calibration", ["imatrix", MISSING, "-o", str(tmp / "m.gguf"), "--calibration", "V"],
                                       "a.txt,,b.txt"),
        ("plan", "--calibration"): ("--calibration", ["plan", MISSING, "-o", plan, "--target-bits", "4", "--calibration", "V"],
                                    "a.txt,,b.txt"),
        ("inspect errors", "--calibration"): ("--calibration", ["inspect", "errors", MISSING, "--method", "gptq",
                                                                "--calibration", "V"], "a.txt,,b.txt"),
    }


def _repeated(tmp: Path) -> dict[tuple[str, str], tuple[str, list[str]]]:
    """Repeatable options and list arguments: one value per word, so only an empty value is refused."""
    out, plan, html = str(tmp / "out"), str(tmp / "plan.json"), str(tmp / "r.html")
    return {
        ("quantize", "--include"): ("--include", ["quantize", MISSING, "-o", out, "--include", "V"]),
        ("quantize", "--exclude"): ("--exclude", ["quantize", MISSING, "-o", out, "--exclude", "V"]),
        ("quantize", "--keep"): ("--keep", ["quantize", MISSING, "-o", out, "--keep", "int8:*.down_proj.weight", "--keep", "V"]),
        ("quantize", "--tensor-type"): ("--tensor-type", ["quantize", MISSING, "-o", out, "--tensor-type", "V"]),
        ("plan", "--include"): ("--include", ["plan", MISSING, "-o", plan, "--target-bits", "4", "--include", "V"]),
        ("plan", "--exclude"): ("--exclude", ["plan", MISSING, "-o", plan, "--target-bits", "4", "--exclude", "V"]),
        ("budget", "--config"): ("--config", ["budget", "--config", "V"]),
        ("budget", "models"): ("MODEL", ["budget", "default", "V"]),
        ("report", "files"): ("JSON", ["report", "V", "-o", html]),
    }


# Lists typer itself types (a float per value: typer refuses '' as a usage error before qkit runs) and
# positional words that are not lists of one kind ([MODEL] NAME, [MODEL] TEXT).
EXEMPT = {("speculate", "--alpha"), ("inspect matrix", "args"), ("inspect next-token", "args")}


def _list_params() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """From the app: ``(comma lists: options with metavar LIST, repeatable options and list arguments)``."""
    comma, repeated = set(), set()

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])
            return
        where = " ".join(path)
        for p in cmd.params:
            if p.param_type_name == "option" and p.metavar == "LIST":
                comma.add((where, next(o for o in p.opts if o.startswith("--"))))
            elif p.param_type_name == "option" and p.multiple:
                repeated.add((where, p.opts[0]))
            elif p.param_type_name == "argument" and p.nargs == -1:
                repeated.add((where, p.name))
            if p.param_type_name == "option" and re.search(r"\bcomma\b", (p.help or "").lower()):  # not "command"
                assert p.metavar == "LIST", f"{where} {p.opts[0]}: a comma-separated option takes metavar='LIST'"

    walk(typer.main.get_command(app), [])
    return comma, repeated


def test_every_list_option_of_every_command_has_a_case(tmp_path):
    comma, repeated = _list_params()
    assert comma - EXEMPT == set(_argv(tmp_path)), "a list option without a case here (or a case for none)"
    assert repeated - EXEMPT == set(_repeated(tmp_path)), "a repeatable option without a case here"


def _run(tmp_path: Path, argv: list[str], value: str):
    with Unchanged(dirs=[tmp_path]):
        return invoke(*[value if a == "V" else a for a in argv])


@pytest.mark.parametrize("key", sorted(_argv(Path("/t"))), ids=" ".join)
@pytest.mark.parametrize("value", ["", ",", " , ", "a,,b", "q,"])
def test_an_empty_list_or_entry_is_refused_naming_the_option(tmp_path, key, value):
    flag, argv, pair = _argv(tmp_path)[key]
    value = {"a,,b": pair, "q,": pair.split(",")[0] + ","}.get(value, value)
    line = assert_refused(_run(tmp_path, argv, value), flag)
    assert ("has an empty entry" if value.strip(" ,") else "is empty") in line, line
    assert "no such file" not in line  # refused before MODEL was resolved


@pytest.mark.parametrize("key", sorted(_repeated(Path("/t"))), ids=" ".join)
@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_value_of_a_repeatable_option_is_refused(tmp_path, key, value):
    flag, argv = _repeated(tmp_path)[key]
    line = assert_refused(_run(tmp_path, argv, value), flag, "is empty")
    assert "no such file" not in line


def test_library_entry_points_refuse_empty_lists_where_the_string_is_parsed():
    from qkit.evaluation import EvalOptions
    from qkit.evaluation.specs import resolve_rows
    from qkit.inspect.nexttoken import parse_temperatures
    from qkit.lists import numbers, shown, split_list
    from qkit.serving.budget import parse_floats

    assert resolve_rows([]) == []  # the library's empty tuple is the reference row alone (the CLI refuses '')
    EvalOptions(schemes=()).resolve()
    for call, needle in [
        (lambda: EvalOptions(schemes=("nf4", " ")).resolve(), "--schemes is empty"),
        (lambda: resolve_rows(["nf4"], []), "--methods is empty"),
        (lambda: EvalOptions(plan_candidates=("q4_0,,q8_0",)).resolve(), "empty entry"),
        (lambda: parse_temperatures("1,,2"), "empty entry"),
        (lambda: parse_floats(" , ", "--gpu"), "--gpu is empty"),
        (lambda: numbers("1,x", "--gamma", int), "comma-separated integers"),
        (lambda: split_list("a,", "--x"), "empty entry"),
    ]:
        with pytest.raises(InputError) as exc:
            call()
        assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    assert split_list(" a , b ", "--x") == ["a", "b"]
    assert split_list("q4_k q6_k,q8_0", "--x", spaces=True) == ["q4_k", "q6_k", "q8_0"]
    assert parse_floats("8, 16", "--gpu") == [8.0, 16.0]
    long = shown("x" * 100_000)
    assert len(long) < 100 and "100,000 characters" in long
    assert shown("a\x00b") == "'a\\x00b'"


def test_kjv_books_refuse_an_empty_entry():
    from qkit.texts import kjv_corpus

    with pytest.raises(InputError, match="empty entry"):
        kjv_corpus("Luke,,Acts")


# --------------------------------------------------------------------------- --tensor-type


_GGUF = ["--format", "gguf", "-s", "q4_0"]


@pytest.mark.parametrize("words, extra, needles", [
    ([""], _GGUF, ["--tensor-type is empty"]),
    (["  "], _GGUF, ["--tensor-type is empty"]),
    (["="], _GGUF, ["'='", "no PATTERN", "no TYPE"]),
    (["attn_v="], _GGUF, ["'attn_v='", "no TYPE after"]),
    (["=q4_0"], _GGUF, ["'=q4_0'", "no PATTERN before"]),
    (["attn_v"], _GGUF, ["'attn_v'", "no '='"]),
    (["attn_v=q9_k"], _GGUF, ["'q9_k' is not a ggml block type"]),
    (["attn_v=f16"], _GGUF, ["--keep none"]),
    (["attn_v=q4_k_m"], _GGUF, ["'q4_k_m' is not a ggml block type"]),
    (["(=q8_0"], _GGUF, ["'(' is not a regular expression"]),
    (["attn_v=q8_0", "ATTN_V=q4_1"], _GGUF, ["'ATTN_V=q4_1'", "already given as 'attn_v=q8_0' with another type"]),
    (["attn_v=q8_0", "attn_v=q8_0"], _GGUF, ["already given as 'attn_v=q8_0'; the first match"]),
    (["attn_v\x01=q8_0"], _GGUF, ["'attn_v\\x01=q8_0'", "control character"]),
    (["attn_v\n=q8_0"], _GGUF, ["control character"]),
    (["a" * 5000 + "=q8_0"], _GGUF, ["5,005 characters long"]),
    (["attn_v=q8_0"], ["--format", "compressed-tensors", "-s", "int4-g32"],
     ["'attn_v=q8_0'", "--format compressed-tensors cannot store q8_0"]),
    (["attn_v=q8_0"], ["--format", "bnb", "-s", "nf4"], ["--format bitsandbytes cannot store q8_0"]),
], ids=lambda v: repr(v)[:40])
def test_hostile_tensor_type_specs_are_refused_before_the_model_is_read(tmp_path, words, extra, needles):
    args = [a for w in words for a in ("--tensor-type", w)]
    with Unchanged(dirs=[tmp_path]):
        r = invoke("quantize", MISSING, "-o", str(tmp_path / "o.gguf"), *extra, *args)
    line = assert_refused(r, *needles)
    assert "no such file" not in line and len(line) < 400


@pytest.mark.parametrize("args, needles", [
    (["--tensor-type", "no_such_tensor=q8_0"], ["'no_such_tensor=q8_0' matches no tensor"]),
    (["--tensor-type", "ffn=q8_0", "--tensor-type", "ffn_down=q4_1"], ["'ffn_down=q4_1'", "taken by the earlier 'ffn=q8_0'"]),
    (["--include", "no_such*"], ["--include 'no_such*' matches no tensor"]),
    (["--exclude", "*.no_such"], ["--exclude '*.no_such' matches no tensor"]),
    (["--keep", "int8:no_such*"], ["--keep 'no_such*' matches no tensor"]),
])
def test_a_pattern_or_glob_matching_no_tensor_is_refused(tiny_model_dir, tmp_path, args, needles):
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path]):
        r = invoke("quantize", str(tiny_model_dir), "-o", str(tmp_path / "o.gguf"), *_GGUF, *args)
    assert_refused(r, *needles)


def test_a_plan_glob_matching_no_tensor_is_refused(tiny_model_dir, tmp_path):
    with Unchanged(inputs=[tiny_model_dir], dirs=[tmp_path]):
        r = invoke("plan", str(tiny_model_dir), "-o", str(tmp_path / "p.json"), "--target-bits", "5", "--exclude", "nope")
    assert_refused(r, "--exclude 'nope' matches no tensor")


# --------------------------------------------------------------------------- the lossless-grid note


def test_a_model_on_the_q4_k_grid_is_named_so_not_q4_1(tmp_path):
    """A model whose block projections were put on q4_k's grid (qkit's own q4_k, quantized and dequantized):
    the plan's note names q4_k and its tensor count, and says nothing of the default model's Q4_1."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from qkit.schemes import get_scheme, quantize_tensor
    from qkit.transform import is_block_projection

    d = tmp_path / "k"
    make_tiny_llama(d, hidden=256, intermediate=512, layers=1)
    q4k = get_scheme("q4_k")
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            meta, tensors = s.metadata(), {k: s.get_tensor(k) for k in s.keys()}
        on_grid = {k: quantize_tensor(t, q4k).dequantize(t.dtype) if is_block_projection(k, tuple(t.shape)) else t
                   for k, t in tensors.items()}
        save_file(on_grid, str(f), metadata=meta)
    r = invoke("plan", str(d), "-o", str(tmp_path / "p.json"), "--format", "gguf", "--target-bits", "6",
               "--candidates", "q4_k,q8_0", "--calibration-samples", "2", "--calibration-seqlen", "32",
               "--check-windows", "1")
    assert r.code == 0, r.text
    text = " ".join(r.text.split())
    planned = json.loads((tmp_path / "p.json").read_text())["tensors"]
    n = sum(t["lossless"] and t["type"] == "q4_k" for t in planned.values())
    assert n >= 5 and all(t["type"] == "q4_k" for t in planned.values())  # 7 planned, most reproduced exactly
    assert f"reproduces the source weights exactly (predicted KL 0): q4_k ({n} tensors)" in text, text
    assert "that type's grid" in text and "Q4_1" not in text


def test_the_note_names_the_default_models_history_only_for_it():
    from qkit.cli.plan import lossless_note
    from qkit.models import DEFAULT_MODEL_NAME
    from qkit.plan import Plan, TensorChoice
    from qkit.plan.planfile import lossless_types
    from qkit.schemes import get_scheme

    def plan(model):
        t = {f"model.layers.{i}.mlp.up_proj.weight": TensorChoice("q4_1", get_scheme("q4_1"), (64, 64), 10, 0.0, True)
             for i in range(3)}
        t["model.layers.0.mlp.down_proj.weight"] = TensorChoice("q8_0", get_scheme("q8_0"), (64, 64), 10, 0.0, True)
        t["model.layers.1.mlp.down_proj.weight"] = TensorChoice("q4_0", get_scheme("q4_0"), (64, 64), 10, 0.1, False)
        t["model.layers.2.mlp.down_proj.weight"] = TensorChoice("none", None, (64, 64), 10, 0.0, True)
        return Plan(model, "", "gguf", "rtn", {}, t)

    assert lossless_types(plan("m")) == {"q4_1": 3, "q8_0": 1}
    default, other, gguf = lossless_note(plan(DEFAULT_MODEL_NAME)), lossless_note(plan("/m")), lossless_note(plan("x.gguf"))
    assert "4 planned tensors" in default and "q4_1 (3 tensors), q8_0 (1 tensor)" in default
    assert "the default model was published as Q4_1" in default and "those types' grids" in default
    assert "Q4_1" not in other and "q4_1 (3 tensors)" in other
    assert "GGUF file" in gguf and "Q4_1" not in gguf
    empty = plan("m")
    empty.tensors = {k: v for k, v in empty.tensors.items() if not v.lossless or v.scheme is None}
    assert lossless_note(empty) is None


def test_eval_notes_mention_q4_1_only_for_the_default_model():
    from helpers_eval import make_row

    from qkit.evaluation.notes import interpret
    from qkit.pinned_models import DEFAULT

    ref = make_row("reference", 17.0, 0.0, 0.0, None, matrices=0)
    rows = [ref, make_row("q4_k", 17.0, 0.0, 0.0, 0), make_row("q5_1", 17.1, 0.3, 0.1, 4, matrices=14)]
    other, default = interpret(rows), interpret(rows, model=DEFAULT)
    assert any(n.startswith("q4_k reproduces the reference's weights bit for bit: they already lie on q4_k's grid")
               for n in other)
    assert any(n.startswith("q5_1 reproduces 10 of its 14 quantized tensors") for n in other)
    assert not any("Q4_1" in n for n in other)
    assert sum("published as Q4_1" in n for n in default) == 2


def _model_arguments() -> list[tuple[str, str]]:
    """``(command path, argument name)`` of every command whose first argument names a model or checkpoint."""
    found = []

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])
            return
        args = [p for p in cmd.params if p.param_type_name == "argument"]
        if args and args[0].name in ("model", "checkpoint"):
            found.append((" ".join(path), args[0].name))

    walk(typer.main.get_command(app), [])
    return sorted(found)


@pytest.mark.parametrize("command,arg", _model_arguments(), ids=lambda x: str(x))
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_model_argument_is_refused_not_taken_for_the_default(tmp_path, command, arg, value):
    """An empty MODEL (``qkit eval "$MODEL"`` with the variable unset) is a mistake, never the pinned default
    model (which is what leaving MODEL out means); an empty CHECKPOINT is not the current directory."""
    extra = {"quantize": ["-o", str(tmp_path / "out")], "plan": ["-o", str(tmp_path / "p.json"), "--target-bits", "4"],
             "imatrix": ["-o", str(tmp_path / "i.gguf")], "inspect sensitivity": ["--scheme", "q4_0"],
             "inspect matrix": ["model.layers.0.mlp.down_proj.weight"], "inspect next-token": ["hi"]}.get(command, [])
    with Unchanged(dirs=[tmp_path]):
        out = invoke(*command.split(), value, *extra)
    assert_refused(out, "is empty")
    assert len(_model_arguments()) >= 8  # eval, quantize, plan, imatrix, verify, inspect ..., budget, kv
