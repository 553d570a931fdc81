"""RepackCache: what the engine builds from a GGUF file at load (the kernels' tiled blocks,
the int8 copies), kept on disk per model file and CPU, so a second start only maps it.

References: llama.cpp (weights used from the mmapped file as stored), the compiled kernels'
build cache (cpu_kernels.py `build_library`: a key of every input, written by rename).

An entry is a folder `<LLMQ_REPACK_DIR or ~/.cache/llmq/repacked>/<key>/`, the key a hash of
the model file (path, size, mtime, and a fingerprint of its content: the GGUF's header and a
few KiB of every tensor, gguf_reader.py `FastGGUFReader.fingerprint`, so a file replaced by
another of the same size and mtime is not taken for it), the CPU (the kernels' layout may
follow it) and the code that builds the forms (any change to those modules gives another key).
It holds one `.npy` per array and `manifest.json` (each array's byte size and a CRC of three
4 KiB samples of it, each form's shapes), written last. A cold load fills `<key>.tmp-<pid>/`
and renames it into place, so a worker starting beside it never sees half an entry; an entry
whose files do not match its manifest (truncated, missing, zeroed by a crash before the disk
had the data, a garbage array header) is deleted with one warning and rebuilt.
Arrays come back as copy-on-write memory maps (`np.load(mmap_mode="c")`): a warm start reads
only the pages a step touches, and the page cache is shared between workers of the same model
on one machine. A form a decode streams (`get(..., streamed=True)`) is read in first where it
is not cached, as 2 MiB folios (huge_pages.py `read_in` says why), so its maps take huge pages
after the page cache was evicted too; the check's samples are read without readahead, and
dropped again before, so that they leave no small folios in its way.

`LLMQ_REPACK_DIR=off` turns the cache off (forms are built in memory every start).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import mmap
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from . import huge_pages
from .cpu_kernels import _cpu_model

logger = logging.getLogger(__name__)

ENV = "LLMQ_REPACK_DIR"
MANIFEST = "manifest.json"
# The modules whose code decides the bytes of a cached form.
_CODE = ("block_quant.py", "int8_matrix.py", "cpu_kernels.py", "quant_matrix.py", "linear.py",
         "cached_forms.py", "gguf_loader.py", "gguf_reader.py", "repack_cache.py",
         "packed_weight.py")
_SAMPLE = 4096  # bytes of each of a file's three checked samples


def default_root() -> Path | None:
    """Where entries live, or None when the cache is turned off."""
    value = os.environ.get(ENV)
    if value is not None and value.strip().lower() in ("", "off", "0", "none"):
        return None
    return Path(value) if value else Path.home() / ".cache" / "llmq" / "repacked"


def _file_tag(model_path: Path) -> str:
    """The part of the key naming the file and CPU: entries of the file's older versions (or
    of older code) share it; another CPU's (a cache on shared storage) does not."""
    return hashlib.sha256(f"{model_path.resolve()}\0{_cpu_model()}".encode()).hexdigest()[:8]


def cache_key(model_path: Path, fingerprint: str = "") -> str:
    """Another file, another version of it (size, mtime, `fingerprint` of its content),
    another CPU or another build code: another key, `<file tag>-<hash of the rest>`."""
    stat = model_path.stat()
    digest = hashlib.sha256()
    for part in (str(model_path.resolve()), str(stat.st_size), str(stat.st_mtime_ns),
                 fingerprint, _cpu_model()):
        digest.update(part.encode() + b"\0")
    here = Path(__file__).parent
    for name in _CODE:
        digest.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return f"{_file_tag(model_path)}-{digest.hexdigest()[:16]}"


