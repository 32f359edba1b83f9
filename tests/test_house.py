"""House rules that no other test sees: the shape of the test suite and of the source tree.

- No test module imports another (``import test_x``, ``from test_x import ...``, ``tests.test_x``,
  ``importlib.import_module("test_x")``, at any depth): importing one runs its module code, its
  ``importorskip`` calls included, and ties the two files together. What tests share lives in
  ``tests/conftest.py`` (fixtures) or a module under ``tests/`` whose name does not start with
  ``test_`` (``helpers_*.py``, ``adversarial.py``), and those hold no tests.
- No module under ``src/qkit`` is over 500 lines. :data:`KNOWN_OVER` names the ones that are today,
  each a strict xfail: the day one is split, its test passes, which fails the run until its entry here
  is removed.
- No code dispatches on a scheme family's name (``scheme.kind == "ggml"``): it asks the class or the
  protocol (``isinstance(scheme, GGMLScheme)``, ``Recipe``, ``AbsmaxScheme``, ``is_fp4``, ``is_llama_type``). A family's
  name stays what a manifest entry or a message says. :data:`KIND_COMPARED` names the one place that reads a
  manifest's ``kind`` against the scheme's.
- ``export/`` imports nothing of layer 5 or above (:data:`ABOVE_EXPORT`), and only ``cli/`` imports ``verify/``:
  a format is below every reader of its files.
- No code dispatches on a format's or a scheme's name (``fmt == QKIT``, ``opts.format != "gguf"``,
  ``scheme.name == "nvfp4"``): it asks the registered ``Format`` (``stores_llama_types``, ``takes_plan``,
  ``torch_loads``, ...) or the scheme's class (``isinstance(scheme, NVFP4Scheme)``). :data:`NAME_COMPARED`
  names the modules where such a word is compared, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src" / "qkit"
MAX_LINES = 500

# Over MAX_LINES today and being split; remove an entry once its module is under the limit.
KNOWN_OVER = {
}


def _is_test_module(name: str) -> bool:
    """``test_x``, ``tests.test_x`` or ``.test_x``: a test module's name as an import spells it."""
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") and (name == last or name.startswith("tests."))


