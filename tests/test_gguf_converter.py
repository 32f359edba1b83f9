"""llama.cpp's converter through qkit's bridge (``qkit.export.gguf.converter``) and the row map it measures.

The oracle is the converter itself: its F32 GGUF of each tiny model (``tests/helpers_archs.py``), read by
the ``gguf`` package. Applying the row map to the Hugging Face tensors must give every moved tensor of that
file bit for bit (``torch.equal``), for the twelve architectures of the GGUF-for-every-architecture issue;
the q/k permutation is also checked against qkit's own (``llama_names.row_permutation``, which its llama
writer uses), expert stacking and gpt-oss's transposed experts against hand-written indices. The static
list of architectures is checked against the converter's own registry, imported in a subprocess.

One session fixture builds the twelve models (most with a SentencePiece tokenizer trained in milliseconds,
so their embeddings are small; olmo2, gpt_oss and qwen3_moe with the default model's BPE tokenizer, which
their classes need, and tied embeddings, half the bytes) and converts them all in one subprocess, into a
temporary cache (the converter's tree copied from qkit's cache). The default model's own route (llama,
its BPE tokenizer) is measured by ``benchmarks/bench_converter.py``, which applies its row map too.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import helpers_archs
import numpy as np
import pytest
import torch

from qkit import assets
from qkit.errors import AssetError, ExportError
from qkit.export.gguf import converter
from qkit.export.gguf.reader import float32_tensors
from qkit.llama_names import row_permutation

BPE_ARCHS = {"olmo2", "gpt_oss", "qwen3_moe"}  # their classes read only a BPE tokenizer; the rest: spm_tokenizer
# the Hugging Face architecture name and the converter class of each (conversion/*.py)
CLASSES = {"llama": ("LlamaForCausalLM", "LlamaModel"), "mistral": ("MistralForCausalLM", "LlamaModel"),
           "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"), "qwen3": ("Qwen3ForCausalLM", "Qwen3Model"),
           "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeModel"), "mixtral": ("MixtralForCausalLM", "LlamaModel"),
           "gemma2": ("Gemma2ForCausalLM", "Gemma2Model"), "gemma3_text": ("Gemma3ForCausalLM", "Gemma3Model"),
           "phi3": ("Phi3ForCausalLM", "Phi3MiniModel"), "olmo2": ("Olmo2ForCausalLM", "Olmo2Model"),
           "granite": ("GraniteForCausalLM", "GraniteModel"), "gpt_oss": ("GptOssForCausalLM", "GptOssModel")}


@pytest.fixture(scope="session")
def converter_cache(tmp_path_factory) -> Path:
    """A temporary qkit cache holding a copy of the converter's verified tree (fetched into qkit's cache
    once), for what the converter writes; set as QKIT_CACHE only while a test (``in_converter_cache``) or
    the session's conversion runs, never for the rest of the session."""
    try:
        tree = converter.converter_root()
    except AssetError as exc:
        pytest.skip(f"llama.cpp's converter is not in qkit's cache and cannot be fetched: {exc}")
    cache = tmp_path_factory.mktemp("qkit-cache")
    shutil.copytree(tree, cache / tree.relative_to(assets.cache_dir()))
    return cache


@pytest.fixture
def in_converter_cache(converter_cache, monkeypatch) -> Path:
    monkeypatch.setenv("QKIT_CACHE", str(converter_cache))
    return converter_cache


@pytest.fixture(scope="session")
def arch_dirs(tmp_path_factory, default_model_dir):
    pytest.importorskip("sentencepiece", reason="the SentencePiece fixtures need the test extra's sentencepiece")
    root = tmp_path_factory.mktemp("archs")
    spm = helpers_archs.spm_tokenizer(root / "spm")
    return {a: helpers_archs.make_arch_model(root / a, a, default_model_dir if a in BPE_ARCHS else spm,
                                             tie=a in BPE_ARCHS) for a in helpers_archs.ARCHS}


