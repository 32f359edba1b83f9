# qkit recipes. `just --list` shows them.

set shell := ["bash", "-euo", "pipefail", "-c"]

# Install qkit with its test and dev tools into the current environment.
setup:
    pip install -e ".[dev]"

# The test suite (the same command as the README quickstart and CI).
test:
    python -m pytest

# Benchmarks: medians and ratios against a peer measured in the same run. Never part of the tests.
bench:
    python benchmarks/bench_quantize.py
    python benchmarks/bench_eval.py
    python benchmarks/bench_inspect.py
    python benchmarks/bench_streaming.py
    python benchmarks/bench_ggml.py
    python benchmarks/bench_fp4.py
    python benchmarks/bench_simulate.py

# Calibrated methods against llm-compressor (slow: minutes per method; the peer is optional).
bench-calibrated:
    python benchmarks/bench_calibrated.py

# The main job on the default model, then a checkpoint and the error breakdown.
demo:
    qkit eval
    qkit quantize --scheme nf4 -o out/smollm2-nf4 --force
    qkit inspect errors

# llama.cpp's own binaries against qkit's GGUF export (builds llama-quantize/llama-perplexity once, ~8 min).
bench-llama-cpp:
    python benchmarks/build_llama_ref.py --tools
    python benchmarks/bench_llama_cpp.py