def imported_test_modules(path: Path) -> list[str]:
    """The test modules ``path`` imports, anywhere in it: ``import``, ``from ... import`` (relative
    too, and ``from tests import test_x``) and ``importlib.import_module`` / ``__import__`` with a
    literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level and module.startswith("test_") or _is_test_module(module):
                found.append("." * node.level + module)
            elif module in ("", "tests"):  # from . import test_x; from tests import test_x
                found += [f"{module or '.'}:{a.name}" for a in node.names if a.name.startswith("test_")]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0].value
            if called in ("import_module", "__import__") and isinstance(arg, str) and _is_test_module(arg):
                found.append(arg)
    return found


def test_the_import_scan_sees_every_spelling(tmp_path):
    p = tmp_path / "test_probe.py"
    p.write_text(
        "import os, test_a\n"
        "from test_b import x\n"
        "from tests.test_c import y\n"
        "import tests.test_d as d\n"
        "from . import test_e\n"
        "from .test_f import z\n"
        "from tests import test_g\n"
        "def f():\n"
        "    import importlib\n"
        "    from test_h import w\n"
        "    return importlib.import_module('test_i'), __import__('tests.test_j')\n"
        "import helpers_x, conftest, attest_k\n"
        "from helpers_report import test_looking_name\n"
    )
    assert sorted(imported_test_modules(p)) == sorted(
        ["test_a", "test_b", "tests.test_c", "tests.test_d", ".:test_e", ".test_f", "tests:test_g", "test_h",
         "test_i", "tests.test_j"])


@pytest.mark.parametrize("path", sorted(TESTS.rglob("*.py")), ids=lambda p: str(p.relative_to(TESTS)))
def test_no_module_under_tests_imports_a_test_module(path):
    assert imported_test_modules(path) == [], (
        f"{path.name} imports a test module: move what they share into tests/conftest.py (a fixture) or a "
        "tests/helpers_*.py module")


def _defines_tests(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [n.name for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
            or isinstance(n, ast.ClassDef) and n.name.startswith("Test")]


@pytest.mark.parametrize("path", sorted(p for p in TESTS.rglob("*.py") if not p.name.startswith("test_")),
                         ids=lambda p: str(p.relative_to(TESTS)))
def test_shared_modules_under_tests_hold_no_tests(path):
    assert _defines_tests(path) == [], f"{path.name} is imported by test modules: its tests belong in a test_*.py"


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def _size_cases():
    for path in _modules():
        rel = path.relative_to(SRC).as_posix()
        known = rel in KNOWN_OVER
        marks = [pytest.mark.xfail(strict=True, reason=f"known over {MAX_LINES}: {KNOWN_OVER[rel]}")] if known else []
        yield pytest.param(path, id=rel, marks=marks)


@pytest.mark.parametrize("path", list(_size_cases()))
def test_no_source_module_is_over_500_lines(path):
    n = _line_count(path)
    assert n <= MAX_LINES, f"src/qkit/{path.relative_to(SRC).as_posix()} has {n} lines (at most {MAX_LINES}): split it"


def test_the_known_oversized_modules_exist():
    """An entry for a module that was split into a package or renamed away is stale: remove it."""
    missing = sorted(rel for rel in KNOWN_OVER if not (SRC / rel).is_file())
    assert not missing, f"KNOWN_OVER names modules that are gone: {missing}; remove them from tests/test_house.py"


# --------------------------------------------------------------------------- formats below what reads their files

# What ``export/`` may not import: the rest of layer 5 and every layer above (docs/architecture.md, "Layers").
# Reading an export back to check it is ``verify/``'s work, above ``export``, ``simulate`` and ``evaluation``.
ABOVE_EXPORT = ("qkit.methods", "qkit.simulate", "qkit.serving", "qkit.plan", "qkit.choice", "qkit.writing",
                "qkit.api", "qkit.evaluation", "qkit.verify", "qkit.inspect", "qkit.cli", "qkit.report")
VERIFY_READERS = ("verify/", "cli/")  # nothing else imports qkit.verify


def qkit_imports(source: str) -> set[str]:
    """Every ``qkit`` module a source imports, at any depth (``from qkit import api`` counts as ``qkit.api``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in found if name == "qkit" or name.startswith("qkit.")}


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_qkit_import_scan_sees_every_spelling():
    src = "import qkit.plan\nfrom qkit import api\ndef f():\n    from qkit.verify.vllm import x\nimport os\n"
    assert {n for n in qkit_imports(src) if _under(n, ABOVE_EXPORT)} == {"qkit.plan", "qkit.api",
                                                                          "qkit.verify.vllm", "qkit.verify.vllm.x"}


@pytest.mark.parametrize("path", [pytest.param(p, id=p.relative_to(SRC).as_posix()) for p in _modules()
                                  if p.relative_to(SRC).as_posix().startswith("export/")])
def test_export_imports_nothing_above_it(path):
    above = sorted(n for n in qkit_imports(path.read_text()) if _under(n, ABOVE_EXPORT))
    assert not above, f"src/qkit/{path.relative_to(SRC).as_posix()} imports {above}: a format sits below them"


@pytest.mark.parametrize("path", [pytest.param(p, id=p.relative_to(SRC).as_posix()) for p in _modules()
                                  if not p.relative_to(SRC).as_posix().startswith(VERIFY_READERS)])
def test_only_the_cli_imports_verify(path):
    found = sorted(n for n in qkit_imports(path.read_text()) if _under(n, ("qkit.verify",)))
    assert not found, f"src/qkit/{path.relative_to(SRC).as_posix()} imports {found}: verify sits above it"


# --------------------------------------------------------------------------- no dispatch on a family's name

SCHEME_KINDS = {"absmax", "nf4", "fp4", "ggml"}  # the ``kind`` of every registered scheme family
KIND_COMPARED = {"schemes/registry.py"}  # a manifest entry's "kind" checked against the scheme it names


