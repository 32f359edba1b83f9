"""Every ``--format`` is a registered ``Format``, qkit's own included, and nothing asks for one by name.

- ``get_format("qkit")`` is qkit's own safetensors directory, first in the registry;
- an unknown name is refused in the registry's one wording wherever a format is named: the library, the
  quantize and plan commands, the planner, an eval plan row;
- what the rest of qkit asks a format (llama.cpp types, the torch engine, the writer's shard, the reference,
  plans, a status line) each format answers itself;
- qkit's own format reads back what it encodes (``decode``, given the shape its manifest records), as
  ``checkpoint.iter_quantized`` reads a written checkpoint;
- a toy format, one class and one registry line in this file, is a format like the others: it is listed and
  helped, planned for with exact bytes, in the docs' table, and written by ``quantize_model`` and the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from conftest import importance_for

from qkit.api import QuantizeOptions, quantize_model
from qkit.checkpoint import iter_quantized, read_manifest, tensor_shapes
from qkit.cli import app
from qkit.errors import ExportError, InputError, SchemeError
from qkit.export import REGISTRY, QkitFormat, format_help, format_names, get_format, recognise
from qkit.export.common import SafetensorsFormat
from qkit.plan import PlanOptions, candidates, ladder, plan_formats
from qkit.plan.table import markdown
from qkit.schemes import QuantizedTensor, get_scheme, quantize_tensor, scheme_names
from qkit.schemes.base import Recipe

MISSING = "/nonexistent-qkit-model"
UNKNOWN = REGISTRY.unknown("onxx")  # the registry's one wording


def test_qkit_is_a_registered_format():
    qkit = get_format("qkit")
    assert isinstance(qkit, QkitFormat) and qkit is get_format(" QKIT ") is REGISTRY.find("qkit")
    assert format_names()[0] == REGISTRY.names()[0] == "qkit"
    assert format_help().startswith("qkit (every scheme, as qkit's own safetensors directory); ")
    assert REGISTRY.find("onxx") is None


def test_qkit_writes_what_it_encodes_and_recognises_it(tiny_model_dir, tmp_path):
    out = tmp_path / "q"
    result = quantize_model(tiny_model_dir, output=out, scheme="int4-g32", collect=True)
    qkit = get_format("qkit")
    assert result.format == "qkit" and recognise(out) is qkit and recognise(tiny_model_dir) is None
    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for key, t in qkit.encode(name, result.quantized[name]).items():
            assert torch.equal(f.get_tensor(key), t), key
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "qkit" and config["scheme"] == read_manifest(out)["scheme"]


@pytest.mark.parametrize("name", [n for n in scheme_names() if not isinstance(get_scheme(n), Recipe)])
def test_qkit_decodes_what_it_encodes_given_the_shape(name):
    """The protocol's read-back: ``decode`` of ``encode``'s tensors (without the module prefix) is the same
    QuantizedTensor, part for part, bit for bit, given the weight's shape; without it, one line."""
    qkit = get_format("qkit")
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    qt = quantize_tensor(w, get_scheme(name), **importance_for(get_scheme(name), 512))
    module = "model.layers.0.mlp.down_proj"
    stored = {k.removeprefix(f"{module}."): v for k, v in qkit.encode(f"{module}.weight", qt).items()}
    assert set(stored) == {f"weight.{part}" for part in qt.parts}
    back = qkit.decode(stored, qt.scheme, qt.dtype, shape=qt.shape)
    assert back.scheme is qt.scheme and back.shape == qt.shape == (64, 512) and back.dtype == qt.dtype
    assert back.parts.keys() == qt.parts.keys() and all(torch.equal(back.parts[k], v) for k, v in qt.parts.items())
    assert torch.equal(back.dequantize(), qt.dequantize())
    with pytest.raises(ExportError, match=rf"^a qkit checkpoint's {qt.scheme.name} parts do not hold the weight's shape; "
                                          r"pass the shape its manifest records"):
        qkit.decode(stored, qt.scheme, qt.dtype)
    with pytest.raises(SchemeError, match=r"cannot be stored in|but a \[64, 256\] weight"):  # parts of another shape
        qkit.decode(stored, qt.scheme, qt.dtype, shape=(64, 256))


