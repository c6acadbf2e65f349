"""Where checkpoint bytes come from: one small interface, one class per storage scheme.

Everything above this module asks for *byte ranges of named files*, never whole files, so a
source on GCS or the Hugging Face hub streams exactly like a local directory and memory
stays bounded by what the caller asks for.
"""

from __future__ import annotations

import os
import threading
from typing import Protocol

from ckptconv.errors import BadInputError


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


class LocalSource:
    """A local checkpoint directory, read with ``pread`` on file descriptors kept open.

    ``pread`` into a fresh buffer (unlike ``mmap`` or ``safe_open``) leaves no file pages in
    the process's RSS, and keeping one descriptor per file avoids reopening per tensor.
    """

    def __init__(self, directory: str) -> None:
        self.uri = os.path.abspath(directory)
        if not os.path.isdir(self.uri):
            raise BadInputError(f"{directory}: source directory does not exist")
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _path(self, name: str) -> str:
        return os.path.join(self.uri, name)

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                try:
                    fd = os.open(self._path(name), os.O_RDONLY)
                except FileNotFoundError:
                    raise BadInputError(f"{self._path(name)}: file not found") from None
                self._fds[name] = fd
            return fd

    def exists(self, name: str) -> bool:
        return os.path.isfile(self._path(name))

    def size(self, name: str) -> int:
        return os.fstat(self._fd(name)).st_size

    def read_range(self, name: str, offset: int, length: int) -> bytearray:
        buffer = bytearray(length)
        view = memoryview(buffer)
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
        return buffer

    def list_names(self) -> list[str]:
        return sorted(os.listdir(self.uri))

    def provenance(self) -> dict:
        return {"uri": self.uri, "kind": "local"}

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def open_source(uri: str, *, hf_token_file: str | None = None) -> Source:
    """Open a source by URI: a local directory, ``gs://bucket/dir`` or ``hf://org/repo[@rev]``.

    ``hf_token_file`` names a file holding a hub token (else ``HF_TOKEN`` or a saved login).
    """
    for prefix, class_name in _SCHEMES.items():
        if uri.startswith(prefix):
            from ckptconv import remote_sources  # imported only when needed: it pulls in the cloud clients

            return getattr(remote_sources, class_name).open(uri, hf_token_file=hf_token_file)
    return LocalSource(uri)


# URI prefix -> class in ckptconv.remote_sources (by name, so importing this module stays cheap).
_SCHEMES: dict[str, str] = {"gs://": "GcsSource", "hf://": "HubSource"}
