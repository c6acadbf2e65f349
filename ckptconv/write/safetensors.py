"""Safetensors files written as a stream: the header first, then each tensor's bytes appended.

The reference writer (``safetensors.numpy.save_file``) takes a dict of whole arrays and builds
the file in memory; an exported 70B model would need its shard in RAM. Here a file's layout
(names, dtypes, shapes, offsets) is fixed up front from the export plan, so the header can be
written before any weight exists, and tensors then arrive in that order, in pieces of any size
(bands of rows), each piece written and let go. A file is written under a ``.partial`` name and
renamed when its last byte is in, so a finished file is always whole. On ``gs://`` the file is a
resumable upload (gcsfs sends it in blocks): the object exists only once its last byte is in.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass

import numpy as np
from etils import epath

from ckptconv import dtypes
from ckptconv.plan.export import TensorEntry
from ckptconv.write.destination import PARTIAL

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class FileLayout:
    """One safetensors file: its name and tensors in the order their bytes are written."""

    name: str
    tensors: tuple[TensorEntry, ...]

    def header(self, metadata: dict[str, str] | None = None) -> bytes:
        """The 8-byte length and the JSON header, padded to 8 bytes (as the reference writer does)."""
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for entry in self.tensors:
            header[entry.name] = {"dtype": dtypes.NAMES[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [offset, offset + entry.nbytes]}
            offset += entry.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text

    @property
    def data_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.tensors)

    @property
    def file_bytes(self) -> int:
        return len(self.header()) + self.data_bytes


def shard_layouts(tensors: list[TensorEntry], max_bytes: int) -> tuple[FileLayout, ...]:
    """Cut ``tensors`` (in writing order) into files of at most ``max_bytes`` of data each, as
    ``save_pretrained`` does: a tensor larger than the limit gets a file of its own."""
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in tensors:
        if groups[-1] and size + entry.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    count = len(groups)
    return tuple(FileLayout(f"model-{i + 1:05d}-of-{count:05d}.safetensors", tuple(group))
                 for i, group in enumerate(groups))


def index_json(layouts: tuple[FileLayout, ...]) -> str:
    """``model.safetensors.index.json``: every tensor's file, and the total size."""
    weight_map = {entry.name: layout.name for layout in layouts for entry in layout.tensors}
    total = sum(layout.data_bytes for layout in layouts)
    return json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                      indent=2) + "\n"


class StreamedFile:
    """Writes one :class:`FileLayout` in order; checks every tensor gets exactly its bytes.

    ``append(name, data)``: the next bytes of tensor ``name`` (row-major order); tensors must
    come in layout order. ``close()`` checks the file is complete, fsyncs it and renames it
    from ``<name>.partial`` to ``<name>``.
    """

    def __init__(self, directory: str, layout: FileLayout) -> None:
        self.layout, self.path = layout, os.path.join(directory, layout.name)
        self._remote = "://" in directory
        self._file = epath.Path(self.path).open("wb") if self._remote else open(self.path + PARTIAL, "wb")
        self._file.write(layout.header())
        self._index, self._done = 0, 0  # tensor being written, its bytes written so far

    def append(self, name: str, data: np.ndarray) -> None:
        while self._index < len(self.layout.tensors) and self._done == self.layout.tensors[self._index].nbytes:
            self._index, self._done = self._index + 1, 0
        if self._index == len(self.layout.tensors):
            raise ValueError(f"{self.layout.name}: tensor {name!r} after the file's last tensor")
        entry = self.layout.tensors[self._index]
        if name != entry.name or data.dtype != entry.dtype:
            raise ValueError(f"{self.layout.name}: got {name!r} ({data.dtype}), expected {entry.name!r} ({entry.dtype})")
        if self._done + data.nbytes > entry.nbytes:
            raise ValueError(f"{self.layout.name}: tensor {name!r} gets more than its {entry.nbytes} bytes")
        self._file.write(np.ascontiguousarray(data).view(np.uint8).data)
        self._done += data.nbytes

    @property
    def complete(self) -> bool:
        """Every tensor has all its bytes (tensors after the current one are empty, if any)."""
        rest = self.layout.tensors[self._index + 1:]
        current = self.layout.tensors[self._index].nbytes if self._index < len(self.layout.tensors) else 0
        return self._done == current and all(entry.nbytes == 0 for entry in rest)

    def close(self) -> None:
        if not self.complete:
            raise ValueError(f"{self.layout.name}: closed before its last tensor was complete")
        if self._remote:
            self._file.close()  # the upload's last block: the object appears, whole
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.path + PARTIAL, self.path)

    def abandon(self) -> None:
        """Close without renaming (an error upstream): the ``.partial`` file stays as a leftover; an
        upload is cancelled, so no object appears (best effort: the error upstream is what to report,
        and an upload session left open expires by itself)."""
        if not self._remote:
            self._file.close()
            return
        with contextlib.suppress(Exception):
            getattr(self._file, "discard", self._file.close)()


def finished(directory: str, layout: FileLayout) -> bool:
    """Whether ``layout``'s file is in ``directory`` under its final name with its exact size and header."""
    path = epath.Path(os.path.join(directory, layout.name))
    try:
        if path.stat().length != layout.file_bytes:
            return False
        header = layout.header()
        with path.open("rb") as f:
            return f.read(len(header)) == header
    except (OSError, ValueError):
        return False