def test_qkit_decode_reads_a_checkpoint_as_iter_quantized_does(tiny_model_dir, tmp_path):
    """Every quantized weight of a written checkpoint: its stored parts, decoded with the manifest's shape, are
    exactly what ``checkpoint.iter_quantized`` (what the torch engine streams into the model) reads."""
    out = tmp_path / "q"
    quantize_model(tiny_model_dir, output=out, scheme="int4-tensor")
    qkit, read = get_format("qkit"), 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for name, qt in iter_quantized(out):
            if not isinstance(qt, QuantizedTensor):
                continue
            module = name.removesuffix(".weight")
            stored = {k.removeprefix(f"{module}."): f.get_tensor(k) for k in f.keys() if k.startswith(f"{name}.")}
            back = qkit.decode(stored, qt.scheme, qt.dtype, shape=qt.shape)
            assert all(torch.equal(back.parts[k], v) for k, v in qt.parts.items()) and back.shape == qt.shape
            read += 1
            last = stored, qt
    assert read == len(read_manifest(out)["tensors"]) > 0
    # int4-tensor's parts are one run of codes and one scale: another shape of as many weights decodes too, which
    # is why the shape comes from the manifest, not from the parts
    stored, qt = last
    rows, cols = qt.shape
    assert qkit.decode(stored, qt.scheme, qt.dtype, shape=(1, rows * cols)).shape == (1, rows * cols)


def test_the_registry_wording_names_every_format():
    assert UNKNOWN == "unknown format 'onxx'; use one of: qkit, compressed-tensors, bitsandbytes, gguf"
    assert REGISTRY.unknown("gguv") == "unknown format 'gguv'; did you mean gguf? use one of: qkit, compressed-tensors, bitsandbytes, gguf"
    with pytest.raises(InputError) as e:
        get_format("onxx")
    assert str(e.value) == UNKNOWN


@pytest.mark.parametrize("args", [
    ["quantize", MISSING, "-o", "OUT", "--format", "onxx"],
    ["plan", MISSING, "-o", "p.json", "--format", "onxx", "--target-bits", "4.5"],
    ["eval", MISSING, "--schemes", "plan:onxx@4.5"],
], ids=["quantize", "plan", "eval-plan-row"])
def test_an_unknown_format_is_refused_in_one_wording_by_every_command(args):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [f"error: {UNKNOWN}"]


def test_an_unknown_format_is_refused_in_one_wording_by_the_library(tiny_model_dir, tmp_path):
    calls = [
        lambda: quantize_model(tiny_model_dir, output=tmp_path / "o", format="onxx"),
        lambda: PlanOptions(format="onxx", target_bits=4.5).check(),
        lambda: candidates("onxx", (64, 128), torch.float32),
    ]
    for call in calls:
        with pytest.raises(InputError) as e:
            call()
        assert str(e.value) == UNKNOWN
    assert not (tmp_path / "o").exists()


# What each format answers, where the code once compared its name.
ANSWERS = {  # stores_llama_types, torch_loads, holds_shard, unquantized_is_source, written_as
    "qkit": (True, True, True, True, ""),
    "compressed-tensors": (False, False, True, True, " as compressed-tensors"),
    "bitsandbytes": (False, False, True, True, " as bitsandbytes"),
    "gguf": (True, True, False, False, " as gguf"),
}


@pytest.mark.parametrize("name", list(ANSWERS))
def test_each_format_answers_for_itself(name):
    fmt = get_format(name)
    got = (fmt.stores_llama_types, fmt.torch_loads, fmt.holds_shard, fmt.unquantized_is_source, fmt.written_as)
    assert got == ANSWERS[name]
    # a plan is written in the format it was made for; qkit's own stores any plan's types
    takes = {other for other in plan_formats() if fmt.takes_plan(get_format(other))}
    assert takes == (set(plan_formats()) if name == "qkit" else {name} & set(plan_formats()))


def test_the_capabilities_reach_the_refusals(tiny_model_dir, tmp_path):
    """--tensor-type names the formats that store llama.cpp's types (from the registry, not a list of names)."""
    with pytest.raises(InputError, match=r"--tensor-type goes with --format qkit or gguf$"):
        quantize_model(tiny_model_dir, output=tmp_path / "o", scheme="int4-g32", format="ct",
                       options=QuantizeOptions(tensor_types=("attn_v=q8_0",)))
    with pytest.raises(InputError, match="--format qkit stores weights only"):
        quantize_model(tiny_model_dir, output=tmp_path / "o", scheme="int8-row",
                       options=QuantizeOptions(activations="int8-token"))


# --------------------------------------------------------------------------- a toy format: one class, one line

