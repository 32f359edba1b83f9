"""``quantize_gguf`` against llama-quantize, for every architecture of the converter issue, without llama.cpp:
its output recorded once, per file, per tensor.

The claim (docs/gguf.md, "llama-quantize in qkit"): from the F32 GGUF that llama.cpp's converter writes
for a model, ``quantize_gguf(F32, OUT, FTYPE[, imatrix])`` writes the file ``llama-quantize [--imatrix
imatrix.gguf] [--pure] F32.gguf OUT.gguf FTYPE`` writes, byte for byte: the header (KV fields, tensor
infos) and every tensor. The models are ``helpers_archs``' tiny seeded ones (the default model's
tokenizer); the importance matrix is ``helpers_requantize.seeded_imatrix`` (one row per expert for the
``_exps`` tensors, one expert that counted no token). ``tests/golden/requantize.json`` holds, per
architecture, the sha256 of the F32 input (a changed converter or numpy/torch stream is reported as
that) and per file the sha256 of the whole file, of its header and of each tensor's bytes as
llama-quantize wrote them; and per ftype llama-quantize's ``--dry-run`` types of every tensor, which the
rules (``qkit.schemes.llama_rules``) must give for every ftype, those qkit has no encoder for included.

qwen2, gemma2 and phi3 get ``helpers_archs.spm_tokenizer``'s SentencePiece tokenizer instead (``SPM_ARCHS``):
the pinned converter refuses them with the default model's (qwen2: "BPE pre-tokenizer was not recognized",
transformers 5 loading it as ``Qwen2Tokenizer``; gemma2's class reads only a tokenizer.model; phi3's asks for
one unless the config names a BPE class), and their classes read a ``tokenizer.model`` first. (qwen2's
``qkit quantize --format gguf`` is qkit's own writer, not this route; the file checked here is
``quantize_gguf`` of the converter's F32, as for the others.)

Recorded with llama.cpp's tools built (``python benchmarks/build_llama_ref.py --tools``):

    QKIT_RECORD_REQUANTIZE=1 python -m pytest tests/test_golden_requantize.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import benchmark_module
from helpers_archs import ARCHS, MOE_ARCHS, spm_tokenizer
from qkit.assets import sha256_file
from helpers_requantize import SPM_ARCHS, f32_model, file_digest, seeded_imatrix

from qkit.export.gguf.reader import read_header
from qkit.export.gguf.requantize import FTYPES, tensor_floats, encode, plan, quantize_gguf
from qkit.methods.imatrix import read, write_gguf
from qkit.schemes import get_scheme
from qkit.schemes.llama_rules import ModelFacts, Params, category, llama_order, tensor_types
from qkit.schemes.llama_log import llama_quantize_types

GOLDEN_PATH = Path(__file__).parent / "golden" / "requantize.json"
RECORD = os.environ.get("QKIT_RECORD_REQUANTIZE") == "1"
RECORD_COMMAND = "QKIT_RECORD_REQUANTIZE=1 python -m pytest tests/test_golden_requantize.py"
# the BPE ones first, in the order files_of alternates its halves along (as before the SentencePiece ones came)
CONVERTED = tuple(a for a in ARCHS if a not in SPM_ARCHS) + SPM_ARCHS
# key -> (what quantize_gguf is given, llama-quantize's ftype, --pure, --imatrix)
FILES = {
    "q8_0": ("Q8_0", "Q8_0", False, False),
    "q4_k": ("scheme:q4_k", "Q4_K_S", True, False),  # qkit's uniform q4_k: the ftype its GGUF writer records
    "q4_k_m": ("Q4_K_M", "Q4_K_M", False, False),
    "q4_k_m+imatrix": ("Q4_K_M", "Q4_K_M", False, True),
    "iq4_xs+imatrix": ("IQ4_XS", "IQ4_XS", False, True),
    "q2_k+imatrix": ("Q2_K", "Q2_K", False, True),
    "tq1_0": ("TQ1_0", "TQ1_0", False, False),
    "iq3_xs+imatrix": ("IQ3_XS", "IQ3_XS", False, True),  # IQ3_S, with IQ3_XXS for attn_q/k and middle ffn_gate/up
    "iq3_xxs+imatrix": ("IQ3_XXS", "IQ3_XXS", False, True),  # IQ3_XXS, IQ2_S for attn_q/k, IQ3_S attn_output
    "iq2_xxs+imatrix": ("IQ2_XXS", "IQ2_XXS", False, True),
    "iq2_xs+imatrix": ("IQ2_XS", "IQ2_XS", False, True),
    "iq2_s+imatrix": ("IQ2_S", "IQ2_S", False, True),  # IQ2_XS, IQ3_S for attn_v/attn_output/first ffn_down
    "iq2_m+imatrix": ("IQ2_M", "IQ2_M", False, True),  # IQ2_S, the same
    "iq1_s+imatrix": ("IQ1_S", "IQ1_S", False, True),  # IQ1_S, IQ2_XXS for attn_output
    "iq1_m+imatrix": ("IQ1_M", "IQ1_M", False, True),
}
# the same, for the mixture-of-experts architectures only: MXFP4_MOE writes their expert tensors in MXFP4
# (a dense model's file is Q8_0 throughout, which the q8_0 file already checks)
MOE_FILES = {"mxfp4_moe": ("MXFP4_MOE", "MXFP4_MOE", False, False)}
# files that CI checks on one architecture only (each file checked costs seconds): key -> that architecture
ONCE = {"tq1_0": "qwen3_moe", "mxfp4_moe": "gpt_oss", "iq3_xs+imatrix": "mixtral"}
# files whose grid-type tensors CI checks on these architectures only, and not their whole file: their heads
# (Q5_K output, Q2_K / IQ3_S token_embd, 12.6M weights each) are 10-20 s a file, while their IQ2 / IQ3 tensors,
# the bytes these files add, are a second; every whole file with QKIT_REQUANTIZE_ALL_FILES=1
GRID_ONLY = {k: ("llama", "qwen3_moe") for k in ("iq3_xxs+imatrix", "iq2_xxs+imatrix", "iq2_xs+imatrix", "iq2_s+imatrix",
                                                  "iq2_m+imatrix", "iq1_s+imatrix", "iq1_m+imatrix")}
GRID_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
# the ftypes whose rules read whether a matrix is given (has_imatrix): their dry runs are recorded both ways
READS_IMATRIX = ("IQ3_XXS", "IQ4_NL", "IQ4_XS", "Q4_0", "Q5_0")
DRY_RUNS = [(f, False) for f in FTYPES if f not in ("Q3_K", "Q4_K", "Q5_K", "F32")] + [(f, True) for f in READS_IMATRIX]
IMATRIX_SEED = 20251


def _dry_key(ftype: str, weighted: bool) -> str:
    return ftype + ("+imatrix" if weighted else "")


@pytest.fixture(scope="module")
def golden() -> dict:
    return {} if RECORD else json.loads(GOLDEN_PATH.read_text())


@pytest.fixture(scope="module")
def f32(default_model_dir, tmp_path_factory):
    """arch -> the converter's F32 GGUF (made on first use, cached)."""
    work = tmp_path_factory.mktemp("f32")
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            if arch in SPM_ARCHS:
                pytest.importorskip("sentencepiece", reason="the SentencePiece tokenizer needs the test extra's sentencepiece")
            tokenizer = spm_tokenizer(work / "spm") if arch in SPM_ARCHS else default_model_dir
            made[arch] = f32_model(arch, tokenizer, work)
        return made[arch]

    return get