class RepackCache:
    """One model file's entry: `get` from a complete entry, else `put` then `commit`."""

    def __init__(self, root: Path, key: str) -> None:
        self.root, self.key = root, key
        self.path = root / key
        self._manifest: dict[str, Any] = {}  # form name -> {"meta": ..., "files": {part: bytes}}
        self._staging: Path | None = None
        self._new: dict[str, Any] = {}
        self.hits = 0
        self.warm = self._open()

    @classmethod
    def for_model(cls, model_path: Path, fingerprint: str = "") -> RepackCache | None:
        root = default_root()
        return None if root is None else cls(root, cache_key(model_path, fingerprint))

    def _open(self) -> bool:
        """Read a complete entry's manifest; delete an entry that does not match it."""
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            return False
        try:
            entries = json.loads(manifest.read_text())
            for name, entry in entries.items():
                for part, expected in entry["files"].items():
                    found = _file_check(self.path / f"{name}.{part}.npy")
                    if found != expected:
                        raise ValueError(f"{name}.{part}.npy is {found}, the manifest says "
                                         f"{expected}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("repack cache entry %s is damaged (%s): rebuilding it", self.path, exc)
            shutil.rmtree(self.path, ignore_errors=True)
            return False
        self._manifest = entries
        return True

    def get(self, name: str, streamed: bool = False
            ) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """(meta, arrays) of form `name`, mapped from disk, or None if the entry lacks it.
        `streamed`: a form every decode step reads whole, its files read in first as 2 MiB
        folios where they are not cached (huge_pages.py `read_in`)."""
        entry = self._manifest.get(name)
        if entry is None:
            return None
        try:
            paths = {part: self.path / f"{name}.{part}.npy" for part in entry["files"]}
            if streamed:  # before np.load, whose header read would read small folios in
                for path in paths.values():
                    _drop_samples(path)
                    huge_pages.read_in(path)
            arrays = {part: np.load(path, mmap_mode="c") for part, path in paths.items()}
        except (OSError, ValueError) as exc:
            logger.warning("repack cache %s: %s unreadable (%s)", self.path, name, exc)
            return None
        self.hits += 1
        return entry["meta"], arrays

    def put(self, name: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]
            ) -> dict[str, np.ndarray]:
        """Stage a form built this start (written under the staging folder, not yet visible).
        Returns its arrays mapped from the files written (the caller drops the copies it
        built, so a cold start ends with the RSS of a warm one), or `arrays` if not written."""
        if self.warm:
            return arrays  # the entry is complete already: a form it lacks is not cached
        try:
            if self._staging is None:
                self.root.mkdir(parents=True, exist_ok=True)
                self._staging = self.root / f"{self.key}.tmp-{os.getpid()}"
                shutil.rmtree(self._staging, ignore_errors=True)
                self._staging.mkdir()
            files = {}
            for part, array in arrays.items():
                target = self._staging / f"{name}.{part}.npy"
                _save(target, array)
                files[part] = _file_check(target)
            self._new[name] = {"meta": meta, "files": files}
            # NOTE: the maps stay valid when the folder is renamed (they hold the inodes)
            return {part: np.load(self._staging / f"{name}.{part}.npy", mmap_mode="c")
                    for part in files}
        except (OSError, ValueError) as exc:  # a full or read-only disk costs the cache only
            logger.warning("repack cache %s not written: %s", self.root, exc)
            self._abandon()
            return arrays

    def commit(self) -> None:
        """Make the staged entry visible: manifest last, then one rename of the folder."""
        if self._staging is None:
            return
        try:
            (self._staging / MANIFEST).write_text(json.dumps(self._new))
            if self.path.exists():  # another worker finished first: theirs is as good
                self._abandon()
                return
            os.replace(self._staging, self.path)
            logger.info("repack cache written: %s (%d forms)", self.path, len(self._new))
            self._drop_stale()
        except OSError as exc:
            logger.warning("repack cache %s not written: %s", self.root, exc)
            self._abandon()
        self._staging = None

    def _drop_stale(self) -> None:
        """Delete this file's entries for its older versions, CPUs or code: each is as big as
        the model's repacked forms, and nothing will ask for them again."""
        tag = self.key.split("-")[0]
        for other in self.root.glob(f"{tag}-*"):
            if other.name != self.key and ".tmp-" not in other.name:
                shutil.rmtree(other, ignore_errors=True)

    def _abandon(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
        self._staging = None
        self._new = {}
        self.warm = True  # stop staging further forms


def _file_check(path: Path) -> dict[str, Any]:
    """What the manifest records of an array file: its size and a CRC of 4 KiB at its start
    (the `.npy` header with it), middle and end. Cheap (three reads per file), and it catches
    what a crash or a full disk leaves: a file cut short, or one of the right size whose data
    never reached the disk (zeros)."""
    size = path.stat().st_size
    crc = 0
    with open(path, "rb", buffering=0) as f:
        # NOTE: no readahead: the samples' pages alone come in, and where the file was not
        # cached they are small folios, which `_drop_samples` drops again before a read-in
        _fadvise(f.fileno(), 0, 0, "POSIX_FADV_RANDOM")
        for offset in _sample_offsets(size):
            crc = zlib.crc32(os.pread(f.fileno(), _SAMPLE, offset), crc)
    return {"bytes": size, "crc": crc}


def _save(path: Path, array: np.ndarray) -> None:
    """`np.save`'s file, written in one call (header and data): the page cache then holds it
    in 2 MiB folios from its first byte, where np.save's two writes (the 128-byte header
    first) leave its first 2 MiB in small ones, which a map cannot take as a huge page."""
    array = np.ascontiguousarray(array)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    parts = [memoryview(header.getvalue()), array.reshape(-1).view(np.uint8).data]
    with open(path, "wb", buffering=0) as f:
        while parts:  # a write may take less than it was given
            written = os.writev(f.fileno(), parts)
            while parts and written >= len(parts[0]):
                written -= len(parts.pop(0))
            if parts:
                parts[0] = parts[0][written:]


def _sample_offsets(size: int) -> list[int]:
    return sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)})


def _drop_samples(path: Path) -> None:
    """Drop the pages `_file_check` read from the page cache where they are folios of their
    own (a 2 MiB folio holding one stays: the kernel drops only folios inside the range)."""
    page = mmap.PAGESIZE
    with open(path, "rb", buffering=0) as f:
        for offset in _sample_offsets(path.stat().st_size):
            start = offset // page * page
            _fadvise(f.fileno(), start, -(-(offset + _SAMPLE - start) // page) * page,
                     "POSIX_FADV_DONTNEED")


def _fadvise(fd: int, offset: int, length: int, advice: str) -> None:
    if hasattr(os, advice):  # Linux; elsewhere the reads stay as they are
        os.posix_fadvise(fd, offset, length, getattr(os, advice))
