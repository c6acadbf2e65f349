"""One conversion, start to finish: source -> plan -> tiles -> write -> commit -> report.

Each step lives in its own module; this one only wires them and decides what to do about
whatever is already at the destination (skip, refuse, or clean leftovers and write).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
from dataclasses import dataclass

from ckptconv import __version__, host, layout, rssplot, settings, storage_failures
from ckptconv.errors import INCOMPLETE, BadInputError, BusyError, CkptConvError, DestinationExistsError, stop_if_terminated
from ckptconv.families.inputs import check_values
from ckptconv.monitor import StageTimer, run_figures, trim_now_and_then, trim_only_above, tune_malloc
from ckptconv.plan import estimate
from ckptconv.plan.conversion import MAXTEXT_EXTRA_ITEMS, ConversionPlan, make_plan
from ckptconv.progress import Progress
from ckptconv.read import waits
from ckptconv.read import open_source
from ckptconv.read.gcs import GCS_ENDPOINT
from ckptconv.read.sources import Source
from ckptconv.settings import Status
from ckptconv.write import codecs, destination, partition
from ckptconv.write.destination import Destination
from ckptconv.write.produce import produce_tiles


log = logging.getLogger("ckptconv")

PARTITION_SUMMARY = ("partition", "host", "leaves", "output_bytes", "wall_seconds", "peak_rss_bytes")


@dataclass(frozen=True)
class ConvertRequest:
    """The CLI's words: where from, where to, and how to lay the checkpoint out."""

    source: str
    destination: str
    devices: int = settings.DEVICES
    scan_layers: bool | None = settings.SCAN_LAYERS  # None: the layout the model runs (scanned where it can)
    dtype: str = settings.DTYPE
    report: str | None = None
    overwrite: bool = False
    progress: str = settings.PROGRESS
    compression: str | None = settings.COMPRESSION  # a name in ckptconv.write.codecs.CODECS; None: by the layout
    hf_token_file: str | None = None  # a path, not the token: the token is read only by the hub source
    partition: str | None = None  # "I/N": write only partition I of N (see ckptconv.write.partition)
    finalize: int | None = None  # N: join N finished partitions into the checkpoint and commit it
    lora: str | None = None  # a PEFT LoRA adapter of the source: written alone, or folded in (merge_lora)
    merge_lora: bool = False
    lora_layout: str = "converter"  # an adapter alone: where its tree sits (ckptconv.plan.lora.LORA_LAYOUTS)
    multimodal: bool = False  # also the vision/audio encoders (MaxText's use_multimodal=true)
    # --data-file-size, --[no-]data-files-by-device, --workers, --memory-budget and what the host has; None: this
    # host's defaults (ckptconv.host.run_options). The plan then fixes the workers (estimate.choose_workers).
    options: settings.RunOptions | None = None


def fingerprint(plan: ConversionPlan, source: Source, request: ConvertRequest) -> str:
    """Identity of (source bytes as far as cheaply knowable, options): equal means nothing to redo."""
    identity = {
        "provenance": source.provenance(),
        "config": plan.config_text,
        "tensors": sorted((t.name, t.file, t.dtype.str, t.shape, t.offset) for t in plan.tensors.values()),
        # the codec adds only compressed or not (codecs.compresses), the boolean it was before a codec could be
        # chosen: the stored values do not depend on it (every reader takes it from each leaf's zarr.json), so a
        # nightly run under a newer default skips the zstd checkpoints an older version wrote instead of refusing
        # them, and a partition written with zstd joins others written with lz4
        "options": [request.devices, plan.scan_layers, request.dtype, codecs.compresses(request.compression)]
        + ([request.lora_layout] if request.lora else []) + (["multimodal"] if request.multimodal else []),
        "format": 1,
    }
    if plan.adapter is not None:  # the adapter's bytes and the mode are part of what was converted
        identity["lora"] = {**plan.adapter, "merged": request.merge_lora}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str, allow_nan=False).encode()).hexdigest()


def convert(request: ConvertRequest) -> dict:
    """Run one conversion; returns the report (also written next to the checkpoint). A storage refusal
    (full disk, no permission, a bucket out of quota) leaves as one :class:`StorageError` line."""
    with storage_failures.translated(INCOMPLETE):
        return _convert(request)