def recorded(arch: str) -> dict[str, tuple[str, str, bool, bool]]:
    """The files recorded for ``arch``: ``FILES``, and ``MOE_FILES`` for a mixture-of-experts model."""
    return {**FILES, **(MOE_FILES if arch in MOE_ARCHS else {})}


def _quantize(source: Path, key: str, work: Path, *, record: bool = False):
    given, _, _, weighted = {**FILES, **MOE_FILES}[key]
    ftype = get_scheme(given.removeprefix("scheme:")) if given.startswith("scheme:") else given
    cwd = Path.cwd()
    os.chdir(work)  # quantize.imatrix.file records the path as given: "imatrix.gguf", as in the recording
    try:
        return quantize_gguf(source, work / f"{key}.gguf", ftype, imatrix=read("imatrix.gguf") if weighted else None,
                             record=record)
    finally:
        os.chdir(cwd)


def _work(source: Path, tmp: Path) -> Path:
    write_gguf(seeded_imatrix(source, IMATRIX_SEED), tmp / "imatrix.gguf")
    return tmp


# --------------------------------------------------------------------------- recording (llama.cpp's tools)


def _record_arch(arch: str, source: Path, work: Path) -> dict:
    blr = benchmark_module("build_llama_ref")
    tool = blr.tool_path("llama-quantize")
    if not tool.exists():
        pytest.fail("recording needs llama.cpp's tools: python benchmarks/build_llama_ref.py --tools")
    files = {}
    for key, (_, ftype, pure, weighted) in recorded(arch).items():
        out = work / f"llama-{key}.gguf"
        cmd = [str(tool), *(["--imatrix", "imatrix.gguf"] if weighted else []), *(["--pure"] if pure else []),
               str(source), str(out), ftype, "2"]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
        assert p.returncode == 0, (arch, key, p.stderr[-2000:])
        files[key] = file_digest(out)
    header = read_header(source)
    names = [t.name for t in header.tensors]
    dry = {}
    for ftype, weighted in DRY_RUNS:
        cmd = [str(tool), "--dry-run", *(["--imatrix", "imatrix.gguf"] if weighted else []), str(source), ftype, "2"]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
        assert p.returncode == 0, (arch, ftype, p.stderr[-2000:])
        types = llama_quantize_types(p.stdout + p.stderr)
        assert set(types) == set(names), (arch, ftype)
        dry[_dry_key(ftype, weighted)] = [types[n].name for n in _order(header)]
    return {"f32_sha256": sha256_file(source), "files": files, "order": _order(header), "dry_run": dry}


