"""The facts every stage shares, each written down once: the defaults a run takes, what it may hold
in flight, the names of its stages and the statuses its reports and partitions say.

The memory prediction (:mod:`ckptconv.plan.estimate`) is computed from :data:`IN_FLIGHT`, and the
runtime (the reader's tiling, the prefetch thread, the writer, the quantised decoders) takes its
limits from the same object: the estimate and the run cannot disagree. A run's own options (data file
size, layout, workers, memory budget, what the host has) are one :class:`RunOptions` value, built
once from the command line and the host (:func:`ckptconv.host.run_options`) and passed down, never
module state. Importing this module is cheap (no NumPy), so the CLI reads its defaults from here
before any command starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# --- defaults (CLI, Prefect tasks and flows, deployments) ---
DEVICES = 16  # simulated CPU devices each weight is sharded across (1: unsharded)
# Layers stacked on axis 1 (MaxText's scan_layers=true), except for a model MaxText runs unscanned only (Gemma 4
# E2B/E4B's shared KV layers, Qwen3-VL's deepstack vision path): None means "the layout the model runs".
SCAN_LAYERS: bool | None = None
DTYPE = "bfloat16"  # dtype of the written weights
OUTPUT_DTYPES = ("bfloat16", "float32")  # what export's --dtype may be (numpy dtypes: ckptconv.dtypes.OUTPUT)
# MaxText's --save_dtype float8_e4m3fn: an FP8 release's weights kept e4m3, every other tensor in its own dtype
KEEP_FP8 = "float8_e4m3fn"
CONVERT_DTYPES = OUTPUT_DTYPES + (KEEP_FP8,)  # what convert's and plan's --dtype may be
SHARD_SIZE = "5GB"  # largest safetensors file an export writes
# What a conversion gathers into one OCDBT data file before committing it (InFlight.data_file_bytes, below): the
# CLI's --data-file-size default. Bigger files mean fewer storage reads for a restoring host and more RAM held
# while converting; the memory prediction counts whichever is chosen.
DATA_FILE_SIZE = "64MiB"
# How stored chunks are compressed (convert --compression). None: lz4 where the data files are by device, zstd in the
# source's order (ckptconv.write.codecs.chosen says why).
COMPRESSION: str | None = None
PROGRESS = "bar"  # on a terminal a bar, else a line every few seconds
HUB_STAGING = "~/.cache/ckptconv/hub-export"  # where an export to hf:// is staged before its upload
HUB_STAGING_ENV = "CKPTCONV_HUB_STAGING"  # ... unless this environment variable names another directory

# --- the pipeline's stages, in order (timings, reports, artifacts) ---
STAGES = ("plan", "read", "transform", "write", "commit")


class Status:
    """What a report, a partition marker or a zoo entry says of its run."""

    WRITING = "writing"  # under way, or died: never taken for done
    COMPLETE = "complete"  # committed: the one state a rerun skips
    PARTITION_COMPLETE = "partition complete"  # one partition's share staged, waiting for the finalize
    SKIPPED = "skipped"  # a zoo entry whose output was already complete and identical
    FAILED = "failed"
    NEVER_STARTED = "never started"  # a zoo entry no worker picked up in time


@dataclass(frozen=True)
class InFlight:
    """What a conversion or export may hold at once. Each limit is what the runtime obeys and what
    the memory prediction counts, so the prediction stays an upper bound when one changes."""

    read_bytes: int = 16 * 1024 * 1024  # source bytes per read unit: few commits, still a stream
    # Tiles (with workers > 1: read units) the producer queues ahead of the writer. One is enough to keep the writer
    # fed: against two, Llama-3-70B's widths on 2 cores converted in the same 23-25 s (by device, alternated, 3 runs
    # each) and peaked 15-17 MiB lower; on the 13-core host Llama-3-8B's widths (8 layers, 12 workers) in 21.0-21.4 s
    # by device and 16.6-17.8 in the source's order, against 19.9-23.5 and 16.6-18.4 (alternated, docs/speed.md).
    # With two, Mistral-7B's widths on 16 devices peaked at 192 MiB against 292 predicted (1.52x, past the memory
    # test's 1.5x) in a venv that had compiled its modules already: `make test` run a second time failed (docs/memory.md).
    prefetch: int = 1
    writes: int = 2  # tile writes in flight (tensorstore copies): overlaps making one with writing one, ~15% faster
    decode_elements: int = 1 << 20  # quantised values decoded through float32 at a time (4 MiB)
    # The OCDBT b-tree node cache a write opens (Orbax's default is 100 MB). Every commit writes new
    # versions of the nodes it touches; the old ones stay cached until evicted, so the default cache fills
    # with nodes no one reads again (OLMo 3 32B's block: peak 513 MiB with 100 MB, 411 MiB with 8 MB, in
    # the same wall time).
    ocdbt_cache_bytes: int = 8_000_000
    # Tiles the writer gathers into one transaction, committed as one OCDBT data file (uncompressed
    # bytes, held until the commit). Each tile committing alone made one data file per tile (<= 16 MiB;
    # 114 holding chunks for Qwen3-0.6B's shape on 16 devices), and a host restoring its shard from gs://
    # makes one request per (leaf, data file) pair it reads (docs/bench/RESTORE.md; a host reading every shard
    # more, as its reads fall in different coalescing windows). 64 MiB: 20-22 data files, conversion
    # peak 405 -> 425-464 MiB. 128 MiB would halve the files again (23; gs:// requests at MaxText's on 16
    # devices) but holds more than half of a 256 MiB leaf while writing it (tests/test_writer.py's bound).
    data_file_bytes: int = 64 * 1024 * 1024

    @property
    def tiles_alive(self) -> int:
        """Tiles that can be alive together: those queued, the one the producer holds while the queue
        is full, the one the writer is handing over, and the writes in flight."""
        return self.prefetch + 1 + 1 + self.writes

    @property
    def tiles_spilling(self) -> int:
        """Tiles alive together when they go to a spill (data files by device) with one worker: those queued, the
        one the producer holds while the queue is full, and the one being written to the spill (the stream waits for
        it: ckptconv.write.orbax._SpilledWrites)."""
        return self.prefetch + 1 + 1


IN_FLIGHT = InFlight()


# --data-files-by-device: the writer regroups tiles by device through a local spill (ckptconv.write.spill), so a host
# restoring its shard reads its own data files only. None (the default) chooses by size: by device when the output
# fills more than AUTO_SPILL_WINDOWS spill windows (1 GiB on 16 devices with 64 MiB data files), in the source's order
# otherwise. The spill costs a conversion about one window's write at its start and end (the writer waits for the
# first window to fill, and writes the last after the reads end), the same few seconds at any size: on 2 cores,
# 16 devices, Llama-3-70B's widths with 6 layers (11.5 GiB) took 54-58 s against 47-51 s, OLMo 3 32B's block (5.7 GB)
# 31-32 s against 22-24 s, while device 0's host reads fell from 161 to 15 (Qwen3-0.6B's shape, 1.1 GiB: 21 requests
# against 7, docs/bench/RESTORE.md). Within one window a host reads about 16 data files either way. An output of two
# windows at most is spilled whole and written after its stream (ckptconv.write.orbax._SpilledWrites' hold_first), so
# the stream's peak and a commit's never meet (plan.estimate's overlap; docs/memory.md).
DATA_FILES_BY_DEVICE: bool | None = None
AUTO_SPILL_WINDOWS = 1
# --workers and --memory-budget (RunOptions.workers_asked, budget_bytes): None takes them from the host, the cores this
# process may run on and the memory available to it (ckptconv.host); plan.estimate.choose_workers then takes the most
# workers whose predicted peak fits the budget.
WORKERS: int | None = None
# At most this many data files commit at once (RunOptions.commit_lanes), one lane for every WORKERS_PER_LANE workers:
# each holds its data file in RAM while it commits. On the 13-core TPU host (12 workers) 6 lanes converted
# Llama-3-8B's widths with 8 layers by device in 37.4 s against 41.1 with 4 (1 MiB mmap threshold); with the 64 MiB
# one below, 6, 8 and 12 lanes took the same 28.6-29.8 s: lanes no longer bound it there (docs/speed.md).
COMMIT_LANES = 8
WORKERS_PER_LANE = 2
# At most this many read units are transformed at once (RunOptions.transforming), however many workers read and
# decode them: each holds a unit's float32 copies, and on a host of 100+ cores half of them would be gigabytes the
# writer cannot take faster. On the 13-core TPU host (12 workers, the producers idle most of the time, waiting for the
# writer) 3, 4 and 6 slots converted Llama-3-8B's widths in the same walls (by device 19.4-22.6, 20.6-21.1 and
# 18.9-20.9 s; docs/speed.md, session 17).
TRANSFORM_SLOTS = 3
# glibc's mmap threshold on a kernel without VmHWM (gVisor: ckptconv.monitor.tune_malloc; 1 MiB elsewhere). There each
# page fault of a fresh mapping is dear, and every tile, read and transform buffer above the threshold is one: with
# 64 MiB instead of 1 MiB the 13-core TPU host converted the case above in 30.4 s against 41.1 by device (CPU 117 s
# against 202) and 21.5 against 25.7 in the source's order (docs/speed.md). The heap then keeps freed buffers
# resident between trims: the estimate counts them there (plan.estimate.SANDBOX_HEAP_SHARE).
SANDBOX_MMAP_THRESHOLD = 64 * 1024 * 1024
MEMORY_BUDGET: str | None = None
# Without --memory-budget a run may plan on this share of the memory available when it starts: the rest is left to
# the page cache (its spill and the source's reads go through it) and to whatever else runs beside it.
BUDGET_SHARE_OF_AVAILABLE = 0.5


@dataclass(frozen=True)
class RunOptions:
    """One run's options, built once from the command line and the host, then passed down to the planner's estimate,
    the producer, the writer and the report (which records :meth:`to_json`): no stage reads them from module state,
    so whoever changes one finds every reader by following the value.

    ``workers`` is what the run uses: the producer reads and transforms that many read units at once and, above one,
    the writer overlaps gathering the next data file with committing the last (:func:`ckptconv.plan.estimate.
    choose_workers` sets it from the plan, the cores and the budget, and ``why`` says how). ``planned_output_bytes``
    is set once the plan is made (:meth:`planned`): the layout chosen by size goes by it, so the writer, which may see
    one partition's leaves only, the estimate and the report make the same choice.
    """

    data_file_bytes: int = IN_FLIGHT.data_file_bytes  # --data-file-size
    data_files_by_device_asked: bool | None = DATA_FILES_BY_DEVICE  # --[no-]data-files-by-device; None: by size
    planned_output_bytes: int | None = None  # the plan's output (None: not planned; the writer uses its leaves')
    workers_asked: int | None = WORKERS  # --workers; None: from the host's cores and the budget
    budget_bytes: int | None = None  # --memory-budget, else a share of the host's available memory; None: no bound
    budget_asked: bool = False  # whether the budget was given (else it came from the host)
    host_cores: int = 1  # the cores this process may run on (scheduler affinity, a cgroup's CPU quota)
    host_available_bytes: int | None = None  # MemAvailable (or a cgroup's room) when the run started
    # the kernel keeps no VmHWM (gVisor, as GKE Sandbox and TPU VM hosts run it): its RSS counts the runtime's
    # mapped libraries whole, and the estimate's baseline is that kernel's (plan.estimate.BASELINE_SANDBOX_BYTES)
    sandboxed: bool = False
    workers: int = 1  # what the run uses (choose_workers)
    why: str = "one worker (nothing chosen)"

    @property
    def in_flight(self) -> InFlight:
        """The limits this run's runtime obeys and its estimate counts (``IN_FLIGHT`` with this run's data file)."""
        return dataclasses.replace(IN_FLIGHT, data_file_bytes=self.data_file_bytes)

    @property
    def overlaps_commits(self) -> bool:
        """Whether the writer gathers the next data file while the last commits: with workers > 1, where tiles come
        faster than one commit at a time takes them."""
        return self.workers > 1 and self.data_file_bytes > 0

    @property
    def transforming(self) -> int:
        """Read units transformed at once (the rest of the workers read, decode, or wait): a transform's float32
        copies are the most a unit holds (a scaled query: 5x its read), so half the workers at most hold them
        together, and no more than ``TRANSFORM_SLOTS`` whatever the host's cores."""
        return max(1, min(self.workers // 2, TRANSFORM_SLOTS))

    @property
    def commit_lanes(self) -> int:
        """Data files committed at once, each by a writer of its own (``ckptconv.write.orbax._Lanes``): one commit
        compresses its data file's chunks on about one core (a zarr3 shard is encoded as one value), so one at a time
        bounds a run at one core's compression, whatever the host has. A lane for every two workers: the other
        half make the tiles (on 2 cores one lane, its commit overlapping the next data file's gathering)."""
        return max(1, min(self.workers // WORKERS_PER_LANE, COMMIT_LANES)) if self.overlaps_commits else 1

    def planned(self, output_bytes: int) -> "RunOptions":
        """These options for a conversion planned to write ``output_bytes``."""
        return dataclasses.replace(self, planned_output_bytes=output_bytes)

    def data_files_by_device(self, devices: int, output_bytes: int | None = None) -> bool:
        """Whether a conversion of ``output_bytes`` (default: the planned one's) for ``devices`` writes its data files
        by device: as asked, else by size (``AUTO_SPILL_WINDOWS``); never on one device (its data files are all the
        host's) or with a data file per tile."""
        window = devices * self.data_file_bytes
        if devices < 2 or window <= 0:
            return False
        if self.data_files_by_device_asked is not None:
            return self.data_files_by_device_asked
        output = self.planned_output_bytes if output_bytes is None else output_bytes
        return (output or 0) > AUTO_SPILL_WINDOWS * window

    def spill_window_bytes(self, devices: int, output_bytes: int | None = None) -> int:
        """Bytes of tiles' device parts the writer spills to local disk before writing them device by device
        (ckptconv.write.spill): one data file per device; 0 when it writes tiles as they come."""
        return devices * self.data_file_bytes if self.data_files_by_device(devices, output_bytes) else 0

    def writes_after_stream(self, devices: int, output_bytes: int | None = None) -> bool:
        """Whether the by-device writer keeps its first spill window until the stream ends, so that writing and reading
        take turns: an output of two windows at most (``ckptconv.write.orbax._SpilledWrites``' ``hold_first``). The
        writer and the estimate (``plan.estimate``: the stream's peak and a commit's never meet) both ask this.

        >>> options = RunOptions(data_file_bytes=4)
        >>> [options.writes_after_stream(1, n * 4 + 1) for n in (1, 2, 3)], options.writes_after_stream(2, 16)
        ([False, False, False], True)
        >>> [options.writes_after_stream(2, n) for n in (9, 16, 17)]
        [True, True, False]
        """
        window = self.spill_window_bytes(devices, output_bytes)
        output = self.planned_output_bytes if output_bytes is None else output_bytes
        return bool(window) and (output or 0) <= 2 * window

    def to_json(self) -> dict:
        """What the report and ``plan`` say of the run's parallelism and budget, and why."""
        return {"workers": self.workers, "workers_asked": self.workers_asked, "why": self.why,
                "memory_budget_bytes": self.budget_bytes, "memory_budget_asked": self.budget_asked,
                "host_cores": self.host_cores, "host_available_bytes": self.host_available_bytes,
                "sandboxed_kernel": self.sandboxed, "transforming": self.transforming,
                "overlapped_commits": self.overlaps_commits, "commit_lanes": self.commit_lanes}