def _convert(request: ConvertRequest) -> dict:
    _check_paths(request.source, request.destination)
    # the destination has its own report; the source must never be overwritten
    destination.check_report_path(request.report, {"destination": request.destination, "source": request.source})
    request = dataclasses.replace(request, destination=layout.absolute(request.destination))
    if request.partition is not None:
        partition.Partition.parse(request.partition)  # a bad I/N fails before anything is read
    if request.finalize is not None and request.finalize < 1:
        raise BadInputError(f"--finalize {request.finalize}: the number of partitions must be >= 1")
    if request.compression is not None and request.compression not in codecs.CODECS:
        raise BadInputError(f"compression {request.compression!r}: expected one of {', '.join(codecs.CODECS)}")
    if request.merge_lora and not request.lora:
        raise BadInputError("--merge-lora folds an adapter into the base: give it with --lora ADAPTER_DIR")
    if request.lora_layout != "converter" and (request.merge_lora or not request.lora):
        raise BadInputError(f"--lora-layout {request.lora_layout} places an adapter written alone: give --lora "
                            "ADAPTER_DIR without --merge-lora")
    if request.lora:
        _check_paths(request.lora, request.destination)
    timer = StageTimer(sample_rss=True)
    try:
        return _plan_and_run(request, timer)
    finally:
        timer.close()  # a run that failed before its report still stops its RSS sampler thread


def _plan_and_run(request: ConvertRequest, timer: StageTimer) -> dict:
    """Plan, choose the run's options, then hold the destination and write."""
    started = destination.now()
    source = open_source(request.source, hf_token_file=request.hf_token_file)
    with timer.stage("plan"):
        plan, source = plan_for(request, source)
        options = run_options(plan, request)
        by_device = options.data_files_by_device(request.devices)
        request = dataclasses.replace(request, compression=codecs.chosen(request.compression, by_device),
                                      options=options)
        print_ = fingerprint(plan, source, request)
    if request.partition:  # partitions write side by side by design; one writer per partition, as per DST
        part = partition.Partition.parse(request.partition)
        with Destination(request.destination).hold(overwrite=request.overwrite, part="partitions",
                                                   name=part.lock_name):
            return _run(plan, source, request, timer, started, print_)
    with Destination(request.destination).hold(overwrite=request.overwrite):
        return _run(plan, source, request, timer, started, print_)


def plan_for(request: ConvertRequest, source: Source) -> tuple[ConversionPlan, Source]:
    """The plan, and the source its jobs read: the base, or for an adapter alone the adapter (``plan`` too)."""
    if request.merge_lora and not request.lora:
        raise BadInputError("--merge-lora folds an adapter into the base: give it with --lora ADAPTER_DIR")
    return _plan_for(request, source)


def run_options(plan: ConversionPlan, request: ConvertRequest) -> settings.RunOptions:
    """The request's options (else this host's defaults) for this plan: its output size (the layout chosen by size
    goes by it) and the workers the budget lets run (``estimate.choose_workers``, which says why)."""
    return estimate.choose_workers(plan, request.options or host.run_options())


def _plan_for(request: ConvertRequest, source: Source) -> tuple[ConversionPlan, Source]:
    layout_options = {"dtype": request.dtype, "scan_layers": request.scan_layers, "devices": request.devices}
    if not request.lora:
        return make_plan(source, **layout_options, multimodal=request.multimodal), source
    if request.multimodal:
        raise BadInputError("--multimodal with --lora: ckptconv converts adapters of the text decoder only; "
                            "convert the adapter without --multimodal")
    from ckptconv.plan import lora

    adapter = open_source(request.lora, hf_token_file=request.hf_token_file)
    if request.merge_lora:
        return lora.make_merged_plan(source, adapter, **layout_options), source
    return lora.make_adapter_plan(source, adapter, lora_layout=request.lora_layout, **layout_options), adapter