def _order(header) -> list[str]:
    return llama_order(t.name for t in header.tensors)


def test_record(f32, tmp_path_factory):
    """With ``QKIT_RECORD_REQUANTIZE=1``: rewrite the golden file from llama-quantize (else nothing to do)."""
    if not RECORD:
        pytest.skip("records only with QKIT_RECORD_REQUANTIZE=1")
    blr = benchmark_module("build_llama_ref")
    archs = {}
    for arch in CONVERTED:
        source = f32(arch)
        archs[arch] = _record_arch(arch, source, _work(source, tmp_path_factory.mktemp(arch)))
    doc = {
        "description": "llama-quantize's output from the converter's F32 GGUF of each tiny seeded model: per file the "
                       "sha256 of the whole file, its header and each tensor; per ftype the --dry-run type of each tensor",
        "command": RECORD_COMMAND,
        "llama_cpp_commit": blr.commit(),
        "llama_cpp_python_sdist": blr.LLAMA_CPP_PYTHON,
        "converter": "convert_hf_to_gguf.py MODEL --outtype f32 (the sdist's source; the sentencepiece package reads the SentencePiece tokenizer)",
        "imatrix": f"tests/helpers_requantize.py seeded_imatrix(F32, {IMATRIX_SEED}), as imatrix.gguf in the working directory",
        "llama_quantize": {k: " ".join(["llama-quantize", *(["--imatrix imatrix.gguf"] if w else []), *(["--pure"] if p else []),
                                        "F32.gguf", "OUT.gguf", f, "2"])
                           for k, (_, f, p, w) in {**FILES, **MOE_FILES}.items()},
        "moe_only": sorted(MOE_FILES),
        "sentencepiece_tokenizer": list(SPM_ARCHS),
        "archs": archs,
    }
    GOLDEN_PATH.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- the tests


