"""What to convert and how, in the CLI's words: one value the tasks pass along."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ckptconv import settings


def slugify(text: str) -> str:
    """Lowercase letters, digits and single dashes: the only characters artifact keys allow."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "model"


@dataclass(frozen=True)
class Conversion:
    """One ``ckptconv convert SOURCE DESTINATION`` with its layout options."""

    source: str
    destination: str
    devices: int = settings.DEVICES
    scan_layers: bool | None = settings.SCAN_LAYERS  # None: the layout the model runs
    dtype: str = settings.DTYPE
    overwrite: bool = False
    name: str | None = None
    multimodal: bool = False  # also the vision/audio encoders (convert --multimodal)
    data_file_size: str = settings.DATA_FILE_SIZE  # convert --data-file-size: fewer reads for a host, more RAM here
    # convert --[no-]data-files-by-device: a host reads its own data files only, for a few seconds more conversion;
    # None: the CLI's choice by the output's size
    data_files_by_device: bool | None = settings.DATA_FILES_BY_DEVICE
    compression: str | None = settings.COMPRESSION  # convert --compression: zstd, lz4 or none; None: by the layout
    # after the conversion, restore it onto this worker's accelerator and check every leaf there (ckptconv
    # restore-check; a TPU pool's deployment and zoo entries set it)
    restore_check: bool = False
    restore_check_cpu_devices: int | None = None  # restore onto this many CPU devices instead (no accelerator: CI)

    @property
    def slug(self) -> str:
        """Stable key for this model's artifacts: ``name``, else the destination's last path part."""
        return slugify(self.name or self.destination.rstrip("/").rsplit("/", 1)[-1])

    def flow_parameters(self) -> dict:
        """The ``convert-model`` flow's parameters for this conversion (its signature's names)."""
        return dataclasses.asdict(self)

    def layout_args(self) -> list[str]:
        """The CLI flags shared by ``plan`` and ``convert``."""
        scan = [] if self.scan_layers is None else ["--scan-layers" if self.scan_layers else "--no-scan-layers"]
        files = [] if self.data_file_size == settings.DATA_FILE_SIZE else ["--data-file-size", self.data_file_size]
        if self.data_files_by_device is not None:
            files.append("--data-files-by-device" if self.data_files_by_device else "--no-data-files-by-device")
        return ["--devices", str(self.devices), *scan, "--dtype", self.dtype,
                *(["--multimodal"] if self.multimodal else []), *files]

    def convert_args(self, report_path: str) -> list[str]:
        """``convert`` arguments with machine-readable progress and the report written to ``report_path``."""
        extra = ["--overwrite"] if self.overwrite else []
        if self.compression is not None:
            extra += ["--compression", self.compression]
        return ["convert", self.source, self.destination, *self.layout_args(),
                "--progress", "jsonl", "--report", report_path, *extra]


@dataclass(frozen=True)
class Export:
    """One ``ckptconv export CHECKPOINT DESTINATION --like LIKE`` with its output options."""

    checkpoint: str
    destination: str
    like: str
    dtype: str = settings.DTYPE
    shard_size: str = settings.SHARD_SIZE
    overwrite: bool = False
    name: str | None = None

    @property
    def slug(self) -> str:
        """Stable key for this export's artifacts: ``name``, else the destination's last path part."""
        return slugify(self.name or self.destination.rstrip("/").rsplit("/", 1)[-1])

    def export_args(self, report_path: str) -> list[str]:
        """``export`` arguments with machine-readable progress and the report written to ``report_path``."""
        extra = ["--overwrite"] if self.overwrite else []
        return ["export", self.checkpoint, self.destination, "--like", self.like, "--dtype", self.dtype,
                "--shard-size", self.shard_size, "--progress", "jsonl", "--report", report_path, *extra]