def _run(plan: ConversionPlan, source: Source, request: ConvertRequest, timer: StageTimer, started: str,
         print_: str) -> dict:
    """Decide about what is at the destination (skip, refuse, clean ours), then write and report."""
    dst = Destination(request.destination)
    state = destination.inspect_state(request.destination)
    if state.complete and state.report.get("fingerprint") == print_ and not request.overwrite:
        _check_layout(plan, request.destination)
        destination.drop_leftovers(request.destination)  # an --overwrite that died before its swap
        if request.finalize:
            partition.remove_staging(request.destination)  # a finalize that died after its report
        return dst.skip({**state.report, "status": Status.COMPLETE}, request.report)
    # A "writing" report is our own unfinished run (it crashed, even after Orbax's commit), and a
    # report without a checkpoint is a leftover: redo either without --overwrite, unless that run
    # is still alive. Anything else there is refused unless asked to replace it.
    report = state.report or {}
    if report.get("status") == Status.WRITING and destination.writer_alive(report):
        raise BusyError(f"{request.destination}: another conversion (pid {report['pid']} on "
                            f"{report['host']}) is writing here; wait for it or stop it")
    destination.check_ownership(request.destination, state)  # nothing below deletes what is not ours
    ours_unfinished = report.get("status") == Status.WRITING or (state.report is not None and not state.checkpoint)
    if (state.checkpoint or state.report) and not ours_unfinished and not request.overwrite:
        raise DestinationExistsError(f"{request.destination}: {_occupant(state)}; pass --overwrite to replace it")
    if request.partition:  # the finalize replaces what is at DST; a partition only adds its own part
        return _convert_partition(plan, source, request, timer, started, print_)
    if not request.finalize:  # before DST is cleared or written (a finalize reads no source tensor)
        with timer.stage("plan"):
            check_values((piece for job in plan.jobs for piece in job.pieces), source)
    adopt = None
    if request.finalize:
        records = partition.finished(request.destination, request.finalize, print_)
        adopt = partition.link_partitions(request.destination, request.finalize)
    # a finalize only links the partitions' files: no space to check
    fits_beside = bool(request.finalize) or destination.check_space(request.destination, plan.output_bytes)
    beside = _replace_beside(request, state, ours_unfinished, fits_beside)
    writing = destination.writing_report(print_, started, source={"uri": request.source})
    if beside:  # the old checkpoint stays complete, report and all, until the swap
        destination.drop_leftovers(request.destination)
    else:
        if not state.empty:
            destination.clear(request.destination)
        dst.begin(writing)
    tune_malloc()
    terms = estimate.peak_terms(plan, options=request.options)
    predicted = estimate.predicted_peak_bytes(plan, terms=terms)
    trim_only_above(estimate.trim_line(predicted, terms["heap"]))
    progress = Progress(plan.tensor_count, plan.output_bytes, request.progress)
    progress.event("plan", family=plan.family.name, tensors=plan.tensor_count, bytes=plan.output_bytes)
    target = dst.staging("replacement") if beside else request.destination
    _write(plan, source, dataclasses.replace(request, destination=target), timer, progress, adopt)
    if request.finalize:  # no tiles to stop at: a signal during the commit stops it here, before the report
        stop_if_terminated()
    progress.close()
    if beside:  # Orbax finalised the new step (its own commit): the old one leaves, the new one moves in
        dst.swap_in(target, writing,
                    retire_old=lambda: (dst.root / layout.STEP).rename(dst.root / destination.REPLACED))
    report = _report(plan, source, request, timer, started, print_)
    if request.finalize:
        report["partitions"] = [{k: record[k] for k in PARTITION_SUMMARY} for record in records]
    report["predicted_peak_terms"] = terms
    report["predicted_peak_rss_bytes"] = predicted
    report["restore"] = restore_figures(request.destination)  # after the peak: its reads are not the conversion's
    rssplot.save_beside(dst.report_path, report)  # before the report: a complete report's plot is there
    dst.commit(report, request.report)
    if beside:
        destination.drop_leftovers(request.destination)
    if request.finalize:
        partition.remove_staging(request.destination)
    progress.event("done", peak_rss_bytes=report["peak_rss_bytes"], wall_seconds=report["wall_seconds"])
    return report


def _convert_partition(plan: ConversionPlan, source: Source, request: ConvertRequest, timer: StageTimer,
                       started: str, print_: str) -> dict:
    """Write one partition's leaves into the staging directory, then its marker (see ckptconv.write.partition)."""
    from ckptconv.write import orbax as writer

    part = partition.Partition.parse(request.partition)
    done = partition.read_marker(request.destination, part)
    if (done is not None and done.get("fingerprint") == print_
            and not partition.damaged_files(request.destination, part, done)):  # else its data is redone
        return Destination(request.destination).skip(done, request.report)
    owner = partition.assign(plan, part.count)
    jobs = {j for j, p in enumerate(owner) if p == part.index}
    with timer.stage("plan"):  # its own share only, before its earlier attempt is removed
        check_values((piece for j in sorted(jobs) for piece in plan.jobs[j].pieces), source)
    partition.reset(request.destination, part)
    tune_malloc()
    chosen = [(index, leaf) for index, (j, leaf) in enumerate(
        (j, leaf) for j, job in enumerate(plan.jobs) for leaf in job.leaves) if j in jobs]
    nbytes = sum(leaf.nbytes for _, leaf in chosen)
    progress = Progress(sum(len(plan.jobs[j].pieces) for j in jobs), nbytes, request.progress)
    progress.event("plan", family=plan.family.name, partition=request.partition, leaves=len(chosen), bytes=nbytes)
    begin = timer.wall()
    writer.write_partition(
        str(partition.staging_dir(request.destination)), [leaf for _, leaf in chosen], [i for i, _ in chosen],
        lambda: produce_tiles(plan, source, timer, request.options, jobs), devices=request.devices,
        process_id=part.process_id, on_tile=lambda leaf, n: (trim_now_and_then(n), progress.advance(0, n)),
        codec=request.compression, options=request.options)
    timer.add("write", timer.wall() - begin, begin)
    progress.close()
    report = {
        "tool": f"ckptconv {__version__}", "status": Status.PARTITION_COMPLETE, "skipped": False,
        "partition": request.partition, "fingerprint": print_, "destination": request.destination,
        "leaves": len(chosen), "output_bytes": nbytes, **run_figures(timer, nbytes), "host": socket.gethostname(),
        "pid": os.getpid(), "started_at": started, "finished_at": destination.now(),
        "files": partition.file_sums(partition.data_dir(request.destination, part)),  # what finalize checks
    }
    partition.write_marker(request.destination, part, report)
    destination.write_extra_report(request.report, report)
    progress.event("done", peak_rss_bytes=report["peak_rss_bytes"], wall_seconds=report["wall_seconds"])
    return report