def test_golden_file_says_where_it_came_from(golden):
    if RECORD:
        pytest.skip("recording")
    assert golden["command"] == RECORD_COMMAND
    assert golden["llama_cpp_commit"] == benchmark_module("build_llama_ref").LLAMA_CPP_COMMIT
    assert set(golden["archs"]) == set(CONVERTED) and golden["sentencepiece_tokenizer"] == list(SPM_ARCHS)
    for name, arch in golden["archs"].items():
        assert set(arch["files"]) == set(recorded(name))
        assert set(arch["dry_run"]) == {_dry_key(f, w) for f, w in DRY_RUNS}


@pytest.mark.parametrize("arch", CONVERTED)
def test_rules_give_llama_quantizes_types_for_every_ftype(golden, f32, arch):
    """``tensor_types`` on the F32 header equals llama-quantize --dry-run's type of every tensor, for every
    ftype (those without a qkit encoder too), with and without a matrix where the rules read it."""
    if RECORD:
        pytest.skip("recording")
    want = golden["archs"][arch]
    source = f32(arch)
    assert sha256_file(source) == want["f32_sha256"], "the converter's F32 GGUF differs from the recorded one (not qkit's bytes)"
    header = read_header(source)
    facts = ModelFacts.from_metadata(header.fields)
    infos = [(t.name, t.ne, t.ggml_type) for t in header.tensors]
    for ftype, weighted in DRY_RUNS:
        got = tensor_types(infos, facts, Params(FTYPES[ftype], imatrix=weighted))
        assert list(got) == want["order"]
        bad = {n: (g.name, w) for (n, g), w in zip(got.items(), want["dry_run"][_dry_key(ftype, weighted)]) if g.name != w}
        assert not bad, f"{arch} {_dry_key(ftype, weighted)}: qkit/llama-quantize types differ: {bad}"


def files_of(arch: str) -> list[str]:
    """The files checked for ``arch``: every one with ``QKIT_REQUANTIZE_ALL_FILES=1``; else, to keep CI's time,
    alternate architectures take alternate halves of ``FILES`` (q8_0, q4_k_m, iq4_xs+imatrix / q4_k,
    q4_k_m+imatrix, q2_k+imatrix), so each file is checked on six architectures, and every MoE model
    with its per-expert matrix (qwen3_moe: q4_k_m and q2_k; mixtral and gpt_oss: iq4_xs); the ``ONCE`` files
    on their one architecture (tq1_0 on qwen3_moe, mxfp4_moe on gpt_oss, the model MXFP4_MOE was made for,
    iq3_xs+imatrix on mixtral); the ``GRID_ONLY`` files' grid tensors in ``test_grid_tensors_equal_llama_quantize``."""
    keys = list(recorded(arch))
    if os.environ.get("QKIT_REQUANTIZE_ALL_FILES") == "1":
        return keys
    halved = [k for k in keys if k not in ONCE and k not in GRID_ONLY]
    return halved[CONVERTED.index(arch) % 2::2] + [k for k in keys if ONCE.get(k) == arch]


def test_the_halves_cover_every_file_and_every_moe_imatrix():
    assert {k for a in CONVERTED for k in files_of(a)} | set(GRID_ONLY) == set(FILES) | set(MOE_FILES)
    assert all(set(a) <= set(CONVERTED) and set(a) & set(MOE_ARCHS) for a in GRID_ONLY.values())
    for arch in MOE_ARCHS:
        assert any(FILES[k][3] for k in files_of(arch) if k in FILES), arch
    assert all(k in recorded(a) for k, a in ONCE.items())


