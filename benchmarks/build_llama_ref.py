"""Build llama.cpp's reference quantizers once, into the qkit cache, and record the k-quant golden values.

    python benchmarks/build_llama_ref.py                   # fetch + build ggml-base (about 30 s of compiling)
    python benchmarks/build_llama_ref.py --record-golden   # ... and rewrite tests/golden/kquants.json
    python benchmarks/build_llama_ref.py --tools           # ... and llama-quantize, -perplexity, -tokenize, -imatrix (minutes)

Nothing of llama.cpp is committed to this repository: ``pip download`` fetches the source distribution of
llama-cpp-python (pinned below; it vendors llama.cpp at a fixed commit) into
``qkit.assets.cache_dir() / "llama_ref"``, and cmake builds the ``ggml-base`` library there (it holds
``ggml-quants.c``, the reference quantizers ``quantize_row_*_ref`` that ``ggml_quantize_chunk`` calls when
no importance matrix is given: what ``llama-quantize`` runs per row). The library is used through
``ctypes``: :func:`load` returns a :class:`Reference` (or ``None`` when it is not built), which
``tests/test_schemes_kquants.py`` and ``benchmarks/bench_ggml.py`` use when present.

``--record-golden`` quantizes a fixed set of inputs (seeded numpy draws, edge cases, and rows of the
default model when it is in the cache) with the C reference, for q4_k and q6_k and, for the cases where
the ``gguf`` package and llama.cpp disagree (signed zeros, weights below fp32's normal range), for the
32-block types, and writes inputs and expected bytes (base64) with the llama.cpp version, compiler and
this command to ``tests/golden/kquants.json``. The tests then need no compiler.

``--tools`` builds llama.cpp's ``llama-quantize``, ``llama-perplexity``, ``llama-tokenize`` and ``llama-imatrix`` binaries (Release, static
libraries, no server/tests/examples, no curl) in a separate directory, ``build-tools`` (so the ggml-base
build above and the compiler flags recorded with the golden values stay untouched), and writes how long
the build took to ``build-tools/qkit-build.json``; ``benchmarks/bench_llama_cpp.py`` uses them.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qkit.assets import cache_dir

NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors llama.cpp at the commit below
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # ggml 0.25.3
ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "kquants.json"


def ref_dir() -> Path:
    return cache_dir() / "llama_ref" / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"


def lib_path() -> Path:
    return ref_dir() / "build" / "bin" / "libggml-base.so"


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def fetch() -> Path:
    """The vendored llama.cpp source tree (downloaded and extracted on first use)."""
    src = ref_dir() / "src"
    if (src / "ggml" / "src" / "ggml-quants.c").exists():
        return src
    dl = ref_dir() / "download"
    dl.mkdir(parents=True, exist_ok=True)
    sdist = dl / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        _run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "--no-deps",
              "--no-binary", ":all:", "-d", str(dl)])
    tmp = ref_dir() / "extract.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix + "vendor/llama.cpp/")
                   or m.name.startswith(prefix + ".git/modules/vendor/llama.cpp/")]
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(src, ignore_errors=True)
    (tmp / prefix / "vendor" / "llama.cpp").rename(src)
    shutil.rmtree(tmp, ignore_errors=True)
    return src


def build(targets: tuple[str, ...] = ("ggml-base",)) -> Path:
    """Configure (Release, shared libraries, no tests/examples/server) and build ``targets``."""
    src = fetch()
    out = ref_dir() / "build"
    if not (out / "CMakeCache.txt").exists():
        _run(["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
              "-DLLAMA_CURL=OFF", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"])
    _run(["cmake", "--build", str(out), "--target", *targets, "-j", "2"])
    return lib_path()


TOOLS = ("llama-quantize", "llama-perplexity", "llama-tokenize", "llama-imatrix")  # tokenize: the token ids the benchmark scores


def tools_dir() -> Path:
    return ref_dir() / "build-tools"


def tool_path(name: str) -> Path:
    return tools_dir() / "bin" / name


def tools_built() -> bool:
    return all(tool_path(t).exists() for t in TOOLS)


def build_tools(jobs: int = 2) -> dict:
    """Configure and build :data:`TOOLS` into :func:`tools_dir` (static, Release); returns the timing record."""
    src = fetch()
    out = tools_dir()
    cmds = []
    t0 = time.perf_counter()
    if not (out / "CMakeCache.txt").exists():
        cmds.append(["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                     "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                     "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
                     # llama.cpp's AMX matmul (ggml_backend_amx_mul_mat) dies with SIGSEGV on the project's machine,
                     # whose CPU reports AMX: the tools are built without it (AVX-512 and VNNI stay on); an
                     # explicit -mno-* wins over -march=native's features in GCC and clang
                     f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"])
        _run(cmds[-1])
    cmds.append(["cmake", "--build", str(out), "--config", "Release", "--target", *TOOLS, "-j", str(jobs)])
    _run(cmds[-1])
    seconds = time.perf_counter() - t0
    record = {"targets": list(TOOLS), "seconds": round(seconds, 1), "jobs": jobs, "commands": [" ".join(c) for c in cmds],
              "llama_cpp_commit": commit(), "machine": platform.machine(), "cpu_count": os.cpu_count()}
    rec = out / "qkit-build.json"
    # keep the first (from-scratch) build's time; a rebuild with nothing to do records itself separately
    old = json.loads(rec.read_text()) if rec.exists() else None
    if old is None or len(cmds) == 2:
        rec.write_text(json.dumps(record, indent=1) + "\n")
    else:
        old["last_rebuild_seconds"] = record["seconds"]
        rec.write_text(json.dumps(old, indent=1) + "\n")
    print(f"built {', '.join(TOOLS)} in {seconds:.0f} s ({out / 'bin'})")
    return record


def tools_record() -> dict | None:
    try:
        return json.loads((tools_dir() / "qkit-build.json").read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Reference:
    """llama.cpp's ``ggml_quantize_chunk`` through ctypes, with or without an importance matrix."""

    lib: ctypes.CDLL

    def quantize(self, x: np.ndarray, ggml_type, imatrix: np.ndarray | None = None) -> np.ndarray:
        """fp32 ``[rows, cols]`` -> uint8 ``[rows, bytes_per_row]``: llama.cpp's blocks of each row.

        ``imatrix``: fp32 ``[cols]``, the importance of each column (what ``llama-quantize --imatrix``
        passes for the tensor: the collected mean of ``x**2``); ``None`` is the path without one."""
        import gguf

        x = np.ascontiguousarray(x, dtype=np.float32)
        rows, cols = x.shape
        block, size = gguf.GGML_QUANT_SIZES[ggml_type]
        out = np.zeros((rows, cols // block * size), dtype=np.uint8)
        qw = None
        if imatrix is not None:
            imatrix = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
            assert imatrix.shape == (cols,), (imatrix.shape, cols)
            qw = imatrix.ctypes.data
        self.lib.ggml_quantize_chunk(int(ggml_type), x.ctypes.data, out.ctypes.data, 0, rows, cols, qw)
        return out


def load() -> Reference | None:
    """The built reference, or ``None`` (run this script to build it)."""
    if not lib_path().exists():
        return None
    lib = ctypes.CDLL(str(lib_path()))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return Reference(lib)


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(fetch()), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return LLAMA_CPP_COMMIT


def compile_flags() -> str:
    """The command that compiled ggml-quants.c (from cmake's compile_commands.json)."""
    try:
        for c in json.loads((ref_dir() / "build" / "compile_commands.json").read_text()):
            if c["file"].endswith("ggml/src/ggml-quants.c"):
                return " ".join(w for w in c["command"].split() if w.startswith(("-O", "-f", "-m", "-std", "-D")))
    except (OSError, ValueError, KeyError):
        pass
    return "unknown"


# --------------------------------------------------------------------------- golden values


def golden_cases() -> list[tuple[str, list[str], np.ndarray]]:
    """``(name, ggml type names, fp32 [rows, cols])``: what ``--record-golden`` records."""
    rng = np.random.default_rng(20240611)
    k = ["Q4_K", "Q6_K"]
    all7 = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"]
    f = np.float32
    cases: list[tuple[str, list[str], np.ndarray]] = [
        ("normal", k, rng.standard_normal((1, 512)).astype(f)),
        ("weight_like", k, (rng.standard_normal((2, 256)) * 0.02).astype(f)),
        ("heavy_tailed", k, (rng.standard_normal((2, 256)) / (rng.random((2, 256)) + 0.01)).astype(f)),
        ("small_integers_ties", k, rng.integers(-8, 9, (2, 256)).astype(f)),
        ("halves_ties", k, (rng.integers(-40, 41, (1, 256)) / 2).astype(f)),
        ("positive", k, rng.random((1, 256)).astype(f)),
        ("negative", k, -rng.random((1, 256)).astype(f)),
        ("constant", k, np.full((1, 256), 3.0, f)),
        ("sparse", k, np.where(rng.random((1, 512)) < 0.8, 0, rng.standard_normal((1, 512))).astype(f)),
        ("one_outlier", k, np.where(np.arange(256) == 77, 40.0, rng.standard_normal((1, 256)) * 0.1).astype(f)),
        ("large_1e3", k, (rng.standard_normal((1, 256)) * 1e3).astype(f)),
        ("below_group_max_eps", k, (rng.standard_normal((1, 256)) * 1e-16).astype(f)),
        ("all_zero", all7, np.zeros((1, 256), f)),
        ("signed_zeros", all7, np.where(np.arange(256) % 3 == 0, -0.0, np.where(np.arange(256) % 7 == 0, 1.0, 0.0))
         .reshape(1, 256).astype(f)),
        ("negative_zero_first", all7, np.concatenate([[-0.0], np.zeros(255)]).reshape(1, 256).astype(f)),
        ("subnormal_2e-140", all7, (rng.standard_normal((1, 256)) * 2.0**-140).astype(f)),
        ("subnormal_few_ulps", all7, (rng.integers(-3, 4, (1, 256)) * 2.0**-149).astype(f)),
        ("near_fp32_min_normal", all7, (rng.standard_normal((1, 256)) * 2.0**-122).astype(f)),
    ]
    model = _default_model_rows()
    if model is not None:
        cases.append(("default_model_down_proj_rows", all7, model))
    return cases


def _default_model_rows() -> np.ndarray | None:
    """Row 0 of layer 0's down_proj (width 1536) of the default model, when it is in the qkit cache."""
    try:
        from qkit.checkpoint import iter_tensors
        from qkit.models import resolve

        for name, t in iter_tensors(resolve(None).directory):
            if name == "model.layers.0.mlp.down_proj.weight":
                return t[:1].float().numpy().astype(np.float32)
    except Exception as exc:  # noqa: BLE001 - the model is optional here
        print(f"default model rows skipped: {exc}")
    return None


def record_golden(ref: Reference) -> None:
    import gguf

    entries = []
    for name, types, x in golden_cases():
        expected = {}
        for t in types:
            expected[t] = base64.b64encode(ref.quantize(x, gguf.GGMLQuantizationType[t]).tobytes()).decode()
        entries.append({"name": name, "shape": list(x.shape), "input_f32_le": base64.b64encode(x.astype("<f4").tobytes()).decode(),
                        "expected": expected})
    write_golden(GOLDEN, entries, "llama.cpp reference quantizer output (ggml_quantize_chunk, no imatrix) for fixed inputs: "
                 "q4_k / q6_k, and the 32-block types where the gguf package's numpy quantizer differs from C")


def write_golden(path: Path, entries: list[dict], description: str, **extra) -> None:
    """A golden file: the cases and how they were made (llama.cpp commit, compiler, flags, this command)."""
    cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    doc = {
        "description": description,
        "llama_cpp_commit": commit(),
        "llama_cpp_python_sdist": LLAMA_CPP_PYTHON,
        "ggml_quantize_c_flags": compile_flags(),
        "compiler": cc[0] if cc else "unknown",
        "machine": platform.machine(),
        "command": "python benchmarks/build_llama_ref.py --record-golden",
        **extra,
        "cases": entries,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(entries)} cases)")


GOLDEN_IMATRIX = ROOT / "tests" / "golden" / "ggml_imatrix.json"
LADDER_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def imatrix_golden_cases() -> list[tuple[str, np.ndarray, np.ndarray | None]]:
    """``(name, fp32 [rows, cols], importance fp32 [cols] or None)``: what ``--record-golden`` records into
    ``tests/golden/ggml_imatrix.json`` for every type of :data:`LADDER_TYPES`, with and without an
    importance matrix."""
    rng = np.random.default_rng(20261201)
    f = np.float32
    cols = 256  # one super-block per row (eight 32-blocks)
    mats = {
        "normal": rng.standard_normal((2, cols)).astype(f),
        "weight_like": (rng.standard_normal((1, cols)) * 0.02).astype(f),
        "heavy_tailed": (rng.standard_normal((2, cols)) / (rng.random((2, cols)) + 0.01)).astype(f),
        "small_integers_ties": rng.integers(-8, 9, (1, cols)).astype(f),
        "halves_ties": (rng.integers(-40, 41, (1, cols)) / 2).astype(f),
        "positive": rng.random((1, cols)).astype(f),
        "negative": -rng.random((1, cols)).astype(f),
        "constant": np.full((1, cols), 3.0, f),
        "sparse": np.where(rng.random((1, cols)) < 0.8, 0, rng.standard_normal((1, cols))).astype(f),
        "one_outlier": np.where(np.arange(cols) == 77, 40.0, rng.standard_normal((1, cols)) * 0.1).astype(f),
        "all_zero": np.zeros((1, cols), f),
        "tiny_1e-20": (rng.standard_normal((1, cols)) * 1e-20).astype(f),
    }
    imats = {
        "none": None,
        "random": (rng.random(cols) * 4 + 0.01).astype(f),
        "heavy": np.exp(rng.standard_normal(cols) * 2).astype(f),
        "with_zeros": np.where(rng.random(cols) < 0.3, 0, rng.random(cols)).astype(f),
    }
    cases = [(f"{m}/{i}", x, qw) for m, x in mats.items() for i, qw in imats.items()]
    model = _default_model_rows()
    if model is not None:
        wide = model[:, :1536]
        qw_real = np.abs(rng.standard_normal(1536) * 0.5 + 1).astype(f) ** 2
        cases += [("default_model_down_proj_rows/none", wide, None), ("default_model_down_proj_rows/random", wide, qw_real)]
    return cases


def record_imatrix_golden(ref: Reference) -> None:
    import gguf

    entries = []
    for name, x, qw in imatrix_golden_cases():
        expected = {t: base64.b64encode(ref.quantize(x, gguf.GGMLQuantizationType[t], qw).tobytes()).decode() for t in LADDER_TYPES}
        entries.append({"name": name, "shape": list(x.shape), "input_f32_le": base64.b64encode(x.astype("<f4").tobytes()).decode(),
                        "imatrix_f32_le": None if qw is None else base64.b64encode(qw.astype("<f4").tobytes()).decode(),
                        "expected": expected})
    write_golden(GOLDEN_IMATRIX, entries,
                 "llama.cpp's ggml_quantize_chunk output for fixed inputs, for every type of the GGUF ladder, "
                 "without an importance matrix (imatrix_f32_le null) and with one (the quantize_row_*_impl paths)",
                 types=LADDER_TYPES)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--record-golden", action="store_true", help=f"rewrite {GOLDEN.relative_to(ROOT)}")
    p.add_argument("--quantize-tool", action="store_true", help="also build llama-quantize (several minutes)")
    p.add_argument("--tools", action="store_true",
                   help="also build llama-quantize, llama-perplexity and llama-tokenize into build-tools/ (several minutes)")
    args = p.parse_args(argv)
    if args.tools:
        build_tools()
    build(("ggml-base", "llama-quantize") if args.quantize_tool else ("ggml-base",))
    ref = load()
    assert ref is not None
    print(f"reference: {lib_path()} (llama.cpp {commit()})")
    if args.record_golden:
        record_golden(ref)
        record_imatrix_golden(ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
