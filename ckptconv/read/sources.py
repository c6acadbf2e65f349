"""Where checkpoint bytes come from: one small interface, one class per storage scheme.

Everything above this module asks for *byte ranges of named files*, never whole files, so a
source on GCS or the Hugging Face hub streams exactly like a local directory and memory
stays bounded by what the caller asks for.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from typing import Callable, Protocol


from ckptconv.errors import BadInputError
from ckptconv.read.buffers import empty as reusable_empty


class Source(Protocol):
    """A read-only directory of checkpoint files addressed by name."""

    uri: str

    def exists(self, name: str) -> bool:
        """Whether file ``name`` exists in the source."""

    def size(self, name: str) -> int:
        """Size of file ``name`` in bytes."""

    def read_range(self, name: str, offset: int, length: int) -> bytes | bytearray | memoryview:
        """Exactly ``length`` bytes of ``name`` starting at ``offset``."""

    def list_names(self) -> list[str]:
        """Names of the files directly in the source directory."""

    def provenance(self) -> dict:
        """Where the bytes came from (URI, revision, generations) for the report."""


# Why a name from the checkpoint (an index's weight_map) may not be read: the first rule it breaks.
# A shard is a plain file directly in SRC, as every hub checkpoint has it; the remote sources
# list only those, so with these rules no scheme can be led outside SRC by a name.
SAMPLE_BYTES, CONTENT_SAMPLES = 64 * 1024, 16  # what a local source's fingerprint reads of each file
NAME_RULES: tuple[tuple[Callable[[str], bool], str], ...] = (
    (lambda name: not name, "is empty"),
    (lambda name: name.startswith(("/", "\\")), "is an absolute path"),
    (lambda name: ".." in name.replace("\\", "/").split("/"), "climbs out of the source with '..'"),
    (lambda name: "\\" in name, "holds a backslash"),
    (lambda name: "/" in name, "is not a plain file name (shards must lie directly in the source)"),
    (lambda name: name == ".", "names the source directory itself"),
    (lambda name: any(ord(c) < 32 or ord(c) == 127 for c in name), "holds a control character"),
)

# File types other than regular files, and what to call them: never opened blocking, never read.
NON_REGULAR: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)


def check_member_name(where: str, name: str) -> None:
    """Refuse a file name from the checkpoint that could lead outside the source directory."""
    for broken, reason in NAME_RULES:
        if broken(name):
            raise BadInputError(f"{where}: file name {name!r} {reason}; refused")


def check_regular(path: str, mode: int) -> None:
    """Refuse anything but a regular file: a FIFO would block the read, a device never end."""
    if not stat.S_ISREG(mode):
        kind = next((label for test, label in NON_REGULAR if test(mode)), "a special file")
        raise BadInputError(f"{path}: is {kind}, not a regular file; refused")


class LocalSource:
    """A local checkpoint directory, read with ``pread`` on file descriptors kept open.

    ``pread`` into a fresh buffer (unlike ``mmap`` or ``safe_open``) leaves no file pages in
    the process's RSS, and keeping one descriptor per file avoids reopening per tensor.
    Every file is checked before it is opened: a plain name, resolving (through symlinks)
    inside the source directory, a regular file; it is opened non-blocking and checked again
    on the descriptor, so a FIFO or a file swapped in between cannot hang or escape.
    """

    def __init__(self, directory: str) -> None:
        self.uri = os.path.abspath(directory)
        if not os.path.isdir(self.uri):
            raise BadInputError(f"{directory}: source directory does not exist")
        self._roots = _allowed_roots(self.uri)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._provenance: dict | None = None

    def _path(self, name: str) -> str:
        check_member_name(self.uri, name)
        return os.path.join(self.uri, name)

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._open(self._path(name))
                self._fds[name] = fd
            return fd

    def _open(self, path: str) -> int:
        real = os.path.realpath(path)
        if not any(os.path.commonpath([root, real]) == root for root in self._roots):
            raise BadInputError(f"{path}: resolves to {real}, outside the source directory; refused")
        try:
            before = os.stat(real)
            check_regular(path, before.st_mode)
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise BadInputError(f"{path}: file not found") from None
        except PermissionError:
            raise BadInputError(f"{path}: permission denied") from None
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(after.st_mode):
            os.close(fd)
            raise BadInputError(f"{path}: changed while being opened; refused")
        return fd

    def exists(self, name: str) -> bool:
        """Whether anything is there (a FIFO or a directory too: opening it then says what it is)."""
        return os.path.lexists(self._path(name))

    def size(self, name: str) -> int:
        return os.fstat(self._fd(name)).st_size

    def read_range(self, name: str, offset: int, length: int) -> memoryview:
        # not bytearray(length), which zeroes every byte before the read overwrites it (16 MiB: 7 ms of CPU); within
        # a stream, a buffer the last units were read into (reusable_empty: no fresh pages to fault in and zero)
        view = memoryview(reusable_empty(length))
        fd = self._fd(name)
        done = 0
        while done < length:
            count = os.preadv(fd, [view[done:]], offset + done)
            if count == 0:
                raise BadInputError(
                    f"{self._path(name)}: file ends at byte {offset + done}, "
                    f"expected {length} bytes from offset {offset} (truncated?)"
                )
            done += count
        return view

    def list_names(self) -> list[str]:
        return sorted(os.listdir(self.uri))

    def provenance(self) -> dict:
        """Per checkpoint file: size, mtime and a hash of sampled content, so a source whose bytes
        changed is not "already converted" (a change that keeps the mtime and misses every sample
        goes unseen here; ``verify`` compares every byte). Taken once: the fingerprint and the
        report both ask, and the report must describe what the fingerprint saw."""
        if self._provenance is not None:
            return self._provenance
        files = {}
        for name in self.list_names():
            if name == "config.json" or name.endswith((".safetensors", ".safetensors.index.json")):
                info = os.stat(self._path(name))
                files[name] = {"size": info.st_size, "mtime_ns": info.st_mtime_ns,
                               "sample_sha256": self._sample_hash(name, info.st_size)}
        self._provenance = {"uri": self.uri, "kind": "local", "files": files}
        return self._provenance

    def _sample_hash(self, name: str, size: int) -> str:
        """SHA-256 of ``CONTENT_SAMPLES`` evenly spaced 64 KiB pieces (all of a small file): ~1 MiB per file."""
        digest = hashlib.sha256(str(size).encode())
        span = max(size - SAMPLE_BYTES, 0)
        fd = self._fd(name)  # read apart from read_range: these bytes are the fingerprint's, not the conversion's
        for offset in sorted({k * span // (CONTENT_SAMPLES - 1) for k in range(CONTENT_SAMPLES)}):
            digest.update(os.pread(fd, min(SAMPLE_BYTES, size - offset), offset))
        return digest.hexdigest()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _allowed_roots(directory: str) -> tuple[str, ...]:
    """Where files of ``directory`` may resolve to: inside it, and for a Hugging Face cache
    snapshot (``models--ORG--NAME/snapshots/REV``, whose files link to ``../../blobs/``) the
    blobs of that same repository."""
    real = os.path.realpath(directory)
    roots = [real]
    parent, repo = os.path.dirname(real), os.path.dirname(os.path.dirname(real))
    if os.path.basename(parent) == "snapshots" and os.path.basename(repo).startswith("models--"):
        roots.append(os.path.join(repo, "blobs"))
    return tuple(roots)