@pytest.fixture(scope="session")
def converted(arch_dirs, converter_cache):
    """Every architecture converted (F32 GGUF and row map) by one subprocess."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QKIT_CACHE", str(converter_cache))
        done = converter.convert([arch_dirs[a] for a in helpers_archs.ARCHS])
    return dict(zip(helpers_archs.ARCHS, done))


def _gguf_tensors(path: Path) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(a.copy()) for n, a in float32_tensors(path).items()}


def _hf_tensors(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))


# --- the pinned tree ---------------------------------------------------------------------------------


def _sdist(tmp_path: Path, files: dict[str, bytes]) -> Path:
    archive = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for name, data in files.items():
            src = tmp_path / "src" / name
            src.parent.mkdir(parents=True, exist_ok=True)
            src.write_bytes(data)
            tf.add(src, arcname=name)
    return archive


def _tree(archive: Path, tree_sha256: str, members=("a.py", "pkg/")) -> assets.PinnedTree:
    return assets.PinnedTree(name="toy-tree", package="pkg", version="1.0", archive=archive.name,
                             archive_sha256=assets.sha256_file(archive), root="pkg-1.0/vendor/",
                             members=members, tree_sha256=tree_sha256)


def test_pinned_tree_extracts_the_members_checks_the_digest_and_drops_the_archive(tmp_path, monkeypatch):
    files = {"pkg-1.0/vendor/a.py": b"A", "pkg-1.0/vendor/pkg/b.py": b"B", "pkg-1.0/vendor/pkg/sub/c.txt": b"C",
             "pkg-1.0/vendor/other.py": b"not taken", "pkg-1.0/setup.py": b"not taken"}
    archive = _sdist(tmp_path, files)
    monkeypatch.setenv("QKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(assets, "_pip_download", lambda *_a: pytest.fail("the archive is in the cache: no download"))
    # the digest written out by hand: sha256 of "path<TAB>sha256(file)\n" lines, sorted by path
    sha = assets.hashlib.sha256
    lines = "".join(f"{p}\t{sha(d).hexdigest()}\n" for p, d in [("a.py", b"A"), ("pkg/b.py", b"B"), ("pkg/sub/c.txt", b"C")])
    expected = sha(lines.encode()).hexdigest()
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    shutil.copy(archive, downloads / archive.name)
    tree = assets.fetch(_tree(archive, expected))
    assert sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()) == ["a.py", "pkg/b.py", "pkg/sub/c.txt"]
    assert not (downloads / archive.name).exists()  # only the tree is kept
    (tree / "pkg" / "__pycache__").mkdir()  # what running its modules writes: not part of the tree
    (tree / "pkg" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"x")
    assert assets.fetch(_tree(archive, expected)) == tree  # offline: verified in place
    (tree / "a.py").write_bytes(b"changed")
    with pytest.raises(AssetError, match="tree digest"):
        assets.fetch(_tree(archive, expected))


def test_pinned_tree_refuses_a_wrong_digest_and_keeps_nothing(tmp_path, monkeypatch):
    archive = _sdist(tmp_path, {"pkg-1.0/vendor/a.py": b"A"})
    monkeypatch.setenv("QKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "downloads").mkdir(parents=True)
    shutil.copy(archive, tmp_path / "cache" / "downloads" / archive.name)
    with pytest.raises(AssetError, match="differ from the pinned tree") as err:
        assets.fetch(_tree(archive, "0" * 64))
    assert "\n" not in str(err.value)
    assert list((tmp_path / "cache" / "assets" / "toy-tree").iterdir()) == []


def test_converter_cannot_be_fetched_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("QKIT_CACHE", str(tmp_path / "cold"))
    monkeypatch.setattr(assets, "_pip_download", lambda *_a: (_ for _ in ()).throw(AssetError("pip could not download "
                        "llama-cpp-python==0.3.36 (offline); check the connection to the package index")))
    converter.known_architectures.cache_clear()
    try:
        with pytest.raises(AssetError, match="llama-cpp-python==0.3.36") as err:
            converter.check_model(tmp_path)
    finally:
        converter.known_architectures.cache_clear()
    assert "\n" not in str(err.value)


# --- refusals before any work --------------------------------------------------------------------------


def _config_dir(tmp_path: Path, config: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_known_architectures_are_read_statically(in_converter_cache):
    known = converter.known_architectures()
    assert len(known.text) == 267  # TEXT_MODEL_MAP's 269 names less the two no module registers as text
    for hf_name, cls in CLASSES.values():
        assert known.text[hf_name] == cls
    assert "SmolVLMForConditionalGeneration" in known.mmproj_only and "OPTForCausalLM" not in known.text
    assert "KimiK3ForConditionalGeneration" in known.top_level


@pytest.mark.slow
def test_known_architectures_equal_the_converters_own_registry(in_converter_cache):
    """The oracle: ``get_model_class(name)`` for every name of ``TEXT_MODEL_MAP``, in the converter's process."""
    code = ("import json\nfrom conversion import TEXT_MODEL_MAP, get_model_class\nout = {}\n"
            "for n in TEXT_MODEL_MAP:\n    try:\n        out[n] = get_model_class(n).__name__\n"
            "    except (KeyError, NotImplementedError):\n        pass\nprint(json.dumps(out))")
    env = converter.environment(in_converter_cache / "shim")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert converter.known_architectures().text == json.loads(done.stdout.splitlines()[-1])


