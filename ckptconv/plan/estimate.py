"""Predict a conversion's peak memory from its plan, before any weights are read.

The Prefect flow holds this many GB of a concurrency limit while a conversion runs, so the
prediction must be an upper bound, and a tight one (admission that over-reserves wastes
workers). It comes from the same tile plan the producer and writer use (:mod:`ckptconv.families.tiles`):
the runtime baseline, plus, for the worst job, the tiles alive at once (queued by the
producer, being handed over, in flight in tensorstore) and the read unit being transformed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ckptconv import settings
from ckptconv.families.inputs import FP8_KEPT, FP8_BLOCK, INT4_SCHEME, MXFP4_SCHEME
from ckptconv.families.sharding import partition_spec
from ckptconv.families.tiles import padding_elements
from ckptconv.families.transforms import Permute, box_shape
from ckptconv.plan.conversion import ConversionPlan, Job
from ckptconv.read.spec import ModelSpec

# Python + NumPy + tensorstore after start-up, with their thread pools, caches and allocator slack under load. A
# conversion process imports neither JAX nor Orbax since the writer lays out Orbax's files itself
# (ckptconv/write/orbax_layout.py): a tiny model (SynthModel()) now converts in 67-68 MiB, on 1 and 16 devices,
# against 196-200 MiB with them (5 runs each, /usr/bin/time, 2 cores). That part varies from run to run by more than the
# tiles do (up to 70 MiB higher beside a busy test suite than alone; 30-50 MiB more of the shared libraries' pages
# mapped from a freshly installed venv, which a clean clone's CI has), so the baseline is set from the high end
# the 1.5x tightness allows: run one at a time on 2 cores, every memory example (tests/test_memory.py, and
# test_keep_fp8.py's and test_lora.py's) peaked at 0.67-0.93 of its prediction with 140 MiB (0.45-0.55 with the
# 320 MiB JAX and Orbax had needed). With the by-device terms of session 16 a clean clone's memory phase put every
# example at 0.68-0.93 of its prediction (ae1b514): Llama 4 Maverick's FP8 widths on 16 devices (354 of 380) bound it
# from below, Qwen3-Next's period (254 of 372) and DeepSeek-V4-Flash's widths (277 of 396) from above.
BASELINE_BYTES = 140 * 1024**2
# Of that baseline, what the stream's own runtime takes (the reader's threads and reused buffers, and the jitter of
# reading beside writing), gone once the stream has ended: a spilled output of two windows at most is written then
# (``RunOptions.writes_after_stream``), its writer beside the quiet runtime. Gemma 2 2B's widths (1.4 windows):
# 87-122 MiB between tiles while reading, 65-67 while writing after it (2 cores, alone). Its data file's commit counts
# this much less.
STREAM_RUNTIME_BYTES = 40 * 1024**2
# The same runtime on a kernel without VmHWM (gVisor, on the 13-core TPU v5e host), where that kernel counts more of
# the mapped libraries. With JAX and Orbax a tiny model converted there in 505-559 MiB (VmRSS sampled) and this was
# 640 MiB; without them (de5af0a) in 189-194 MiB (3 runs, alternated with b095eb3's 505-559). 320 MiB: a
# tiny model's peak plus the headroom the heap term below leaves the big cases (Llama-3-8B's widths, 8 layers,
# 12 workers, 6 lanes: by device 1.53-1.73 GiB against 1.92 predicted with these two constants; 2.19 before).
BASELINE_SANDBOX_BYTES = 320 * 1024**2
# There glibc's mmap threshold is 64 MiB (settings.SANDBOX_MMAP_THRESHOLD): freed tile, read and transform buffers
# stay in its heap, reused instead of faulted in anew, and resident until a trim, which comes only once the resident
# set passes the prediction less this term (trim_line; since eda60f9, where each trim's pages faulted in again had
# been most of the CPU: the 8-layer case below then peaked at 1693-1694 MiB of 1986 by device and 1293-1346 of 1682 in
# the source's order, docs/speed.md, session 22). Counted as this share of the
# producer's term (832 MiB with 12 workers for Llama-3-8B's widths). On the 13-core TPU host (d296427, 12 workers,
# 8 layers) the defaults peaked at 1.56-1.63 GiB by device (6 lanes) and 1.34 in the source's order, against 1.95 and
# 1.97 without this term; under bench/threadprof.py (a sampler thread started before the arena cap) the same runs
# peaked higher, up to 2.26 GiB with 8 lanes against 2.30 without it. Without JAX's runtime (de5af0a) the same
# conversion by device peaked at 1.53-1.73 GiB while its runtime alone fell by about 320 MiB: the stream's own
# memory there is more than this term counted at 0.25, so 0.3.
SANDBOX_HEAP_SHARE = 0.3
# Wall seconds per GiB written, by how the source is stored, measured on 2 cores with local disks
# (docs/bench/RESULTS.md: the Llama-3-8B shape; docs/bench/GIANTS.md: DeepSeek-V3 and gpt-oss widths). What
# ``plan`` predicts a conversion's time from; start-up (JAX, Orbax) adds a few seconds. INT4 reuses
# FP8's rate: its decoding costs less (1.8 s per GiB decoded against FP8's 4.6, side by side on a
# 2048 x 7168 expert), and Kimi-K2-Thinking's widths with 32 experts converted at 15-17 s/GiB only
# on a machine loaded 2.5x over its 2 cores, not a figure to plan with.
# Kept FP8 (Qwen3.5's -FP8 releases) decodes nothing: 4.5-5.0 s/GiB at Qwen3.5-397B's widths
# (docs/bench/HYBRID-MEMORY.md), as bfloat16 sources.
SECONDS_PER_GIB = {None: 4.4, FP8_BLOCK: 10.0, MXFP4_SCHEME: 10.0, INT4_SCHEME: 10.0, FP8_KEPT: 4.4}
STARTUP_SECONDS = 4.0
# The OCDBT node cache (settings.IN_FLIGHT.ocdbt_cache_bytes) fills as the b-tree grows, about
# 24 KiB per chunk written (measured: a run's peak climbs job after job until the cache is full),
# so a checkpoint of many chunks (16 devices, big models) holds it all.
OCDBT_CACHE_PER_CHUNK = 24 * 1024
# Bytes held per byte of tiles gathered for one data file (settings.IN_FLIGHT.data_file_bytes): the
# transaction's uncompressed chunks, and at the commit the data file being written. Qwen3-0.6B's shape
# on 16 devices peaked 50 MiB higher with 64 MiB data files and 146 MiB higher with 128 MiB ones
# than with a data file per tile (which had two tiles in tensorstore at once); 1.25 keeps the bound.
DATA_FILE_FACTOR = 1.25
# By device the data files are lz4-compressed (ckptconv.write.codecs), which barely shrinks bf16 weights: a commit holds
# the transaction's chunks and their encoded copy at full size. Gemma 2 2B's widths on 16 devices, written after the
# stream (1.4 windows, ``hold_first``): 67 MiB between windows, 185-188 MiB as each device's 64 MiB data file
# committed (five runs, 2 cores, alone): 118-121 MiB, 1.85 per byte with the OCDBT cache's share and the parts read
# back (``PARTS_READ_BACK``, 1 MiB each there).
DATA_FILE_FACTOR_BY_DEVICE = 2.0
# Beyond 128 MiB (--data-file-size) the commit holds more of both copies at once: a transaction's uncompressed
# chunks and the data file it encodes them into (bf16 compresses to 0.78). With 512 MiB data files the same shape
# peaked 732 MiB above the 64 MiB run (446 -> 1178 MiB, 1.63 per byte added): 1.8 per byte above 128 MiB.
DATA_FILE_FACTOR_LARGE = 1.8
DATA_FILE_FACTOR_FROM = 128 * 1024**2
# Parts a writer lane reads back from the spill ahead of the one it copies (ckptconv.write.orbax.READ_AHEAD): a
# device's part of a tile each.
READ_AHEAD = 4
# Parts a writer lane copies into its data file at once, each held until its write ends
# (ckptconv.write.orbax.PARTS_IN_FLIGHT), with workers > 1.
PARTS_IN_FLIGHT = 4
# Parts a one-worker lane holds beside its data file: the one read back from the spill, and tensorstore's copy of it.
# Counted within two spill windows, where the lanes write after the stream and their replicated parts (whole tiles) are
# the peak: kept DeepSeek-V3 FP8's widths (8 experts on 16 devices: replicated) 220-223 MiB alone, 249 in a clean
# clone's memory phase, against 244 predicted without them. Beside the stream (over two windows) the replicated group
# is the last of each window's writes, and the examples with replicated leaves peaked at 0.70-0.93 of the sum without
# them (a clean clone at ae1b514: Maverick's FP8 widths 354 of 380 MiB, OLMo 3 32B's block 337 of 372,
# DeepSeek-V4-Flash's 277 of 396); with them V4-Flash's prediction rose to 428, its peak under the 1/1.5 floor: not
# counted there, a known gap of the sum (docs/memory.md).
PARTS_READ_BACK = 2
# Tiles being written to the spill while the stream goes on (ckptconv.write.orbax.SPILL_AHEAD), with workers > 1.
SPILL_AHEAD = 2


# A quantised read decodes a band at a time (settings.IN_FLIGHT.decode_elements values) through float32: its codes and
# their scaled product, beside what ``decode_bytes`` counts per value. Llama 4 Maverick's FP8 experts held 64 MiB for a
# 16 MiB read and its tile (tracemalloc, no buffer pool), 56 counted without the band.
DECODE_BAND_BYTES = 2 * settings.IN_FLIGHT.decode_elements * 4


def tile_bytes(job: Job, plan: ConversionPlan) -> int:
    """The largest tile (one read unit's image in one leaf) this job produces."""
    return _tile_figures(job, plan)[0]


def _tile_figures(job: Job, plan: ConversionPlan) -> tuple[int, int, int, int]:
    """One walk over the job's read units of every size (``Job.sample_units``): (its largest tile; the most one unit
    makes, all its leaves' tiles together, what a parallel worker holds once its unit is made; the largest part of a
    tile a by-device writer reads back from its spill; the largest such part of a sharded leaf).

    A sharded leaf's tile is split among the devices; a replicated one's (MaxText replicates a leaf none of whose axes
    the devices divide: 8 experts on 16 devices) is one part, the whole tile, and the replicated leaves are one group
    of the spill, which one lane writes (:func:`ckptconv.write.spill.device_parts`). One device: no parts (0)."""
    replicated = [all(axis is None for axis in partition_spec(leaf.shape, plan.devices)) for leaf in job.leaves]
    tile = unit = part = sharded = 0
    for sample in job.sample_units(plan.spec):
        made = 0
        for leaf, box, whole in zip(job.leaves, sample.leaf_boxes, replicated):
            if box is None:
                continue
            nbytes = math.prod(box_shape(box)) * leaf.dtype.itemsize
            tile, made = max(tile, nbytes), made + nbytes
            if plan.devices > 1:
                split = nbytes if whole else -(-nbytes // plan.devices)
                part = max(part, split)
                if not whole:
                    sharded = max(sharded, split)
        unit = max(unit, made)
    return tile, unit, part, sharded


def work_bytes(job: Job, spec: ModelSpec) -> int:
    """Producing one read unit besides its output: the raw read, then either what decoding a
    quantised read takes or what the steps take. Decoding ends before the steps start, so the
    larger of the two counts, not their sum.

    Each step makes a new array from the one before, which is freed when the step returns, so two
    are alive at once: a chain that computes runs in float32 (the cast, then each step: two float32
    copies, whether one of them is a transpose or not); an exact chain that permutes axes holds one
    transposed copy in the source dtype. (Llama-3-70B's widths, whose worst job is the query kernel
    cast, transposed and scaled, peaked at 392-401 MiB; OLMo 3 32B's, whose jobs only transpose the
    same 16 MiB reads, at 384-408 MiB.) A padded vocabulary's last read also carries zero rows up to
    its chunk boundary: the steps make them too (``padding_elements``)."""
    raw = job.tiling.unit_bytes
    itemsize = job.pieces[0].dtype.itemsize
    elements = raw // itemsize
    decode = _decode_bytes(job)
    steps = [step for leaf in job.leaves for step in leaf.steps]
    computing = not all(step.exact for step in steps)
    padded = padding_elements(job.tiling, job.source_shape, job.shapes, spec)
    if computing:
        compute = 2 * (elements + padded) * np.dtype(np.float32).itemsize
    else:
        compute = (elements if any(isinstance(step, Permute) for step in steps) else 0) + padded
        compute *= itemsize
    return raw + max(decode, compute)


def _decode_bytes(job: Job) -> int:
    """What decoding one read unit of a quantised source holds beside its bfloat16 result (0 for a plain one): its
    ``decode_bytes`` per value, and the float32 band it decodes through (``DECODE_BAND_BYTES``)."""
    decode = job.tiling.unit_bytes // job.pieces[0].dtype.itemsize * job.pieces[0].decode_bytes
    return decode + DECODE_BAND_BYTES if decode else 0


def reading_bytes(job: Job) -> int:
    """What a worker holds for one read unit before it takes a transform slot: the raw read and, for a quantised
    read, its decoding (done in the read, outside the slot)."""
    return job.tiling.unit_bytes + _decode_bytes(job)


def ocdbt_cache_bytes(plan: ConversionPlan) -> int:
    """What the OCDBT node cache grows to for this checkpoint's chunk count."""
    chunks = sum(math.prod(-(-dim // c) for dim, c in zip(leaf.shape, leaf.chunk_shape)) for leaf in plan.leaves)
    return min(settings.IN_FLIGHT.ocdbt_cache_bytes, chunks * OCDBT_CACHE_PER_CHUNK)


def data_file_bytes(plan: ConversionPlan, tiles: list[int], options: settings.RunOptions | None = None,
                    parts: list[int] | None = None, sharded_parts: list[int] | None = None) -> int:
    """What the writer's open transactions hold: the tiles of one OCDBT data file, uncompressed, and at
    its commit their compressed copy (``options.data_file_bytes``; no more than the output), once per commit lane
    (``options.commit_lanes``, no more than the output's data files). In the source's order with overlapped commits
    (``options.overlaps_commits``) the next data file is gathered, uncompressed, while the lanes commit; by device
    each lane gathers and then commits its own, reads parts back from the spill ahead of them while others are
    copied into its data file, and tiles wait for their spill writes. ``parts``: each job's largest such part
    (:func:`_tile_figures`; default: a tile split among the devices), ``sharded_parts`` a sharded leaf's (default: the
    same): the replicated leaves' parts, whole tiles, are one group of the spill, written by one lane, whose reads
    ahead and copies in flight may all be whole tiles while the other lanes' are parts of a tile. Counting every lane
    so put Mixtral-8x7B's widths with 12 workers (6 lanes) at 2048 MiB on the 13-core TPU host, where it peaked at
    748. With one worker a lane holds two parts besides its data file (``PARTS_READ_BACK``): kept DeepSeek-V3 FP8's
    widths on 16 devices, whose experts (8 on 16 devices) are replicated, 16 MiB parts, committed 154 MiB above the
    runtime after the stream; Gemma 2 2B's, of 1 MiB parts, 118-121 MiB."""
    options = options or settings.RunOptions()
    limit = options.data_file_bytes
    if limit <= 0:
        return 0
    held = min(max(limit, max(tiles, default=0)), plan.output_bytes)
    window = options.spill_window_bytes(plan.devices, plan.output_bytes)
    by_device = bool(window)
    factor = DATA_FILE_FACTOR_BY_DEVICE if by_device else DATA_FILE_FACTOR
    committing = int(min(held, DATA_FILE_FACTOR_FROM) * factor
                     + max(0, held - DATA_FILE_FACTOR_FROM) * max(factor, DATA_FILE_FACTOR_LARGE))
    lanes = max(1, min(options.commit_lanes, -(-plan.output_bytes // held)))
    gathering = min(held, max(0, plan.output_bytes - held)) if options.overlaps_commits else 0
    if by_device:
        part = max(parts) if parts else -(-max(tiles, default=0) // plan.devices)
        if options.overlaps_commits:  # one lane's parts may be whole tiles (the replicated group), the others' not
            sharded = max(sharded_parts) if sharded_parts else part
            ahead = (READ_AHEAD + PARTS_IN_FLIGHT) * (part + (lanes - 1) * sharded)
        else:  # one worker, one lane: counted where it writes alone, after the stream (see PARTS_READ_BACK)
            ahead = PARTS_READ_BACK * part if options.writes_after_stream(plan.devices, plan.output_bytes) else 0
        spilling = SPILL_AHEAD * max(tiles, default=0) if options.overlaps_commits else 0
        return lanes * committing + ahead + spilling
    return lanes * committing + gathering


@dataclass(frozen=True)
class JobFigures:
    """What one job's read units weigh, computed once per plan: its largest tile, the most one unit makes (all its
    leaves' tiles), and what producing a unit takes besides (:func:`work_bytes`)."""

    tile: int
    unit: int
    work: int
    read: int  # one unit's raw read (a worker reading, or waiting for a transform slot)
    part: int = 0  # the largest part of a tile the by-device writer reads back (_tile_figures)
    reading: int = 0  # a worker's hold before its transform slot: the read and its decoding (reading_bytes)
    sharded_part: int = 0  # the largest part of a sharded leaf's tile (_tile_figures)


def job_figures(plan: ConversionPlan) -> list[JobFigures]:
    """Each job's figures, in the plan's order (what every term of the estimate reads)."""
    figures = []
    for job in plan.jobs:
        tile, unit, part, sharded = _tile_figures(job, plan)
        figures.append(JobFigures(tile, unit, work_bytes(job, plan.spec), job.tiling.unit_bytes, part,
                                  reading_bytes(job), sharded))
    return figures


# With several workers the producer's reused buffers (ckptconv.read.buffers) stay resident between units, and a
# worker may leave one free in the pool while it makes its next of another size: counted as this many units per
# worker. Llama-3-70B's widths with 6 workers (tests/test_memory.py) peaked at 824-938 MiB in three runs (867 against
# 892 predicted without it in a clean clone's memory phase; 938 against 988 with it, alone on 2 cores); Qwen3's
# 4-worker example at 458-491 against 596 without it, 660 with it; one worker's peaks stayed at 0.72-0.90.
POOL_SLACK_UNITS = 1


def producer_bytes(figures: JobFigures, options: settings.RunOptions, spilled: bool = False) -> int:
    """What the producer holds for a job at most. One worker: its tiles alive (queued, handed over, in tensorstore's
    writes) and the unit being made; with a spill (``spilled``: data files by device) no tile waits for tensorstore,
    each is written to the spill before the next is taken (``IN_FLIGHT.tiles_spilling``). ``workers`` > 1:
    ``workers + prefetch`` units made or being made, each holding its tiles; of the workers, ``transforming`` also
    their work, the others their read; the tiles in tensorstore's writes; and the reused buffers' slack
    (``POOL_SLACK_UNITS`` per worker)."""
    limits = options.in_flight
    if options.workers <= 1:
        alive = limits.tiles_spilling if spilled else limits.tiles_alive
        return alive * figures.tile + figures.work
    units = options.workers + limits.prefetch
    transforming = min(options.transforming, options.workers)
    # Of the units counted made, as many as there are workers may be still being made (produce.in_order's depth
    # counts them): a transforming one holds its work (its tiles made inside it) instead, a reading one its read
    # and decoding. Counting them both ways put Llama-3-8B's widths with 12 workers 192 MiB higher.
    reading = min(figures.work, max(figures.reading, figures.read))
    being_made = transforming * max(0, figures.work - figures.tile) \
        + (options.workers - transforming) * max(0, reading - figures.unit)
    return (units * figures.unit + being_made + limits.writes * figures.tile
            + POOL_SLACK_UNITS * options.workers * figures.unit)


def peak_terms(plan: ConversionPlan, tiles: list[int] | None = None, options: settings.RunOptions | None = None,
               figures: list[JobFigures] | None = None) -> dict[str, int]:
    """What the predicted peak is made of, in bytes (the report and ``plan`` show it, so a peak that comes close
    to its prediction says which term to look at): the runtime ``baseline``, the OCDBT ``cache``, the ``writer``'s
    data file being gathered, the ``producer``'s worst job (its tiles alive and the read units being made),
    ``overlap``: what the writer and the producer hold together, and ``heap``: freed buffers glibc keeps resident on a
    sandboxed kernel (``SANDBOX_HEAP_SHARE``; 0 elsewhere). ``options``: the run's (default: one worker, the
    default data files, by size).

    The two overlap when the writer commits while the source is read: without a spill, and with one whose output
    fills more than two windows (one window is written while the next fills). Within two windows the writer holds
    the first until the stream ends (``hold_first``): the two take turns, and only the larger counts, the writer's
    less the stream's runtime (``STREAM_RUNTIME_BYTES``). With the overlap in between counted as a share of the
    smaller, Gemma 2 2B's widths (1.4 windows) peaked at 246-311 MiB against 310 predicted and Mixtral-8x7B's (1.2)
    at 213-245 against 341, as the stream's peak and a commit's met or not; taking turns, at 187-192 and 204-221
    (alone on 2 cores, 7 and 5 runs).
    """
    options = options or settings.RunOptions()
    if options.planned_output_bytes is None:
        options = options.planned(plan.output_bytes)
    figures = figures or job_figures(plan)
    tiles = tiles or [f.tile for f in figures]
    window = options.spill_window_bytes(plan.devices, plan.output_bytes)
    worst = max(producer_bytes(f, options, spilled=bool(window)) for f in figures)
    writer = data_file_bytes(plan, tiles, options, [f.part for f in figures], [f.sharded_part for f in figures])
    if options.writes_after_stream(plan.devices, plan.output_bytes):
        # the two take turns, the writer's after the stream's runtime is gone (STREAM_RUNTIME_BYTES)
        overlap = max(worst, writer - STREAM_RUNTIME_BYTES)
    else:
        overlap = worst + writer
    baseline = BASELINE_SANDBOX_BYTES if options.sandboxed else BASELINE_BYTES
    heap = int(worst * SANDBOX_HEAP_SHARE) if options.sandboxed else 0
    return {"baseline": baseline, "cache": ocdbt_cache_bytes(plan), "writer": writer, "producer": worst,
            "overlap": overlap, "heap": heap}


def choose_workers(plan: ConversionPlan, options: settings.RunOptions) -> settings.RunOptions:
    """``options`` with the workers this run uses, and why: as many as asked (``--workers``), else one fewer than
    the host has cores (:func:`default_workers`), but no more than the predicted peak lets fit in the budget
    (``--memory-budget``, else a share of the memory available); one at least, whatever the budget."""
    options = options.planned(plan.output_bytes)
    figures = job_figures(plan)
    return workers_within_budget(options, lambda chosen: predicted_peak_bytes(plan, options=chosen, figures=figures))


def workers_within_budget(options: settings.RunOptions,
                          peak_of: Callable[[settings.RunOptions], int]) -> settings.RunOptions:
    """The rule every command that runs workers follows (convert, verify, export): ``options`` with as many workers
    as asked, else :func:`default_workers`, but the most whose predicted peak (``peak_of`` the options with them)
    fits the budget; one at least, whatever the budget; ``why`` says which of these decided."""
    most = options.workers_asked or default_workers(options.host_cores)
    source = "asked (--workers)" if options.workers_asked else \
        f"one per core of the {options.host_cores} this process may use but the writer's"
    budget = options.budget_bytes
    whose = "--memory-budget" if options.budget_asked else "the budget (a share of the memory available)"
    for workers in range(most, 0, -1):
        chosen = dataclasses.replace(options, workers=workers)
        peak = peak_of(chosen)
        if budget is None or peak <= budget or workers == 1:
            break
    gib = 1024**3
    if budget is None:
        why = f"{workers}: {source}; no memory budget known"
    elif peak > budget:
        why = f"1: the least a run takes, and its predicted peak {peak / gib:.2f} GiB is over {whose}, " \
              f"{budget / gib:.2f} GiB"
    elif workers < most:
        why = f"{workers} of {most} ({source}): the most whose predicted peak ({peak / gib:.2f} GiB) fits " \
              f"{whose}, {budget / gib:.2f} GiB"
    else:
        why = f"{workers}: {source}; predicted peak {peak / gib:.2f} GiB within {whose}, {budget / gib:.2f} GiB"
    return dataclasses.replace(chosen, why=why)


def default_workers(cores: int) -> int:
    """Workers for a host of ``cores``: all but one, which the writer takes (its loop gathers every tile, and a
    commit compresses a data file on about one core); one at least. On 2 cores one worker is today's single stream,
    whose peaks the memory tests hold to the prediction. A second worker there converted Qwen3's 720 MiB memory example
    in 2.9 s against 3.7, but its 196 MiB one peaked at 401-415 MiB against 615 predicted (1.48-1.53x: past the 1.5x
    the memory tests hold a prediction to), where one worker peaked at 383 against 535."""
    return max(1, cores - 1)


def predicted_peak_bytes(plan: ConversionPlan, tiles: list[int] | None = None,
                         terms: dict[str, int] | None = None, options: settings.RunOptions | None = None,
                         figures: list[JobFigures] | None = None) -> int:
    """Baseline + the OCDBT cache + what the writer and the producer hold together + what the heap keeps on a
    sandboxed kernel (``terms``, else :func:`peak_terms` with ``options``)."""
    terms = terms or peak_terms(plan, tiles, options, figures)
    return terms["baseline"] + terms["cache"] + terms["overlap"] + terms.get("heap", 0)


def trim_line(predicted: int, heap: int) -> int | None:
    """The resident set above which a run gives its heap's free pages back (``monitor.trim_only_above``): its
    ``predicted`` peak less the ``heap`` term, which counts those pages; None (trim always) where there is no such
    term. Convert's and export's alike."""
    return predicted - heap if heap else None


def predicted_seconds(plan: ConversionPlan) -> float:
    """Wall time at the measured rate for this kind of source (an estimate for sizing, not a promise)."""
    rate = SECONDS_PER_GIB.get(plan.spec.values.get("quantization"), max(SECONDS_PER_GIB.values()))
    return round(STARTUP_SECONDS + plan.output_bytes / 1024**3 * rate, 1)


def plan_summary(plan: ConversionPlan, options: settings.RunOptions | None = None) -> dict:
    """What ``plan`` prints: the plan's sizes, the layout and the run's options (``options``: workers chosen, else
    one worker), the predicted peak and its terms."""
    options = (options or settings.RunOptions()).planned(plan.output_bytes)
    figures = job_figures(plan)
    tiles = [f.tile for f in figures]
    terms = peak_terms(plan, tiles, options, figures)
    window = options.spill_window_bytes(plan.devices, plan.output_bytes)
    return {
        "source": plan.source_uri,
        "family": plan.family.name,
        "quantization": plan.spec.values.get("quantization"),
        "maxtext_decoder_block": plan.family.decoder_block,
        "layers": plan.spec.num_layers,
        "tensors": plan.tensor_count,
        "leaves": len(plan.leaves),
        "source_bytes": plan.source_bytes,
        "output_bytes": plan.output_bytes,
        "largest_shard_bytes": plan.largest_shard_bytes,
        "largest_read_bytes": max(job.tiling.unit_bytes for job in plan.jobs),
        "largest_tile_bytes": max(tiles),
        "data_file_bytes": options.data_file_bytes,
        "data_files_by_device": options.data_files_by_device(plan.devices, plan.output_bytes),
        "run": options.to_json(),
        # local disk (TMPDIR) the writer's spill takes at most: two windows (one filling, one being written) and
        # the tile that fills one
        "spill_disk_bytes": min(2 * window + max(tiles), plan.output_bytes) if window else 0,
        "predicted_peak_rss_bytes": (predicted := predicted_peak_bytes(plan, terms=terms)),
        "predicted_peak_terms": terms,
        "predicted_peak_rss_gib": round(predicted / 1024**3, 2),
        "predicted_seconds": predicted_seconds(plan),
        "devices": plan.devices,
        "scan_layers": plan.scan_layers,
        "dtype": str(plan.dtype),
        "tied_embeddings": bool(plan.spec.values.get("tie_word_embeddings")),
        "not_converted": list(plan.not_converted),
    }
