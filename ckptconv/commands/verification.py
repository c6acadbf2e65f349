"""``verify``: every stored leaf equals the transform of its source tensors, bit for bit.

The expected values come from the same plan and producer the conversion used, but the
stored values are read back independently from the checkpoint files, tile by tile, so the
check costs about one read unit of memory. So that a mistake of the header reader cannot
agree with itself, the source's byte layout is re-derived here from the raw headers, with
plain ``json`` and none of the reader's code: every tensor's offset must be the one the plan
read from, and the tensors must tile each file's data exactly. Layout options (scan, dtype) are read from the
checkpoint itself, so ``verify SRC DST`` needs no flags.
"""

from __future__ import annotations

import collections
import itertools
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ckptconv import dtypes, layout, settings
from ckptconv.monitor import StageTimer, peak_rss_bytes
from ckptconv.plan.conversion import MAXTEXT_EXTRA_ITEMS, make_plan
from ckptconv.progress import Progress
from ckptconv.read import open_source
from ckptconv.read.safetensors_io import TensorInfo
from ckptconv.read.sources import Source
from ckptconv.read.stored import open_leaf, read_ahead, read_metadata
from ckptconv.write.produce import produce_tiles

# Leaves MaxText's converter writes besides the params (an empty dict holds no leaf).
EXTRA_LEAVES = {(key,) for key, value in MAXTEXT_EXTRA_ITEMS.items() if value != {}}


@dataclass
class VerifyResult:
    leaves_checked: int = 0
    tensors_checked: int = 0
    bytes_checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0
    workers: int = 1  # source read units read and transformed at once (settings.RunOptions.workers)
    why: str = ""  # why that many (estimate.choose_workers)
    peak_rss_bytes: int = 0  # this process's peak when the comparison ended
    predicted_peak_rss_bytes: int = 0  # convert's prediction for the same plan and workers: verify's upper bound

    @property
    def ok(self) -> bool:
        return not self.mismatches and self.leaves_checked > 0

    def summary(self) -> str:
        verdict = "OK" if self.ok else f"FAILED ({len(self.mismatches)} mismatches)"
        return (f"verify: {verdict}: {self.leaves_checked} leaves, {self.tensors_checked} tensors, "
                f"{self.bytes_checked / 2**20:.1f} MiB compared bit for bit in {self.seconds:.1f} s")

    def to_json(self) -> dict:
        return {"ok": self.ok, "leaves": self.leaves_checked, "tensors": self.tensors_checked,
                "bytes": self.bytes_checked, "mismatches": self.mismatches, "seconds": round(self.seconds, 3),
                "workers": self.workers, "workers_why": self.why, "peak_rss_bytes": self.peak_rss_bytes,
                "predicted_peak_rss_bytes": self.predicted_peak_rss_bytes}


def verify(source_uri: str, dst: str, *, hf_token_file: str | None = None, progress: str = "none",
           options: settings.RunOptions | None = None) -> VerifyResult:
    """Compare every leaf of ``dst`` with the transform of ``source_uri``; ``progress`` as ``convert``'s
    (``bar``, ``jsonl`` or ``none``, on stderr), counting the bytes compared.

    The expected tiles come from the conversion's own producer (:func:`ckptconv.write.produce.produce_tiles`): with
    ``options.workers`` > 1 that many threads read and transform the source at once, under the same memory budget
    rule as ``convert`` (``estimate.choose_workers`` on this plan, whose prediction counts a writer verify does not
    have), while tensorstore reads and decodes the stored tiles on its own threads, ``workers`` of them in flight.
    Tiles are compared in the plan's order whatever the workers: the result is the same, mismatch for mismatch."""
    from ckptconv import host
    from ckptconv.plan import estimate

    start = time.perf_counter()
    dst = layout.absolute(dst)
    stored, custom = read_metadata(dst)
    by_path = {leaf.path: leaf for leaf in stored}
    dtype = _stored_dtype(stored)
    source = open_source(source_uri, hf_token_file=hf_token_file)
    plan = make_plan(source, dtype=dtype, scan_layers=bool(custom.get("scan_layers", True)), devices=1,
                     multimodal=bool(custom.get("multimodal", False)))
    options = estimate.choose_workers(plan, options or host.run_options())
    result = VerifyResult(workers=options.workers, why=options.why,
                          predicted_peak_rss_bytes=estimate.predicted_peak_bytes(plan, options=options))
    result.mismatches += check_source_layout(source, plan.tensors.values())
    planned = {leaf.path for leaf in plan.leaves}
    result.mismatches += [f"{'/'.join(p)}: missing from the checkpoint" for p in sorted(planned - set(by_path))]
    result.mismatches += [f"{'/'.join(p)}: not expected from the source"
                          for p in sorted(set(by_path) - planned - EXTRA_LEAVES)]
    shown = Progress(plan.tensor_count, plan.output_bytes, progress, desc="verify")
    checked = []  # the jobs whose leaves are stored as planned: their tiles are compared
    by_job: list[list[str]] = [[] for _ in plan.jobs]  # each job's mismatches, listed in the plan's order at the end
    for index, job in enumerate(plan.jobs):
        present = [by_path.get(leaf.path) for leaf in job.leaves]
        bad = [leaf for leaf, meta in zip(job.leaves, present)
               if meta is not None and (meta.shape != leaf.shape or np.dtype(meta.dtype) != leaf.dtype)]
        for leaf in bad:
            meta = by_path[leaf.path]
            by_job[index].append(f"{leaf.name}: stored {meta.dtype}{list(meta.shape)}, "
                                 f"expected {leaf.dtype}{list(leaf.shape)}")
        if bad or any(meta is None for meta in present):
            shown.advance(len(job.pieces), sum(leaf.nbytes for leaf in job.leaves))
        else:
            checked.append(index)
    _compare(plan, source, dst, checked, options, result, shown, by_job)
    result.mismatches += [line for lines in by_job for line in lines]  # job by job, as one job at a time found them
    shown.close()
    result.seconds = time.perf_counter() - start
    result.peak_rss_bytes = peak_rss_bytes()
    return result