def _replace_beside(request: ConvertRequest, state: destination.DestinationState, ours_unfinished: bool,
                    fits_beside: bool) -> bool:
    """Whether ``--overwrite`` writes the new checkpoint beside the complete old one and swaps at the end.

    Only locally (a rename on gs:// copies every object) and only where both fit; when they do not, say
    so before the old checkpoint is deleted. A finalize only links its partitions' files, in place.
    """
    if not (request.overwrite and state.checkpoint and not ours_unfinished) or request.finalize:
        return False
    if layout.is_gcs(request.destination):
        return False
    if not fits_beside:
        log.warning("ckptconv: %s: no room for the new checkpoint beside the old one; deleting the old one "
                    "first (a failure from here on leaves no complete checkpoint at DST)", request.destination)
    return fits_beside


def _write(plan: ConversionPlan, source: Source, request: ConvertRequest, timer: StageTimer, progress: Progress,
           adopt=None) -> None:
    """Stream every tile to the writer (or adopt the partitions' data); time until the last tile is "write",
    the rest "commit"."""
    from ckptconv.write import orbax as writer

    done = [0, 0]  # bytes, tensors reported

    def on_tile(leaf, nbytes: int) -> None:
        trim_now_and_then(nbytes)
        done[0] += nbytes
        tensors = plan.tensor_count * done[0] // max(1, plan.output_bytes)
        progress.advance(tensors - done[1], nbytes)
        done[1] = tensors
        last_tile[0] = timer.wall()

    begin = timer.wall()
    last_tile = [begin]  # adopted partitions: no tiles, all of it is the commit
    endpoint = os.environ.get("TENSORSTORE_GCS_HTTP_URL") or GCS_ENDPOINT  # where tensorstore writes
    with waits.watched_writes(request.destination, endpoint) as tick:
        writer.write_checkpoint(
            request.destination, plan.leaves, lambda: produce_tiles(plan, source, timer, request.options),
            devices=request.devices, custom_metadata=_custom_metadata(plan, request),
            on_tile=lambda leaf, nbytes: (tick(), on_tile(leaf, nbytes)), codec=request.compression,
            extra_items=_extra_items(request), adopt=adopt, options=request.options,
        )
    end = timer.wall()
    timer.add("write", last_tile[0] - begin, begin)
    timer.add("commit", end - last_tile[0], last_tile[0])


def restore_figures(dst: str) -> dict:
    """What a TPU host pays to restore the checkpoint at ``dst``: from its stored layout, chunks, OCDBT data files
    and the storage reads a host restoring device 0's shard makes (:mod:`ckptconv.read.restore_cost`), and how long
    reading that shard back took from here (:mod:`ckptconv.read.restore_probe`); ``{"error": ...}`` if the layout
    cannot be read."""
    from ckptconv.read import restore_cost, restore_probe, stored

    items = str(layout.items_path(dst))
    try:
        leaves = stored.read_items_metadata(items)
    except CkptConvError as err:
        return {"error": str(err).splitlines()[0][:200]}
    figures = restore_cost.figures_or_none(items, leaves)
    if figures is not None and "error" not in figures:
        try:
            figures.update(restore_probe.time_device_read(items, leaves))
        except (ValueError, TypeError, OSError, CkptConvError) as err:  # a report field, never a reason to fail
            figures["read_error"] = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
    return figures