class ToyFormat(SafetensorsFormat):
    """Row-wise int8 and int4 codes with their scales, as ``weight_codes`` and ``weight_scale``."""

    name = library = "toy"
    help = "int8-row, int4-row: a toy loader"

    def plan_types(self):
        return ("int8-row", "int4-row")

    def refusal(self, scheme, tensor=None):
        return None if scheme.name in self.plan_types() else f"--format toy stores int8-row and int4-row, not {scheme.name}"

    def check(self, plan):
        for tensor, scheme in sorted(plan.targets.items()):
            if why := self.refusal(scheme, tensor):
                raise InputError(why)

    def encode(self, name, qt):
        module = name.removesuffix(".weight")
        return {f"{module}.weight_codes": qt.qweight, f"{module}.weight_scale": qt.scales}

    def quantization_config(self, plan):
        return {"quant_method": "toy", "ignore": plan.kept_linears}

    def reader(self, quantization_config):
        return self if quantization_config.get("quant_method") == "toy" else None


TOY = ToyFormat()


@pytest.fixture
def toy():
    with REGISTRY.temporarily("toy", TOY):
        yield TOY
    ladder.cache_clear()  # the ladder is cached by format name


def test_a_toy_format_is_listed_planned_and_tabled(toy):
    assert format_names()[-1] == "toy" and get_format("TOY") is toy
    assert format_help().endswith("; toy (int8-row, int4-row: a toy loader).")
    assert plan_formats() == ("qkit", "compressed-tensors", "gguf", "toy")
    got = candidates("toy", (64, 128), torch.float32)
    # int4-row: 64 x 128 x 4 bits + 64 fp16 scales; int8-row: 64 x 128 bytes + 64 fp16 scales; none: fp32
    assert [(c.name, c.nbytes) for c in got] == [("int4-row", 64 * 64 + 128), ("int8-row", 64 * 128 + 128),
                                                 ("none", 64 * 128 * 4)]
    assert "| `toy` | int8-row, int4-row: a toy loader | `int4-row`, `int8-row`, `none` (the source dtype) |" in markdown()


def test_a_toy_format_is_written_by_the_library_as_its_candidates_count(toy, tiny_model_dir, tmp_path):
    out = tmp_path / "toy"
    result = quantize_model(tiny_model_dir, output=out, scheme="int4-row", format="toy")
    assert result.format == "toy" and recognise(out) is toy
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "toy"
    assert json.loads((out / "qkit-export.json").read_text())["format"] == "toy"
    name = "model.layers.0.mlp.down_proj"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(k).nbytes for k in f.keys() if k.startswith(name + "."))
    shape = dict(tensor_shapes(tiny_model_dir))[f"{name}.weight"]
    assert stored == next(c.nbytes for c in candidates("toy", shape, torch.float32) if c.name == "int4-row")
    with pytest.raises(InputError, match="--format toy stores int8-row and int4-row, not nf4"):
        quantize_model(tiny_model_dir, output=tmp_path / "nf4", scheme="nf4", format="toy")
    with pytest.raises(InputError, match="--format toy cannot store q8_0 .* goes with --format qkit or gguf$"):
        quantize_model(tiny_model_dir, output=tmp_path / "tt", scheme="int8-row", format="toy",
                       options=QuantizeOptions(tensor_types=("attn_v=q8_0",)))


CLI = textwrap.dedent('''
    import json, sys
    from typer.testing import CliRunner
    sys.path.insert(0, {tests!r})
    from toy_format import TOY  # the class above, registered before the CLI is built
    from qkit.export import REGISTRY
    REGISTRY.register("toy", TOY)
    from qkit.cli import app

    run = CliRunner().invoke
    written = run(app, ["quantize", {model!r}, "-s", "int8-row", "--format", "toy", "-o", {out!r}])
    print(json.dumps({{"help": run(app, ["quantize", "--help"], terminal_width=400).output,
                      "plan_help": run(app, ["plan", "--help"], terminal_width=400).output,
                      "code": written.exit_code, "output": written.output}}))
    ''')


def test_a_toy_format_is_in_the_cli_help_and_written_by_the_cli(tiny_model_dir, tmp_path):
    """Registered before the CLI is built (as a plugin would be): --format lists it, and writes it."""
    source = open(__file__).read()
    toy = source[source.index("class ToyFormat"):source.index("TOY = ToyFormat()")]
    (tmp_path / "toy_format.py").write_text(
        "from qkit.errors import InputError\nfrom qkit.export.common import SafetensorsFormat\n\n\n" + toy + "TOY = ToyFormat()\n")
    script = tmp_path / "cli.py"
    out = tmp_path / "out"
    script.write_text(CLI.format(tests=str(tmp_path), model=str(tiny_model_dir), out=str(out)))
    env = {**os.environ, "COLUMNS": "400", "TERMINAL_WIDTH": "400", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    flat = " ".join(got["help"].replace("│", " ").split())
    assert "toy (int8-row, int4-row: a toy loader)." in flat
    assert "toy" in " ".join(got["plan_help"].replace("│", " ").split())
    assert got["code"] == 0, got["output"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "toy"