@pytest.mark.parametrize("arch", CONVERTED)
def test_every_file_equals_llama_quantize(golden, f32, tmp_path, arch):
    if RECORD:
        pytest.skip("recording")
    want = golden["archs"][arch]
    source = f32(arch)
    assert sha256_file(source) == want["f32_sha256"], "the converter's F32 GGUF differs from the recorded one (not qkit's bytes)"
    work = _work(source, tmp_path)
    for key in files_of(arch):
        r = _quantize(source, key, work)
        got = file_digest(r.path, (r.data_offset, r.tensors))
        exp = want["files"][key]
        assert list(got["tensors"]) == want["order"] and set(exp["tensors"]) == set(want["order"]), (arch, key)
        types = {n: (g[0], exp["tensors"][n][0]) for n, g in got["tensors"].items() if g[0] != exp["tensors"][n][0]}
        assert not types, f"{arch} {key}: qkit/llama-quantize types differ: {types}"
        differ = [n for n, g in got["tensors"].items() if g[1] != exp["tensors"][n][1]]
        assert not differ, f"{arch} {key}: bytes differ from llama-quantize's in {differ}"
        assert got["header"] == exp["header"], f"{arch} {key}: the header (metadata, tensor infos) differs"
        assert got["file"] == exp["file"]
        r.path.unlink()


@pytest.mark.parametrize("arch", sorted({a for archs in GRID_ONLY.values() for a in archs}))
def test_grid_tensors_equal_llama_quantize(golden, f32, tmp_path, arch):
    """The ``GRID_ONLY`` files on ``arch``: every tensor's type (``plan``, the rules) and the bytes of every block
    tensor of a grid i-quant (``encode`` with the matrix's rows, as ``quantize_gguf`` writes them) equal
    llama-quantize's (token_embd, IQ3_S in some of them, is 12.6M weights: left to the whole files)."""
    if RECORD:
        pytest.skip("recording")
    want = golden["archs"][arch]
    source = f32(arch)
    assert sha256_file(source) == want["f32_sha256"], "the converter's F32 GGUF differs from the recorded one (not qkit's bytes)"
    work = _work(source, tmp_path)
    header = read_header(source)
    checked = set()
    for key in (k for k, archs in GRID_ONLY.items() if arch in archs):
        exp = want["files"][key]["tensors"]
        planned, _ = plan(header, FTYPES[FILES[key][1]], False, read(work / "imatrix.gguf"), None, None, str(source))
        types = {p.info.name: (p.ggml_type.name, exp[p.info.name][0]) for p in planned if p.ggml_type.name != exp[p.info.name][0]}
        assert not types, f"{arch} {key}: qkit/llama-quantize types differ: {types}"
        grid = [p for p in planned if p.ggml_type.name in GRID_TYPES and category(p.info.name) not in ("token_embd", "output")]
        differ = [p.info.name for p in grid
                  if hashlib.sha256(encode(tensor_floats(source, header, p.info), p).tobytes()).hexdigest() != exp[p.info.name][1]]
        assert grid and not differ, f"{arch} {key}: bytes differ from llama-quantize's in {differ}"
        checked |= {p.ggml_type.name for p in grid}
    assert checked == set(GRID_TYPES)


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_against_llama_quantize_itself(f32, tmp_path, arch):
    """Live, where the tools are built: llama-quantize --imatrix at Q4_K_M and qkit's file with its
    ``qkit.export`` record differ in that one KV field only (every other field, tensor info and byte equal)."""
    tool = benchmark_module("build_llama_ref").tool_path("llama-quantize")
    if not tool.exists():
        pytest.skip("llama-quantize is not built (python benchmarks/build_llama_ref.py --tools)")
    source = f32(arch)
    work = _work(source, tmp_path)
    p = subprocess.run([str(tool), "--imatrix", "imatrix.gguf", str(source), "llama.gguf", "Q4_K_M", "2"],
                       capture_output=True, text=True, cwd=work)
    assert p.returncode == 0, p.stderr[-2000:]
    ours = _quantize(source, "q4_k_m+imatrix", work, record=True).path
    theirs, mine = read_header(work / "llama.gguf"), read_header(ours)
    assert [f for f in mine.kv if f[0] != "qkit.export"] == list(theirs.kv) and mine.kv[-1][0] == "qkit.export"
    assert mine.tensors == theirs.tensors
    a, b = ours.read_bytes(), (work / "llama.gguf").read_bytes()
    assert a[mine.data_offset:] == b[theirs.data_offset:]