def test_refuses_an_architecture_the_converter_does_not_know_instantly(tmp_path, in_converter_cache):
    model = _config_dir(tmp_path, {"architectures": ["OPTForCausalLM"], "model_type": "opt"})
    converter.known_architectures()
    t0 = time.perf_counter()
    with pytest.raises(ExportError, match="does not convert architecture 'OPTForCausalLM'") as err:
        converter.convert([model])
    assert time.perf_counter() - t0 < 1.0 and "\n" not in str(err.value)


def test_refuses_a_vision_only_class_and_follows_text_config(tmp_path, in_converter_cache):
    vlm = _config_dir(tmp_path / "vlm", {"architectures": ["SmolVLMForConditionalGeneration"]})
    with pytest.raises(ExportError, match="only as a vision/audio projector"):
        converter.check_model(vlm)
    # get_model_architecture: a text_config naming its architecture is what the converter converts
    inner = _config_dir(tmp_path / "inner", {"architectures": ["SmolVLMForConditionalGeneration"],
                                             "text_config": {"architectures": ["LlamaForCausalLM"]}})
    assert converter.check_model(inner) == "LlamaModel"
    internvl = _config_dir(tmp_path / "internvl", {"architectures": ["InternVLChatModel"],  # load_hparams: llm_config
                                                   "llm_config": {"architectures": ["Qwen2ForCausalLM"]}})
    assert converter.check_model(internvl) == "Qwen2Model"
    none = _config_dir(tmp_path / "none", {"model_type": "llama"})
    with pytest.raises(ExportError, match="names no architecture"):
        converter.check_model(none)


def test_refuses_a_sentencepiece_model_without_sentencepiece(tmp_path, in_converter_cache, monkeypatch):
    model = _config_dir(tmp_path, {"architectures": ["Gemma2ForCausalLM"]})
    (model / "tokenizer.model").write_bytes(b"spm")
    monkeypatch.setattr(converter, "sentencepiece_installed", lambda: False)
    with pytest.raises(ExportError, match="pip install sentencepiece"):
        converter.check_model(model)


def test_tokenizer_the_converter_cannot_convert_is_one_line_before_tensor_work(default_model_dir, in_converter_cache,
                                                                               tmp_path, monkeypatch):
    """qwen2 with the default model's BPE tokenizer: transformers loads it as Qwen2Tokenizer, whose
    pre-tokenizer the converter does not recognize. Run without sentencepiece (the shim's stub in its
    place): the converter's Qwen2 class imports it before it looks for tokenizer.model."""
    from safetensors.torch import save_file

    model = tmp_path / "qwen2-bpe"  # the config, the tokenizer, one small tensor: refused before any is read
    config = helpers_archs.arch_config("qwen2", helpers_archs.tokenizer_vocab(default_model_dir)[0])
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(model)
    helpers_archs.copy_tokenizer("qwen2", default_model_dir, model)
    save_file({"model.norm.weight": torch.ones(helpers_archs.HIDDEN)}, str(model / "model.safetensors"))
    monkeypatch.setattr(converter, "sentencepiece_installed", lambda: False)
    with pytest.raises(ExportError, match="BPE pre-tokenizer was not recognized") as err:
        converter.convert([model])
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)
    assert not (assets.cache_dir() / "converted" / f"f32-{converter._files_digest(model)[:32]}.gguf").exists()


