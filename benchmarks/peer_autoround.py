"""auto-round's GGUF files of the default model, as peers for ``bench_gguf_peers.py --peers DIR``.

auto-round is never a qkit dependency: this script runs with the Python of a separate virtual environment
that has it (and qkit's venv only for ``--dump-calibration``, the one mode that imports qkit):

    python3 -m venv /tmp/ar-venv
    /tmp/ar-venv/bin/pip install auto-round==0.16.1 torch==2.13.0 gguf==0.19.0 sentencepiece
    # torch 2.13.0 is the CPU build here; auto-round's GGUF export imports gguf, and its llama vocab
    # step imports sentencepiece before falling back to tokenizer.json (without it the export fails
    # after the whole quantization, "No module named 'sentencepiece'")

    # 1. qkit's calibration windows, as int64 ids (qkit's venv):
    /work/venv/bin/python benchmarks/peer_autoround.py --dump-calibration /tmp/peers/calib-32x512.json
    # 2. one auto-round file per run (auto-round's venv), MODEL = qkit.models.resolve(None).directory:
    /tmp/ar-venv/bin/python benchmarks/peer_autoround.py --model MODEL --calibration /tmp/peers/calib-32x512.json \\
        --format gguf:q4_k_m --iters 0 --out /tmp/peers/autoround/q4_k_m-iters0

Calibration. auto-round is given exactly the windows qkit's GPTQ uses by default
(``qkit.methods.calibration.calibration_ids`` with ``CalibrationOptions()``: 32 non-overlapping windows of
512 tokens of the pinned calibration text, KJV Genesis+Exodus, chosen with seed 0). Those windows never
contain the evaluation text (Ruth): qkit refuses a calibration text that shares a run of words with it.
They are passed to auto-round as its ``dataset``, a list of ``[1, 512]`` int64 token-id tensors (its
``calib`` feeds a tensor item straight to the model), with ``nsamples=32, seqlen=512``; auto-round's own
default dataset (pile-10k, from the hub) is never read. The dump records qkit's provenance (the text's
sha256 and the ids' sha256), and this script checks the ids against it before quantizing.

Runs. ``iters=0`` is auto-round's RTN path, which for the K-quant GGUF types is its "optimized RTN" with an
importance matrix from the calibration windows; ``iters>0`` is SignRound (auto-round's default is 200;
fewer on a small shared CPU machine, recorded). Everything else is auto-round's default (batch size 8,
learning rate, seed 42, ``amp``: on a CPU that prefers bf16 it casts the fp32 model to bf16 before
quantizing, and its export reads the weights as bf16). On this model (hidden size 576, not a multiple
of 256) every tensor whose rows are 576 long falls back from its K-quant (auto-round's
``gguf_type_fallback``: Q2_K..Q5_K -> Q5_0, Q6_K -> Q8_0; llama.cpp's own fallback for Q2_K/Q3_K is
IQ4_NL), in q2_k_s as in q4_k_m; only ffn_down (rows of 1536) keeps a K-quant. The token embedding is
written as Q8_0 (tied to the output), not f32.

Output. The ``.gguf`` goes to ``OUT/<name>.gguf`` (name = OUT's folder name) with a JSON record next to
it: the exact command, auto-round's version, iters, nsamples, seqlen, seconds (wall time on a possibly
shared machine: an upper bound), format and the calibration's provenance. The first peer files were made
on 2 shared CPU cores with ``--iters 0`` and ``--iters 10``: iters 50 measured about 82 s a decoder block
there (30 blocks, about 41 minutes a file), iters 10 about 18 to 22 s a block (about 12 minutes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path


def dump_calibration(path: Path, model: str | None, samples: int, seqlen: int) -> None:
    """qkit's calibration windows of the model's tokenizer (``samples`` x ``seqlen``; qkit's default
    ``CalibrationOptions()`` is 32 x 512) -> JSON (qkit's venv only)."""
    from qkit.methods.calibration import CalibrationOptions, calibration_ids
    from qkit.models import resolve
    from qkit.models.loading import load_tokenizer

    directory = Path(model) if model else resolve(None).directory
    ids, provenance = calibration_ids(load_tokenizer(directory), CalibrationOptions(samples=samples, seqlen=seqlen))
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"model": str(directory), "provenance": provenance, "shape": list(ids.shape), "ids": ids.tolist()}
    path.write_text(json.dumps(record) + "\n")
    print(f"{path}: {tuple(ids.shape)} ids, sha256 {provenance['ids_sha256']} ({provenance['name']}, "
          f"disjoint from {provenance['disjoint_from']['name']})")