def _compare(plan, source: Source, dst: str, checked: list[int], options: settings.RunOptions,
             result: VerifyResult, shown: Progress, by_job: list[list[str]]) -> None:
    """Every tile of the ``checked`` jobs against the stored region it was written to, in the plan's order: the
    expected tiles from the producer, the stored ones read ahead, ``options.workers`` of them in flight (their
    reads and decodes run on tensorstore's threads). A leaf's first differing region is its one mismatch, added to
    its job's in ``by_job``."""
    job_of = [index for index, job in enumerate(plan.jobs) for _ in job.leaves]  # leaf index -> job index
    first = list(itertools.accumulate((len(job.leaves) for job in plan.jobs), initial=0))  # a job's first leaf
    stores: dict[int, object] = {}  # the open leaves (by leaf index) of the jobs not yet finished
    failed: set[int] = set()
    counted = collections.Counter()  # bytes shown so far per job; the rest are shown when the job ends
    finished = iter(checked)
    ending = [next(finished, None)]  # the next checked job not yet finished

    def finish_jobs(before: int | None) -> None:
        """Count (and show) every checked job before ``before`` (None: all): its tiles have all been compared."""
        while ending[0] is not None and (before is None or ending[0] < before):
            job = plan.jobs[ending[0]]
            shown.advance(len(job.pieces), max(sum(leaf.nbytes for leaf in job.leaves) - counted[ending[0]], 0))
            result.leaves_checked += len(job.leaves)
            result.tensors_checked += len(job.pieces)
            for k in range(first[ending[0]], first[ending[0] + 1]):
                stores.pop(k, None)  # let its leaves' handles (and their OCDBT caches) go, as each job did
            ending[0] = next(finished, None)

    def settle(k: int, index, expected: np.ndarray, reading) -> None:
        got = np.asarray(reading.result())
        finish_jobs(job_of[k])
        if k in failed:
            return
        leaf = plan.leaves[k]
        if not np.array_equal(got.view(np.uint8), expected.view(np.uint8)):
            diff = np.argwhere(got.view(np.uint8).reshape(-1) != expected.view(np.uint8).reshape(-1))
            by_job[job_of[k]].append(f"{leaf.name}: region {_fmt(index)} differs (first byte {int(diff[0][0])})")
            failed.add(k)
            return
        result.bytes_checked += expected.nbytes
        shown.advance(0, expected.nbytes)
        counted[job_of[k]] += expected.nbytes

    def started(tiles):
        for k, index, expected in tiles:
            if k in failed:
                continue
            if k not in stores:
                stores[k] = open_leaf(dst, plan.leaves[k].path)
            yield k, index, expected, stores[k][index].read()

    tiles = produce_tiles(plan, source, StageTimer(), options, jobs=frozenset(checked))
    try:
        for k, index, expected, reading in read_ahead(started(tiles), options.workers + 1):
            settle(k, index, expected, reading)
        finish_jobs(None)
    finally:
        tiles.close()


def check_source_layout(source: Source, tensors: Iterable[TensorInfo]) -> list[str]:
    """Mismatches between where the plan reads each tensor and an independent reading of the headers.

    Deliberately a second, minimal implementation (not :mod:`ckptconv.read.safetensors_header`):
    offsets from the 8-byte length and ``data_offsets``, then one sweep in offset order that
    the ranges start at 0, touch end to end and end at the end of the file.
    """
    by_file: dict[str, list[TensorInfo]] = {}
    for info in tensors:
        by_file.setdefault(info.file, []).append(info)
    problems = []
    for file, infos in sorted(by_file.items()):
        (length,) = struct.unpack("<Q", bytes(source.read_range(file, 0, 8)))
        header = json.loads(bytes(source.read_range(file, 8, length)))
        ranges = sorted(_offsets(entry) for name, entry in header.items() if name != "__metadata__")
        ends = [0] + [end for _, end in ranges]
        if any(begin != end for (begin, _), end in zip(ranges, ends)) or ends[-1] != source.size(file) - 8 - length:
            problems.append(f"{file}: tensors do not tile the file's data exactly (independent check)")
        for info in infos:
            entry = header.get(info.name)
            offset = None if entry is None else 8 + length + _offsets(entry)[0]
            if offset != info.offset:
                problems.append(f"{file}: tensor {info.name!r} read at byte {info.offset}, "
                                f"its header says {offset} (independent check)")
    return problems


def _offsets(entry: dict | list) -> tuple[int, int]:
    """``data_offsets`` of a header entry (an object, or serde's array form ``[dtype, shape, offsets]``)."""
    begin, end = entry["data_offsets"] if isinstance(entry, dict) else entry[2]
    return begin, end


def _stored_dtype(stored) -> str:
    """The --dtype the checkpoint was written with: one dtype throughout, or e4m3 leaves among others (an FP8
    release kept as stored, --dtype float8_e4m3fn)."""
    names = {np.dtype(leaf.dtype).name for leaf in stored if leaf.path[:1] == ("params",)}
    if dtypes.E4M3.name in names:
        return settings.KEEP_FP8
    for name, dtype in dtypes.OUTPUT.items():
        if names == {dtype.name}:
            return name
    return "bfloat16"


def _fmt(index: tuple[slice, ...]) -> str:
    return "[" + ", ".join(":" if s == slice(None) else f"{s.start}:{s.stop}" for s in index) + "]"