# --- the F32 GGUF and the row map, per architecture ----------------------------------------------------


@pytest.mark.parametrize("arch", helpers_archs.ARCHS)
def test_row_map_rebuilds_the_converters_f32_tensors(arch, converted, arch_dirs):
    done = converted[arch]
    assert (done.record["architecture"], done.record["converter_class"]) == CLASSES[arch]
    got = _gguf_tensors(done.f32)
    rows = done.rows
    assert list(rows.gguf) == list(got)  # every tensor of the file, in its order
    hf = _hf_tensors(arch_dirs[arch])
    left_out = ["lm_head.weight"] if arch == "gemma2" else []  # llama.cpp's Gemma 2 reads token_embd as the output
    assert set(rows.hf) | set(left_out) == set(hf) and rows.dropped == left_out
    kinds: dict[str, set[str]] = {}
    for name, t in rows.gguf.items():
        kinds.setdefault(t.kind, set()).add(name)
        assert tuple(got[name].shape) == t.shape
        if t.kind in ("rows", "transposed"):
            assert torch.equal(rows.apply(hf, name), got[name]), name
        else:
            assert not torch.equal(got[name].flatten(), hf[t.source].flatten())  # changed: the map says so
    expected_other = set()
    if arch.startswith("gemma"):  # Gemma's norms are stored as weight + 1
        expected_other = {n for n in got if n.endswith("norm.weight")}
    if arch == "gpt_oss":  # the gate/up biases are split by alternate columns
        expected_other = {f"blk.{b}.ffn_{p}_exps.bias" for b in range(2) for p in ("gate", "up")}
    assert kinds.get("other", set()) == expected_other
    expected_transposed = {f"blk.{b}.ffn_{p}_exps.weight" for b in range(2) for p in ("gate", "up", "down")} \
        if arch == "gpt_oss" else set()
    assert kinds.get("transposed", set()) == expected_transposed


@pytest.mark.parametrize("arch", ["llama", "mistral", "mixtral", "granite"])
def test_llama_qk_permutation_is_qkits_own(arch, converted):
    """LlamaModel.permute: each head's rows (i, i + d/2) become neighbours; qkit's writer does the same."""
    rows = converted[arch].rows
    for proj, heads in (("q_proj", helpers_archs.HEADS), ("k_proj", helpers_archs.KV_HEADS)):
        (p,) = rows.placements(f"model.layers.1.self_attn.{proj}.weight")
        n = heads * helpers_archs.HEAD_DIM
        assert p.kind == "rows" and p.columns_kept and p.hf_experts is None
        assert np.array_equal(p.gguf_rows, np.arange(n))
        assert np.array_equal(p.hf_rows, row_permutation(n, heads).numpy())
    assert converted[arch].rows.placements("model.layers.0.self_attn.q_proj.weight")[0].hf_rows[:4].tolist() == [0, 32, 1, 33]


@pytest.mark.parametrize(("arch", "name", "gguf"), [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.{e}.w1.weight", "blk.1.ffn_gate_exps.weight"),
    ("qwen3_moe", "model.layers.1.mlp.experts.{e}.down_proj.weight", "blk.1.ffn_down_exps.weight")])
def test_experts_are_stacked_in_order(arch, name, gguf, converted):
    rows = converted[arch].rows
    for e in range(helpers_archs.EXPERTS):
        (p,) = rows.placements(name.format(e=e))
        n = rows.hf[name.format(e=e)][0]
        assert (p.gguf_name, p.gguf_shape[0], p.kind) == (gguf, helpers_archs.EXPERTS, "rows")
        assert np.array_equal(p.gguf_rows, e * n + np.arange(n)) and np.array_equal(p.hf_rows, np.arange(n))