def _extra_items(request: ConvertRequest) -> dict:
    """MaxText's TrainState fields beside the params; none in the restore layout, whose root is the LoRA tree."""
    return {} if request.lora and request.lora_layout == "restore" else dict(MAXTEXT_EXTRA_ITEMS)


def _custom_metadata(plan: ConversionPlan, request: ConvertRequest) -> dict:
    """``scan_layers`` as MaxText's converter records it; an adapter alone also records its rank and alpha as
    MaxText's LoRA training does (``custom_metadata["lora"]``): its ``sync_lora_metadata`` and ``export`` read them."""
    metadata: dict = {"scan_layers": plan.scan_layers}
    if request.multimodal:  # verify and export read it back (MaxText reads scan_layers only)
        metadata["multimodal"] = True
    if plan.adapter is not None and not request.merge_lora:
        metadata["lora"] = {"lora_rank": plan.adapter["rank"], "lora_alpha": plan.adapter["alpha"]}
    return metadata


def _report(plan: ConversionPlan, source: Source, request: ConvertRequest, timer: StageTimer, started: str,
            print_: str) -> dict:
    return {
        "tool": f"ckptconv {__version__}",
        "status": Status.COMPLETE,
        "skipped": False,
        "source": {"uri": request.source, **source.provenance()},
        "destination": request.destination,
        "family": plan.family.name,
        "maxtext_decoder_block": plan.family.decoder_block,
        "model": plan.spec.to_json(),
        "not_converted": list(plan.not_converted),
        "dtype": request.dtype,
        "devices": request.devices,
        "compression": request.compression,
        # each OCDBT data file holds one device's chunks (as asked, else by the planned output's size)
        "data_files_by_device": request.options.data_files_by_device(request.devices),
        # the workers and memory budget it ran with, what the host had, and why (ckptconv.plan.estimate.choose_workers)
        "run": request.options.to_json(),
        "scan_layers": plan.scan_layers,
        "multimodal": request.multimodal,
        "tensors": plan.tensor_count,
        "leaves": len(plan.leaves),
        "source_bytes": plan.source_bytes,
        "output_bytes": plan.output_bytes,
        "largest_shard_bytes": plan.largest_shard_bytes,
        **run_figures(timer, plan.output_bytes),
        **({"lora": {"adapter": request.lora, "mode": "merged" if request.merge_lora else "adapter",
                     "layout": None if request.merge_lora else request.lora_layout,
                     "rank": plan.adapter["rank"], "alpha": plan.adapter["alpha"],
                     "targets": plan.adapter["targets"]}} if plan.adapter is not None else {}),
        "fingerprint": print_,
        "started_at": started,
        "finished_at": destination.now(),
        "pid": os.getpid(),
    }


def _check_paths(source: str, target: str) -> None:
    """Before any work: no empty or root destination (an unset shell variable must not mean "here"),
    and source and destination apart (the destination's step is what a rerun replaces)."""
    if not target.strip():
        raise BadInputError("the destination is empty (an unset shell variable?); give a directory or gs:// URI")
    if "://" not in target and os.path.realpath(target) == os.path.realpath(os.sep):
        raise BadInputError(f"{target!r}: the filesystem root cannot be a destination")
    if "://" in source or "://" in target:
        a, b = source.rstrip("/") + "/", target.rstrip("/") + "/"
    else:
        a, b = os.path.realpath(source) + os.sep, os.path.realpath(target) + os.sep
    if a.startswith(b) or b.startswith(a):
        raise BadInputError(f"{target}: the destination and the source {source} overlap (one holds the other); "
                            "convert into a directory of its own")


def _check_layout(plan: ConversionPlan, dst: str) -> None:
    """A complete checkpoint of this source and these options may still be in a layout an earlier
    ckptconv wrote (DeepSeek's router bias in ``params/MoEBiasVar``, which MaxText's from_pretrained
    never restores): the fingerprint covers what is read, not where it goes. Refused, not skipped."""
    from ckptconv.read.stored import read_items_metadata

    stored = {leaf.path for leaf in read_items_metadata(layout.items_path(dst).as_posix())}
    missing = sorted(leaf.name for leaf in plan.leaves if leaf.path not in stored)
    if missing:
        raise DestinationExistsError(f"{dst}: converted from this source by an earlier ckptconv, in another layout "
                                     f"(no leaf {missing[0]!r}); pass --overwrite to convert it again")


def _occupant(state: destination.DestinationState) -> str:
    return "holds a checkpoint converted from a different source or with different options"