def load_calibration(path: Path, nsamples: int, seqlen: int):
    """The dumped windows as a list of ``[1, seqlen]`` LongTensors, checked against their recorded sha256."""
    import numpy as np
    import torch

    record = json.loads(path.read_text())
    ids = np.asarray(record["ids"], dtype="<i8")
    digest = hashlib.sha256(ids.tobytes()).hexdigest()
    if digest != record["provenance"]["ids_sha256"]:
        sys.exit(f"{path}: ids sha256 {digest} is not the recorded {record['provenance']['ids_sha256']}")
    if ids.shape != (nsamples, seqlen):
        sys.exit(f"{path}: ids are {ids.shape}, --nsamples {nsamples} x --seqlen {seqlen} asked")
    t = torch.from_numpy(ids.copy())
    return [t[i : i + 1].clone() for i in range(t.shape[0])], record["provenance"]


def run_autoround(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import auto_round
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out.resolve()
    name = out.name
    work = out / "_autoround"
    if work.exists():
        shutil.rmtree(work)
    out.mkdir(parents=True, exist_ok=True)
    dataset, provenance = load_calibration(args.calibration, args.nsamples, args.seqlen)
    command = shlex.join([sys.executable] + sys.argv)

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    ar = AutoRound(model, tokenizer=tokenizer, scheme=args.format, dataset=dataset, iters=args.iters,
                   nsamples=args.nsamples, seqlen=args.seqlen, device_map="cpu")
    ar.quantize_and_save(output_dir=str(work), format=args.format)
    seconds = time.perf_counter() - start

    written = sorted(work.glob("**/*.gguf"))
    if len(written) != 1:
        sys.exit(f"auto-round wrote {len(written)} .gguf files under {work}: {[str(p) for p in written]}")
    gguf_path = out / f"{name}.gguf"
    shutil.move(str(written[0]), gguf_path)
    shutil.rmtree(work)
    record = {
        "command": command,
        "auto_round": auto_round.__version__,
        "torch": torch.__version__,
        "iters": args.iters,
        "nsamples": args.nsamples,
        "seqlen": args.seqlen,
        "seconds": round(seconds, 1),
        "format": args.format,
        "model": str(args.model),
        "bytes": gguf_path.stat().st_size,
        "calibration": {"path": str(args.calibration), **provenance},
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{gguf_path}: {record['bytes']:,} bytes in {seconds:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump-calibration", type=Path, metavar="JSON",
                    help="write qkit's default calibration windows to JSON and exit (run with qkit's Python)")
    ap.add_argument("--model", type=Path, help="the fp32 HF directory (qkit.models.resolve(None).directory)")
    ap.add_argument("--calibration", type=Path, help="the JSON written by --dump-calibration")
    ap.add_argument("--format", default="gguf:q4_k_m", help="auto-round's scheme and format, e.g. gguf:q2_k_s")
    ap.add_argument("--iters", type=int, default=200, help="0: auto-round's RTN; >0: SignRound steps (its default 200)")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, help="output folder; the file is OUT/<OUT's name>.gguf, its record .json")
    args = ap.parse_args()
    if args.dump_calibration:
        dump_calibration(args.dump_calibration, str(args.model) if args.model else None, args.nsamples, args.seqlen)
        return
    if not (args.model and args.calibration and args.out):
        ap.error("--model, --calibration and --out are needed (or --dump-calibration)")
    run_autoround(args)


if __name__ == "__main__":
    main()