def test_gpt_oss_experts_are_transposed_and_gate_up_split_by_alternate_columns(converted):
    rows = converted["gpt_oss"].rows
    placed = {p.gguf_name: p for p in rows.placements("model.layers.0.mlp.experts.gate_up_proj")}
    assert set(placed) == {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"}
    experts, hidden, two_inter = rows.hf["model.layers.0.mlp.experts.gate_up_proj"]
    for name, first in (("blk.0.ffn_gate_exps.weight", 0), ("blk.0.ffn_up_exps.weight", 1)):
        p = placed[name]
        assert p.kind == "transposed" and not p.columns_kept
        assert p.gguf_shape == (experts, two_inter // 2, hidden)
        assert np.array_equal(p.hf_rows, np.tile(np.arange(first, two_inter, 2), experts))  # HF columns
        assert np.array_equal(p.hf_experts, np.repeat(np.arange(experts), two_inter // 2))


def test_phi3_keeps_its_fused_tensors(converted):
    """llama.cpp's PHI3 graph reads the fused qkv and gate_up tensors: the converter does not split them."""
    rows = converted["phi3"].rows
    (qkv,) = rows.placements("model.layers.0.self_attn.qkv_proj.weight")
    (gate_up,) = rows.placements("model.layers.0.mlp.gate_up_proj.weight")
    assert (qkv.gguf_name, gate_up.gguf_name) == ("blk.0.attn_qkv.weight", "blk.0.ffn_up.weight")
    assert np.array_equal(qkv.hf_rows, np.arange(len(qkv.hf_rows)))


@pytest.mark.slow
def test_convert_f32_is_the_converters_own_file_and_is_cached(converted, arch_dirs, in_converter_cache, tmp_path,
                                                             monkeypatch):
    """The bytes of ``convert_hf_to_gguf.py MODEL --outtype f32``, run as its README says; a second call
    starts no process."""
    model = arch_dirs["qwen3"]
    out = tmp_path / "direct.gguf"
    cmd, env = converter.standalone(model, out, tmp_path)
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    monkeypatch.setattr(converter.processes, "run", lambda *_a, **_k: pytest.fail("cached: no process"))
    copy = converter.convert_f32(model, tmp_path / "copy.gguf")
    assert assets.sha256_file(copy) == assets.sha256_file(out) == assets.sha256_file(converted["qwen3"].f32)
    assert converter.row_map(model).gguf.keys() == converted["qwen3"].rows.gguf.keys()


def test_a_second_process_waits_for_the_first_and_reuses_its_files(converted, arch_dirs, converter_cache, tmp_path,
                                                                   monkeypatch):
    """The lock of a cache entry held (as by another qkit process converting the same model): ``convert``
    waits, then finds the holder's files and starts no process of its own."""
    import threading

    fresh = tmp_path / "cache"
    shutil.copytree(converter_cache / "assets", fresh / "assets")
    monkeypatch.setenv("QKIT_CACHE", str(fresh))
    model, done = arch_dirs["qwen3"], converted["qwen3"]
    key_f32, key_rows = converter._files_digest(model)[:32], converter._shapes_digest(model)[:32]
    (fresh / "converted").mkdir()
    held, released = threading.Event(), []

    def first():
        with assets.cache_lock(f"converted-{key_f32}", "converting"):
            held.set()
            time.sleep(0.5)
            shutil.copy(done.f32, fresh / "converted" / f"f32-{key_f32}.gguf")
            for suffix in (".npz", ".json"):  # where the session's conversion put the row map
                shutil.copy(converter_cache / "converted" / f"rows-{key_rows}{suffix}", fresh / "converted")
            released.append(time.perf_counter())

    thread = threading.Thread(target=first)
    thread.start()
    held.wait()
    monkeypatch.setattr(converter.processes, "run", lambda *_a, **_k: pytest.fail("the first one's files: no process"))
    (again,) = converter.convert([model])
    thread.join()
    assert time.perf_counter() >= released[0]
    assert assets.sha256_file(again.f32) == assets.sha256_file(done.f32)
    assert list(again.rows.gguf) == list(done.rows.gguf)
