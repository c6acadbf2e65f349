"""One conversion split over N workers: which jobs each partition writes, where its share waits,
and how the finalize proves every share whole before it commits (the destination protocol's staging
and proof for partitions, :mod:`ckptconv.write.destination`).

Partition ``i`` of ``N`` writes the leaves of its share of the plan's jobs into
``DST/ckptconv-partitions/ocdbt.process_partition<i>`` (as host ``i`` of a multi-host Orbax save
writes its ``ocdbt.process_<i>``) and then a marker ``partition<i>of<N>.json`` holding the plan's
fingerprint. ``--finalize N`` checks that all N markers carry the current fingerprint, links the
partitions' files into the step being saved, writes Orbax's metadata, merges the OCDBT
manifests as Orbax does and commits once (:func:`ckptconv.write.orbax.write_checkpoint`), and removes the staging directory. Until then nothing at DST reads as
complete; a crashed partition is rerun alone (finished ones see their marker and skip).

Jobs are split by output bytes (largest first, each to the least loaded partition), so every
partition reads each of its source tensors once and the shares are within one job of equal.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from etils import epath

from ckptconv.errors import BadInputError, UnfinishedError, stop_if_terminated
from ckptconv.plan.conversion import ConversionPlan
from ckptconv.write.destination import STAGING, write_report

READ_BYTES = 16 * 2**20  # checksums read files in pieces of this size (bounded memory)


@dataclass(frozen=True)
class Partition:
    """Partition ``index`` (0-based) of ``count``."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> "Partition":
        """``I/N`` with ``0 <= I < N``."""
        match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
        if not match or not 0 <= int(match[1]) < int(match[2]):
            raise BadInputError(f"--partition {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
        return cls(int(match[1]), int(match[2]))

    @property
    def process_id(self) -> str:
        """The ``ocdbt.process_<id>`` name (Orbax allows letters and digits only)."""
        return f"partition{self.index}"

    @property
    def marker_name(self) -> str:
        return f"partition{self.index}of{self.count}.json"

    @property
    def lock_name(self) -> str:
        """One writer per partition directory (``I/N`` and ``I/M`` write the same one)."""
        return f"partition{self.index}.lock"


def assign(plan: ConversionPlan, count: int) -> tuple[int, ...]:
    """The partition of every job: largest jobs first, each to the partition with the fewest bytes."""
    sizes = [sum(leaf.nbytes for leaf in job.leaves) for job in plan.jobs]
    loads = [0] * count
    owner = [0] * len(sizes)
    for job in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        target = min(range(count), key=lambda p: (loads[p], p))
        owner[job] = target
        loads[target] += sizes[job]
    return tuple(owner)


def staging_dir(destination: str) -> epath.Path:
    """Where the partitions meet: a directory every worker shares (local disk, a shared filesystem or
    the destination's bucket on gs://)."""
    return epath.Path(destination) / STAGING["partitions"]


def _gcs_objects(directory: epath.Path):
    """The bucket, the directory's object prefix (ending in ``/``) and the objects under it, with the
    sizes and crc32c the bucket lists for them."""
    from ckptconv.read.gcs import gcs_client

    uri = str(directory).rstrip("/")
    bucket, _, prefix = uri[len("gs://"):].partition("/")
    client = gcs_client(uri)
    return client.bucket(bucket), f"{prefix}/", list(client.list_blobs(bucket, prefix=f"{prefix}/"))


def read_marker(destination: str, partition: Partition) -> dict | None:
    """The partition's marker, None if absent or not a JSON object (damaged: the partition is redone)."""
    try:
        record = json.loads((staging_dir(destination) / partition.marker_name).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def data_dir(destination: str, partition: Partition) -> epath.Path:
    return staging_dir(destination) / f"ocdbt.process_{partition.process_id}"


def file_sums(directory: epath.Path) -> dict[str, list]:
    """``{relative path: [size, checksum]}`` of every file under ``directory``: what a marker vouches for.

    Locally the checksum is a crc32 of the bytes, read in bounded pieces; on gs:// it is the crc32c
    the bucket computed when the object was written (listing it reads no data, so a finalize of a
    terabyte checkpoint does not download it to prove it)."""
    if str(directory).startswith("gs://"):
        _, prefix, blobs = _gcs_objects(directory)
        return {blob.name[len(prefix):]: [int(blob.size), blob.crc32c] for blob in blobs}
    sums = {}
    for root, _, files in os.walk(str(directory)):
        for name in files:
            path = Path(root) / name
            crc, size = 0, 0
            with open(path, "rb") as f:
                while piece := f.read(READ_BYTES):
                    stop_if_terminated()  # a finalize reads every staged byte: a signal need not wait
                    crc, size = zlib.crc32(piece, crc), size + len(piece)
            sums[path.relative_to(str(directory)).as_posix()] = [size, crc]
    return sums


def damaged_files(destination: str, partition: Partition, record: dict) -> list[str]:
    """The staged files of ``partition`` that are not as its marker recorded (missing, resized,
    other bytes), by path; a marker without a record of its files vouches for nothing."""
    recorded = record.get("files")
    directory = data_dir(destination, partition)
    if not isinstance(recorded, dict) or not recorded:
        return [f"{directory} (its marker records no files)"]
    found = file_sums(directory)
    problems = []
    for name, want in sorted(recorded.items()):
        got = found.get(name)
        if got is None:
            problems.append(f"{directory / name} missing")
        elif got[0] != want[0]:
            problems.append(f"{directory / name} has {got[0]} bytes, {want[0]} written")
        elif got[1] != want[1]:
            problems.append(f"{directory / name} changed since it was written (checksum)")
    return problems


def write_marker(destination: str, partition: Partition, record: dict) -> None:
    """Written last, atomically: a marker means the partition's data is all on disk."""
    write_report(str(staging_dir(destination) / partition.marker_name), record)


def reset(destination: str, partition: Partition) -> None:
    """Forget this partition's earlier, unfinished or stale attempt (its marker first)."""
    (staging_dir(destination) / partition.marker_name).unlink(missing_ok=True)
    _remove_tree(data_dir(destination, partition))


def finished(destination: str, count: int, fingerprint: str) -> list[dict]:
    """The N partitions' markers, all for this plan; else an error naming the missing or stale ones."""
    if count < 1:
        raise BadInputError(f"--finalize {count}: the number of partitions must be >= 1")
    records, missing = [], []
    for index in range(count):
        record = read_marker(destination, Partition(index, count))
        if record is None or record.get("fingerprint") != fingerprint:
            missing.append(f"{index}/{count}" + ("" if record is None else " (written for another source or layout)"))
        else:
            records.append(record)
    if missing:
        raise UnfinishedError(f"{destination}: cannot finalize: partition(s) {', '.join(missing)} not finished; "
                            f"run `ckptconv convert SRC DST --partition I/{count}` for each")
    # a marker says the data was whole when written; only the data itself says it still is
    for index, record in enumerate(records):
        problems = damaged_files(destination, Partition(index, count), record)
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise UnfinishedError(f"{destination}: cannot finalize: partition {index}/{count}'s staged data is not as "
                                f"written: {shown}; rerun `ckptconv convert SRC DST --partition {index}/{count}`")
    return records


def link_partitions(destination: str, count: int):
    """``adopt`` for the writer: put each partition's files into the step's items directory, locally as
    hard links (no copy), on gs:// as copies made by the bucket itself (no byte passes through this
    host). The staging copy stays whole until the commit, so a crashed finalize loses nothing."""
    def adopt(items_dir) -> None:
        for index in range(count):
            name = f"ocdbt.process_{Partition(index, count).process_id}"
            source = staging_dir(destination) / name
            if str(source).startswith("gs://"):
                _copy_in_bucket(source, epath.Path(str(items_dir)) / name)
                continue
            for root, _, files in os.walk(str(source)):
                target = Path(str(items_dir)) / name / Path(root).relative_to(str(source))
                target.mkdir(parents=True, exist_ok=True)
                for file in files:
                    os.link(Path(root) / file, target / file)
    return adopt


def _copy_in_bucket(source: epath.Path, target: epath.Path) -> None:
    bucket, source_prefix, blobs = _gcs_objects(source)
    target_prefix = str(target).rstrip("/")[len(f"gs://{bucket.name}/"):] + "/"
    for blob in blobs:
        stop_if_terminated()
        bucket.copy_blob(blob, bucket, target_prefix + blob.name[len(source_prefix):])


def _remove_tree(directory: epath.Path) -> None:
    if directory.exists():
        directory.rmtree()


def remove_staging(destination: str) -> None:
    _remove_tree(staging_dir(destination))