def kind_comparisons(source: str) -> list[int]:
    """Lines comparing some ``X.kind`` with a scheme family's name (``==``, ``!=``, ``in``, ``not in``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        kind = any(isinstance(o, ast.Attribute) and o.attr == "kind" for o in operands)
        names = {c.value for o in operands for c in ([o] if isinstance(o, ast.Constant) else
                 getattr(o, "elts", [])) if isinstance(c, ast.Constant)}
        if kind and names & SCHEME_KINDS:
            found.append(node.lineno)
    return found


def test_the_kind_scan_sees_every_spelling():
    src = ('if scheme.kind == "ggml": pass\nif "absmax" != s.kind: pass\nif t[n].kind in ("nf4", "fp4"): pass\n'
           'if ref.kind == "gguf": pass\nif self.kind == DIV: pass\nif isinstance(s, GGMLScheme): pass\n')
    assert kind_comparisons(src) == [1, 2, 3]


@pytest.mark.parametrize("path", [pytest.param(p, id=p.relative_to(SRC).as_posix()) for p in _modules()
                                  if p.relative_to(SRC).as_posix() not in KIND_COMPARED])
def test_no_module_dispatches_on_a_scheme_kind(path):
    lines = kind_comparisons(path.read_text())
    assert not lines, (f"src/qkit/{path.relative_to(SRC).as_posix()} compares a scheme's kind with a family name on "
                       f"line(s) {lines}: ask the class or protocol instead (isinstance(scheme, GGMLScheme), ...)")


# --------------------------------------------------------------------------- no dispatch on a format's or scheme's name

# Modules that may compare a registered format's or scheme's name, and why: the registries themselves, and
# places where the same word is something else (a file's own field, a model source's kind, a program name).
NAME_COMPARED = {
    "schemes/registry.py": "the scheme registry: a manifest entry's kind against the scheme it names",
    "schemes/ggml.py": "a family file: which of its own ggml kinds carries a minimum",
    "evaluation/rows.py": "the eval row registry: which ladder step reads no importance matrix",
    "export/bitsandbytes.py": "bitsandbytes' own bnb_4bit_quant_type field (its word nf4)",
    "export/gguf/metadata.py": "a ModelRef's kind (the model came from a GGUF file)",
    "models/files.py": "a ModelRef's kind (a qkit checkpoint given as the model)",
    "models/resolving.py": "config.json's quant_method, read while resolving (below the format registry)",
    "outputs.py": "config.json's quant_method, read by the layer-1 check of what qkit wrote",
    "claims.py": "the program's own name in argv[0]",
}


def _registered_words() -> set[str]:
    """Every registered format's name and alias, and every registered scheme's name."""
    from qkit.export import REGISTRY
    from qkit.schemes import scheme_names

    return {*REGISTRY._keys, *scheme_names()}  # _keys: every normalized name and alias (ct, bnb)


def name_comparisons(source: str, words: set[str]) -> list[int]:
    """Lines comparing (``==``, ``!=``, ``in``, ``not in``) with ``QKIT``, with a literal that is one of ``words``
    (a format's or scheme's name), or ``scheme.name`` with a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = {c.value for o in operands for c in ([o] if isinstance(o, ast.Constant) else getattr(o, "elts", []))
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        qkit = any(isinstance(o, ast.Name) and o.id == "QKIT" or isinstance(o, ast.Attribute) and o.attr == "QKIT"
                   for o in operands)
        scheme_name = literals and any(
            isinstance(o, ast.Attribute) and o.attr == "name" and (
                isinstance(o.value, ast.Name) and o.value.id == "scheme"
                or isinstance(o.value, ast.Attribute) and o.value.attr == "scheme") for o in operands)
        if qkit or literals & words or scheme_name:
            found.append(node.lineno)
    return found


def test_the_name_scan_sees_every_spelling():
    src = ('if fmt == QKIT: pass\nif export.QKIT != f: pass\nif opts.format == "gguf": pass\n'
           'if name in ("ct", "bnb"): pass\nif qt.scheme.name == "nvfp4": pass\nif scheme.name != "zzz": pass\n'
           'if isinstance(s, NVFP4Scheme): pass\nif fmt.takes_plan(other): pass\nif method.name == "gptq": pass\n')
    assert name_comparisons(src, {"gguf", "ct", "bnb", "nvfp4"}) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("path", [pytest.param(p, id=p.relative_to(SRC).as_posix()) for p in _modules()
                                  if p.relative_to(SRC).as_posix() not in NAME_COMPARED])
def test_no_module_dispatches_on_a_format_or_scheme_name(path):
    lines = name_comparisons(path.read_text(), _registered_words())
    assert not lines, (f"src/qkit/{path.relative_to(SRC).as_posix()} compares a format's or scheme's name on line(s) "
                       f"{lines}: ask the Format (stores_llama_types, takes_plan, ...) or the scheme's class instead")


def test_the_modules_allowed_to_compare_names_exist_and_do():
    """An entry for a module that is gone, or that no longer compares a name, is stale: remove it."""
    stale = sorted(rel for rel in NAME_COMPARED
                   if not (SRC / rel).is_file() or not name_comparisons((SRC / rel).read_text(), _registered_words()))
    assert not stale, f"NAME_COMPARED names modules that compare no name: {stale}; remove them from tests/test_house.py"
