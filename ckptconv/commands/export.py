"""``export``: a MaxText Orbax checkpoint back to HF safetensors, streamed, on the same family data.

Wiring only: the plan (:mod:`ckptconv.plan.export`) checks the checkpoint against ``--like``;
each job's read units (the conversion's own tile plan) are read from the stored leaves by
tensorstore, a band or a group of layers at a time, never a whole stacked leaf; each rule's
steps are undone (:func:`ckptconv.families.transforms.apply_inverse`) and the HF bytes appended to
safetensors files written header first (:mod:`ckptconv.write.safetensors`).

Commit (the destination protocol, :mod:`ckptconv.write.destination`): locally everything is
written into the staging directory ``DST/.ckptconv-pending`` (shards as ``*.partial`` until whole)
while the report says ``writing``; then the files move into ``DST`` and the report, written last,
says ``complete``. On gs:// each file is written to its final name (an object exists only once
whole) and the report commits. A rerun with the same checkpoint, ``--like`` and options skips a
complete export and, after a crash, keeps every shard already whole.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ckptconv import __version__, host, layout, settings, storage_failures
from ckptconv.errors import INCOMPLETE, BadInputError, DestinationExistsError, stop_if_terminated
from ckptconv.families.inputs import FP8_KEPT, Joined, StackedExperts
from ckptconv.families.tiles import leaf_region, source_reads
from ckptconv.families.transforms import apply_inverse, box_shape, box_slices, forward_boxes, inverse_boxes
from ckptconv.monitor import StageTimer, peak_rss_bytes, run_figures, trim_now_and_then, trim_only_above, tune_malloc
from ckptconv.plan import estimate, lora
from ckptconv.plan.export import (
    ExportPlan, check_recorded_model, choose_workers, make_export_plan, peak_terms,
)
from ckptconv.progress import Progress
from ckptconv.read import waits
from ckptconv.read import open_source
from ckptconv.units import parse_size
from ckptconv.read.gcs import GCS_ENDPOINT
from ckptconv.read.sources import Source
from ckptconv.read.stored import StoredLeaf, open_leaf_checked, read_items_metadata, read_leaf_region
from ckptconv.settings import Status
from ckptconv.write import destination, lock
from ckptconv.write.destination import STAGING, Destination
from ckptconv.write.produce import in_order  # convert's ordered pool, reused
from ckptconv.write.produce import prefetch
from ckptconv.write.safetensors import (
    INDEX_NAME, PARTIAL, FileLayout, StreamedFile, finished, index_json, shard_layouts,
)

PENDING = STAGING["export"]
log = logging.getLogger("ckptconv")
KIND = "export"
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # a PEFT adapter's files
# Files a HF model directory carries besides weights and config.json, copied from --like when present.
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                "chat_template.json")
Chunk = tuple[str, np.ndarray]  # (HF tensor name, its next bytes in row-major order)


@dataclass(frozen=True)
class ExportRequest:
    """The CLI's words: which checkpoint, where to, which HF model it is, and the output format."""

    checkpoint: str
    destination: str
    like: str
    dtype: str = settings.DTYPE
    shard_size: str = settings.SHARD_SIZE
    report: str | None = None
    overwrite: bool = False
    progress: str = settings.PROGRESS
    hf_token_file: str | None = None
    lora_alpha: float | None = None  # a LoRA adapter checkpoint that does not record its alpha
    options: settings.RunOptions | None = None  # --workers, --memory-budget and the host (None: this host's defaults)


def items_dir(checkpoint: str) -> str:
    """The Orbax PyTree to read: ``CKPT`` itself, or ``CKPT/items``, or ``CKPT/0/items`` (a convert output)."""
    root = layout.path(layout.absolute(checkpoint))
    for candidate in (root, root / "items", root / layout.STEP / "items"):
        if (candidate / "_METADATA").exists():
            return candidate.as_posix()
    raise BadInputError(f"{checkpoint}: no Orbax checkpoint (_METADATA) here, in items/ or in 0/items/")


def _check_like_against_report(items: str, plan: ExportPlan, like: str) -> None:
    """Where the checkpoint is a ``convert`` output (``CKPT/0/items`` beside ``CKPT/ckptconv-report.json``),
    ``--like`` must describe the model its report says it was converted from."""
    root = layout.path(items)
    if root.name != "items" or root.parent.name != layout.STEP:
        return
    report_path = root.parent.parent / layout.REPORT_NAME
    report = destination.read_report(report_path)
    if report and report.get("kind") != KIND and isinstance(report.get("model"), dict):
        check_recorded_model(plan.spec, report["model"], like, report_path.as_posix(),
                             same_tool=report.get("tool") == f"ckptconv {__version__}")


def export(request: ExportRequest) -> dict:
    """Run one export; returns the report (also written into the destination). A storage refusal
    leaves as one :class:`StorageError` line, a damaged checkpoint as one naming it."""
    with storage_failures.translated(INCOMPLETE):
        return _export(request)


def _export(request: ExportRequest) -> dict:
    request = dataclasses.replace(request, destination=layout.absolute(request.destination))
    if layout.is_hub(request.destination):
        return _export_to_hub(request)
    if "://" in request.destination and not layout.is_gcs(request.destination):
        raise BadInputError(f"{request.destination}: export writes local directories, gs:// and hf:// only")
    if "://" not in request.destination and os.path.exists(request.destination) and not os.path.isdir(
            request.destination):
        raise BadInputError(f"{request.destination}: not a directory; HF_DST must be a directory (new or ours)")
    destination.check_report_path(request.report, {"destination": request.destination,
                                                   "checkpoint": request.checkpoint, "--like model": request.like})
    return _export_planned(request, _plan(request))


@dataclass(frozen=True)
class _Planned:
    """An export planned and fingerprinted, before anything is written anywhere."""

    items: str
    plan: ExportPlan
    like: Source
    layouts: tuple[FileLayout, ...]
    fingerprint: str
    timer: StageTimer
    started: str


def _plan(request: ExportRequest) -> _Planned:
    timer, started = StageTimer(), destination.now()
    with timer.stage("plan"):
        items = items_dir(request.checkpoint)
        stored = read_items_metadata(items)
        like = open_source(request.like, hf_token_file=request.hf_token_file)
        if lora.is_adapter(stored):  # a LoRA adapter alone: PEFT's two files
            alpha = request.lora_alpha if request.lora_alpha is not None else _recorded_alpha(items)
            plan = lora.make_adapter_export_plan(like, stored, alpha, dtype=request.dtype, where=request.checkpoint)
            layouts = (FileLayout(ADAPTER_WEIGHTS, plan.tensors),)
        else:
            plan = make_export_plan(like, stored, dtype=request.dtype, where=request.checkpoint)
            layouts = shard_layouts(list(plan.tensors), parse_size(request.shard_size, "--shard-size"))
        _check_like_against_report(items, plan, request.like)
        print_ = fingerprint(items, stored, plan, request)
    return _Planned(items, plan, like, layouts, print_, timer, started)


def _export_planned(request: ExportRequest, planned: _Planned) -> dict:
    """The export into a local directory or gs://: skipped if done, else written under the lock."""
    dst = Destination(request.destination)
    previous = dst.report()
    if (_complete(dst.uri, previous, planned.layouts) and previous.get("fingerprint") == planned.fingerprint
            and not request.overwrite):
        return dst.skip(previous, request.report)
    with dst.hold(overwrite=request.overwrite):  # as convert: one writer per directory, across hosts
        return _write(request, planned.plan, planned.like, planned.items, planned.layouts, planned.fingerprint,
                      planned.timer, planned.started)


def _export_to_hub(request: ExportRequest) -> dict:
    """``hf://org/repo[@branch]``: the export staged in a local directory of ours (resumable like
    any export), then uploaded file by file and committed once (:mod:`ckptconv.write.hub`).

    Bad input (no token, a repo the token may not write, a tag or commit for a branch, files not
    ours without ``--overwrite``) is refused before anything is exported or uploaded. The staging
    directory is removed once the commit has landed.
    """
    from ckptconv.write.hub import HubDestination, export_record, stage_file

    destination.check_report_path(request.report, {"checkpoint": request.checkpoint, "--like model": request.like})
    target = HubDestination(request.destination, request.hf_token_file)  # no token: refused before any work
    planned = _plan(request)  # a checkpoint or --like that cannot be exported: refused before the Hub is touched
    target.look()  # creates a missing repo: only once the export is known to be possible
    if target.holds(planned.fingerprint) and not request.overwrite:
        report = {**target.record, "destination": request.destination, "skipped": True,
                  "hub": {"repo": target.repo, "branch": target.branch, "commit": target.head}}
        destination.write_extra_report(request.report, report)
        return report
    target.check_replaceable(planned.fingerprint, request.overwrite)
    staging = hub_staging(target.repo, target.branch)
    os.makedirs(os.path.dirname(staging), exist_ok=True)
    with lock.hold(os.path.dirname(staging), name=f"{os.path.basename(staging)}.lock"):
        staged_report = destination.read_report(layout.path(staging) / layout.REPORT_NAME)
        if staged_report is None or staged_report.get("fingerprint") != planned.fingerprint:
            shutil.rmtree(staging, ignore_errors=True)  # ours: staging of another export to this repo
        local = _export_planned(dataclasses.replace(request, destination=staging, report=None, overwrite=False),
                                planned)
        if request.progress != "bar":  # huggingface_hub's bars would break a program's jsonl or a log
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        started = time.monotonic()
        log.info("ckptconv: %s: staged in %s; hashing and uploading, then one commit", request.destination, staging)
        staged = [stage_file(name, os.path.join(staging, name)) for name in sorted(os.listdir(staging))
                  if _export_file(name) and not name.endswith(PARTIAL)]
        facts = {key: local[key] for key in RECORDED if key in local}
        record = export_record(planned.fingerprint, staged, facts)
        message = f"ckptconv export: {local['family']}, {local['tensors']} tensors, {local['dtype']}"
        hub_figures = target.commit(staged, record, _export_file, message)
        upload_seconds = time.monotonic() - started
        shutil.rmtree(staging)
    report = {**local, "skipped": False, "destination": request.destination, "hub": hub_figures,
              "stage_seconds": {**local["stage_seconds"], "upload": round(upload_seconds, 3)},
              "wall_seconds": round(local["wall_seconds"] + upload_seconds, 3), "finished_at": destination.now(),
              "peak_rss_bytes": peak_rss_bytes()}  # the upload's too
    destination.write_extra_report(request.report, report)
    return report


# What the Hub's record keeps of the export's report: the model and the figures, no local path or host.
RECORDED = ("family", "model", "scan_layers", "dtype", "shard_size", "tensors", "output_bytes", "not_exported",
            "stage_seconds", "wall_seconds", "cpu_seconds", "peak_rss_bytes", "finished_at")


def hub_staging(repo: str, branch: str) -> str:
    """Where an export to ``repo@branch`` is staged: one directory per repo and branch, so a rerun
    after a failure finds (and resumes) its own files."""
    root = os.path.expanduser(os.environ.get(settings.HUB_STAGING_ENV) or settings.HUB_STAGING)
    return os.path.join(os.path.abspath(root), f"{repo}@{branch}".replace("/", "--"))


def _write(request: ExportRequest, plan: ExportPlan, like: Source, items: str, layouts: tuple[FileLayout, ...],
           print_: str, timer: StageTimer, started: str) -> dict:
    """Under the destination's lock: decide about what is there, stream the files, commit, report."""
    target = Destination(request.destination)
    dst = target.uri
    # on gs:// the files go to their final names: an object appears only when whole, and a rename
    # would copy every byte; the report still commits
    pending = dst if layout.is_gcs(dst) else target.staging("export")
    previous = target.report()  # as the lock found it
    copied = _read_copied_files(like)  # before anything at dst is cleared: --like may be dst itself
    replacing = _prepare(dst, pending, previous, print_, request.overwrite, plan.output_bytes)
    writing = destination.writing_report(print_, started, kind=KIND)
    target.begin(writing, at=pending if replacing else None)
    tune_malloc()
    progress = Progress(len(plan.tensors), plan.output_bytes, request.progress, desc="export")
    progress.event("plan", family=plan.family.name, tensors=len(plan.tensors), bytes=plan.output_bytes)
    # beside an old export, a file of the same name and layout at dst is the old one, not ours;
    # on gs:// pending is dst, looked at once
    places = {pending} if replacing else {pending, dst}
    done = {file_layout.name for file_layout in layouts if any(finished(place, file_layout) for place in places)}
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or GCS_ENDPOINT  # where gcsfs uploads
    options = choose_workers(plan, request.options or host.run_options())
    terms = peak_terms(plan, options)
    predicted = sum(terms.values())
    trim_only_above(estimate.trim_line(predicted, terms["heap"]))
    with waits.watched_writes(dst, endpoint) as tick:
        _write_shards(plan, items, layouts, done, pending, timer, progress, tick, options)
        with timer.stage("commit"):
            _write_small_files(plan, copied, pending, layouts)
            if replacing:
                target.swap_in(pending, writing, retire_old=lambda: _remove_export_files(dst))
            elif pending != dst:  # gs://: written in place
                target.move_in(pending)
    progress.close()
    report = {**_report(plan, request, items, layouts, timer, started, print_), "workers": options.workers,
              "workers_why": options.why,
              "predicted_peak_rss_bytes": predicted}
    target.commit(report, request.report)
    progress.event("done", peak_rss_bytes=report["peak_rss_bytes"], wall_seconds=report["wall_seconds"])
    return report


def fingerprint(items: str, stored: list[StoredLeaf], plan: ExportPlan, request: ExportRequest) -> str:
    """Identity of (checkpoint as far as cheaply knowable, --like's config, options)."""
    manifest = layout.path(items) / "manifest.ocdbt"
    if "://" in items:  # no nanoseconds on gs://
        stat = manifest.stat() if manifest.exists() else None
        written = None if stat is None else [stat.length, stat.mtime]
    else:
        local = os.stat(manifest) if manifest.exists() else None
        written = None if local is None else [local.st_size, local.st_mtime_ns]
    identity = {"items": items, "manifest": written,
                "leaves": [(leaf.name, leaf.shape, leaf.dtype) for leaf in stored],
                "config": plan.config_text, "options": [request.dtype, request.shard_size], "format": 1}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


# --- destination ---------------------------------------------------------------------------

def _complete(dst: str, report: dict | None, layouts: tuple[FileLayout, ...]) -> bool:
    return (report is not None and report.get("kind") == KIND and report.get("status") == Status.COMPLETE
            and all(finished(dst, file_layout) for file_layout in layouts))


def _prepare(dst: str, pending: str, previous: dict | None, print_: str, overwrite: bool, needed: int) -> bool:
    """Decide what to do with what is at ``dst``: resume our own unfinished run, clear ours, refuse the rest.

    Returns whether the new export is written beside a complete old one of ours, which then stays
    complete (and its report says so) until the new files are whole: as ``convert --overwrite``
    does, when the disk has room for both; when it has not, it says so before deleting anything.
    """
    ours = previous is not None and previous.get("kind") == KIND
    if ours and previous.get("status") == Status.COMPLETE and previous.get("fingerprint") != print_ and not overwrite:
        raise DestinationExistsError(f"{dst}: holds an export of another checkpoint or with other options; "
                                     "pass --overwrite to replace it")
    root = layout.path(dst)
    ignored = (PENDING, lock.LOCK_NAME)  # and a lock's private name, the moment before it is linked
    occupied = root.is_dir() and any(not (p.name in ignored or p.name.startswith(f".{lock.LOCK_NAME}."))
                                     for p in root.iterdir())
    if occupied and not ours and not overwrite:
        raise DestinationExistsError(f"{dst}: not empty and not an export of ours; pass --overwrite to replace "
                                     "its weights, config and tokenizer files")
    if not ours and not overwrite and pending != dst and _foreign_pending(pending):
        raise BadInputError(f"{pending}: not written by this export (no {layout.REPORT_NAME} of ours at "
                            f"{dst} or in it), so not removed; move it away or pass --overwrite")
    if ours and previous.get("status") == Status.COMPLETE and pending != dst:
        beside = destination.read_report(layout.path(pending) / layout.REPORT_NAME)
        if not (beside and beside.get("fingerprint") == print_):  # else resume the replacement a crash left
            shutil.rmtree(pending, ignore_errors=True)
        if shutil.disk_usage(dst).free >= needed:
            os.makedirs(pending, exist_ok=True)
            return True
        log.warning("ckptconv: %s: no room for the new export beside the old one; deleting the old one first "
                    "(a failure from here on leaves no complete export at DST)", dst)
    resuming = ours and previous.get("status") == Status.WRITING and previous.get("fingerprint") == print_
    if not resuming:  # the report first, then our staging directory and the files an export writes
        if layout.path(dst).is_dir():
            Destination(dst).clear(lambda name: name == PENDING or _export_file(name))
    layout.path(pending).mkdir(parents=True, exist_ok=True)
    return False


def _foreign_pending(pending: str) -> bool:
    """A non-empty pending directory no report of an export vouches for (ours holds our report
    from its first write on; an empty one is what a crash right after creating it leaves)."""
    root = layout.path(pending)
    if not root.is_dir() or not any(root.iterdir()):
        return False
    report = destination.read_report(root / layout.REPORT_NAME)
    return not (report and report.get("kind") == KIND)


def _export_file(name: str) -> bool:
    """A name at HF_DST that an export writes: weights, index, config and tokenizer files."""
    return (name.endswith((".safetensors", PARTIAL))
            or name in (INDEX_NAME, "config.json", ADAPTER_CONFIG, *COPIED_FILES))


def _remove_export_files(dst: str) -> None:
    """The files an export writes at ``dst`` (never its staging directory): an old export retired."""
    for file in layout.path(dst).iterdir():
        if _export_file(file.name):
            file.unlink()


def _recorded_alpha(items: str) -> float | None:
    """The adapter's alpha as its checkpoint records it (``custom_metadata["lora"]``, as ``convert --lora`` and
    MaxText's LoRA training write it), if it does."""
    step = layout.path(items).parent / "_CHECKPOINT_METADATA"
    try:
        recorded = json.loads(step.read_text()).get("custom_metadata") or {}
    except (FileNotFoundError, ValueError):
        return None
    alpha = (recorded.get("lora") or {}).get("lora_alpha") if isinstance(recorded.get("lora"), dict) else None
    return float(alpha) if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0 else None


def _read_copied_files(like: Source) -> dict[str, bytes]:
    """``--like``'s tokenizer and generation files (a few MB at most), read before ``HF_DST`` is
    prepared: when ``--like`` is ``HF_DST`` itself, ``--overwrite`` clears them there first."""
    return {name: bytes(like.read_range(name, 0, like.size(name))) for name in COPIED_FILES if like.exists(name)}


def _write_small_files(plan: ExportPlan, copied: dict[str, bytes], pending: str,
                       layouts: tuple[FileLayout, ...]) -> None:
    """The index, ``config.json`` (dequantised: without ``quantization_config``) and the tokenizer files."""
    root = layout.path(pending)
    if plan.adapter is not None:  # a PEFT adapter: its config beside its weights, the base's files stay the base's
        (root / ADAPTER_CONFIG).write_text(json.dumps(lora.peft_config(plan), indent=2) + "\n")
        return
    (root / INDEX_NAME).write_text(index_json(layouts))
    (root / "config.json").write_text(_config_text(plan))
    for name, data in copied.items():
        (root / name).write_bytes(data)


def _config_text(plan: ExportPlan) -> str:
    """``--like``'s config as it was, unless the weights' format changed: no ``quantization_config``
    for dequantised weights, ``torch_dtype`` saying the dtype written."""
    config = dict(plan.config)
    if plan.spec.values.get("quantization") != FP8_KEPT:  # kept quantised: written back as the release stores it
        config.pop("quantization_config", None)
        config.pop("expert_dtype", None)  # DeepSeek-V4's FP4 experts: dequantised now like every other weight
        if isinstance(config.get("text_config"), dict) and "quantization_config" in config["text_config"]:
            # a multimodal wrapper's (Kimi-K2.5's): the text decoder's quantization_config is in text_config
            config["text_config"] = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    dtype_name = plan.dtype.name
    for key in ("torch_dtype", "dtype"):
        if key in config and config[key] != dtype_name:
            config[key] = dtype_name
    return plan.config_text if config == plan.config else json.dumps(config, indent=2) + "\n"


# --- streaming -----------------------------------------------------------------------------

def _write_shards(plan: ExportPlan, items: str, layouts: tuple[FileLayout, ...], done: set[str], pending: str,
                  timer: StageTimer, progress: Progress, tick=lambda: None,
                  options: settings.RunOptions | None = None) -> None:
    """Stream every HF tensor into its file; files already whole (a resumed run) are not read again. With
    ``options.workers`` > 1 that many reads are read and transformed at once (the conversion producer's ordered pool,
    ``ckptconv.write.produce.in_order``), their tensors still written in the plan's order: the same files."""
    file_of = {entry.name: file_layout for file_layout in layouts for entry in file_layout.tensors}
    skip = {entry.name for file_layout in layouts if file_layout.name in done for entry in file_layout.tensors}
    workers = options.workers if options else 1
    if workers <= 1:
        chunks = prefetch(lambda: export_chunks(plan, items, timer, skip))
    else:
        chunks = in_order(export_reads(plan, items, timer, skip), workers, workers + options.in_flight.prefetch)
    current: StreamedFile | None = None
    last = [None]
    try:
        for name, data in chunks:
            file_layout = file_of[name]
            if file_layout.name in done:
                continue
            with timer.stage("write"):
                if current is None or current.layout is not file_layout:
                    if current is not None:
                        current.close()
                    current = StreamedFile(pending, file_layout)
                current.append(name, data)
            tick()  # the bytes were taken: a gs:// upload is not stalled
            progress.advance(int(name != last[0]), data.nbytes)
            trim_now_and_then(data.nbytes)
            last[0] = name
        if current is not None:
            with timer.stage("write"):
                current.close()
                current = None
    finally:
        chunks.close()
        if current is not None:
            current.abandon()


def export_chunks(plan: ExportPlan, items: str, timer: StageTimer, skip: set[str] = frozenset()) -> Iterator[Chunk]:
    """Every HF tensor's bytes in writing order, job by job, read by read."""
    for read in export_reads(plan, items, timer, skip):
        yield from read()


def export_reads(plan: ExportPlan, items: str, timer: StageTimer,
                 skip: set[str] = frozenset()) -> Iterator[Callable[[], list[Chunk]]]:
    """One maker per read of the stored leaves (a read unit of the conversion's tile plan), in writing order: each
    reads its regions and returns the HF tensors' bytes made of them. Independent of each other, so that several
    threads can run them (``_write_shards``); a leaf is opened by the first read of it."""
    for job in plan.jobs:
        stores = [_Lazy(lambda leaf=leaf: open_leaf_checked(items, leaf.path)) for leaf in job.leaves]
        if isinstance(job.pieces[0], Joined):
            yield from _joined_reads(plan, job, items, stores, timer, skip)
            continue
        if isinstance(job.pieces[0], StackedExperts):
            yield from _expert_reads(plan, job, items, stores, timer, skip)
            continue
        names = [plan.hf_names[piece.name] for piece in job.pieces]
        if all(name in skip for name in names):
            continue
        for members, box in source_reads(job.tiling, job.source_shape, job.positions):
            if all(names[i] in skip for i in members):
                continue
            yield functools.partial(_read_members, plan, job, items, stores, timer, names, members, box)


def _read_members(plan: ExportPlan, job, items: str, stores: list, timer: StageTimer, names: list[str],
                  members, box) -> list[Chunk]:
    """The HF tensors ``members`` (of a job's pieces) hold in ``box``, from one read of every leaf of the job."""
    stop_if_terminated()
    where = [job.positions[i] for i in members]
    with timer.stage("read"):
        regions = _leaf_regions(plan, job, items, stores, where, box)
    chunks = []
    for n, index in enumerate(members):
        with timer.stage("transform"):
            out = np.empty(box_shape(box), job.pieces[index].dtype)
            for leaf, shape, region in zip(job.leaves, job.shapes, regions):
                piece = region[_member(shape.stack_axes, len(region.shape), n)]
                apply_inverse(piece, leaf.steps, plan.spec,
                              inverse_boxes(box, job.source_shape, leaf.steps, plan.spec), out)
        chunks.append((names[index], out))
    return chunks


def _leaf_regions(plan: ExportPlan, job, items: str, stores: list, where: list, box) -> list[np.ndarray]:
    """What each of the job's leaves holds of the HF region ``box`` of the pieces at ``where``."""
    regions = []
    for k, (leaf, shape) in enumerate(zip(job.leaves, job.shapes)):
        image = forward_boxes(box, job.source_shape, leaf.steps, plan.spec)[-1] if leaf.steps else box
        region = leaf_region(shape, where, image)
        if any(stop <= start for start, stop in region):  # rows MaxText does not hold
            regions.append(np.zeros(box_shape(region), leaf.dtype))
        else:
            regions.append(read_leaf_region(items, leaf.name, stores[k].get(), box_slices(region)))
    return regions


def _joined_reads(plan: ExportPlan, job, items: str, stores: list, timer: StageTimer,
                  skip: set[str]) -> Iterator[Callable[[], list[Chunk]]]:
    """A fused leaf (Qwen3.5's in_proj_qkvz) written back as the parts the hub stores: each part in
    its own row order, one group's share of one section (a run of fused rows) a read."""
    rest = tuple((0, dim) for dim in job.source_shape[1:])
    for index, piece in enumerate(job.pieces):
        runs = piece.runs()
        for k, part in enumerate(piece.parts):
            name = plan.hf_names[part.name]
            if name in skip:
                continue
            for _, _, fused, rows in sorted((r for r in runs if r[0] == k), key=lambda r: r[1]):
                box = ((fused, fused + rows), *rest)
                yield functools.partial(_read_joined, plan, job, items, stores, timer, index, part, name, box)


def _read_joined(plan: ExportPlan, job, items: str, stores: list, timer: StageTimer, index: int, part, name: str,
                 box) -> list[Chunk]:
    return [(name, _read_piece(plan, job, items, stores, timer, index, box, part.dtype))]


def _read_piece(plan: ExportPlan, job, items: str, stores: list, timer: StageTimer, index: int, box,
                dtype) -> np.ndarray:
    """The job's piece ``index`` (a fused leaf's part, a layer's experts) in ``box``, in ``dtype``: one read of every
    leaf of the job, turned back by their steps."""
    stop_if_terminated()
    with timer.stage("read"):
        regions = _leaf_regions(plan, job, items, stores, [job.positions[index]], box)
    with timer.stage("transform"):
        out = np.empty(box_shape(box), dtype)
        for leaf, shape, region in zip(job.leaves, job.shapes, regions):
            apply_inverse(region[_member(shape.stack_axes, len(region.shape), 0)], leaf.steps, plan.spec,
                          inverse_boxes(box, job.source_shape, leaf.steps, plan.spec), out)
    return out


def _expert_reads(plan: ExportPlan, job, items: str, stores: list, timer: StageTimer,
                  skip: set[str]) -> Iterator[Callable[[], list[Chunk]]]:
    """A layer's fused experts (Qwen3.5's gate_up_proj) written back as an FP8 release stores them: one
    expert a read, its parts (gate, then up) one after the other."""
    rest = tuple((0, dim) for dim in job.source_shape[1:])
    for index, piece in enumerate(job.pieces):
        for e in range(piece.shape[0]):
            parts = piece.parts[e * piece.per_expert:(e + 1) * piece.per_expert]
            names = [plan.hf_names[part.name] for part in parts]
            if all(name in skip for name in names):
                continue
            yield functools.partial(_read_expert, plan, job, items, stores, timer, index, piece, parts, names,
                                    ((e, e + 1), *rest), skip)


def _read_expert(plan: ExportPlan, job, items: str, stores: list, timer: StageTimer, index: int, piece, parts,
                 names: list[str], box, skip: set[str]) -> list[Chunk]:
    rows = piece.parts[0].shape[0]
    out = _read_piece(plan, job, items, stores, timer, index, box, parts[0].dtype)
    return [(name, np.ascontiguousarray(out[0, k * rows:(k + 1) * rows])) for k, name in enumerate(names)
            if name not in skip]


def _member(stack_axes: tuple[int, ...], ndim: int, n: int) -> tuple:
    """Index of the ``n``-th piece of a read in its leaf region (stack axes dropped)."""
    index: list = [slice(None)] * ndim
    for axis in stack_axes[:-1]:
        index[axis] = 0
    if stack_axes:
        index[stack_axes[-1]] = n
    return tuple(index)


class _Lazy:
    """A leaf handle opened at its first read (a resumed run skips most leaves), by whichever worker reads it first."""

    def __init__(self, open_: Callable[[], object]) -> None:
        self._open, self._value, self._lock = open_, None, threading.Lock()

    def get(self):
        with self._lock:
            if self._value is None:
                self._value = self._open()
            return self._value


# --- report --------------------------------------------------------------------------------

def _report(plan: ExportPlan, request: ExportRequest, items: str, layouts: tuple[FileLayout, ...],
            timer: StageTimer, started: str, print_: str) -> dict:
    return {
        "tool": f"ckptconv {__version__}",
        "kind": KIND,
        "status": Status.COMPLETE,
        "skipped": False,
        "checkpoint": items,
        "like": request.like,
        "destination": request.destination,
        "family": plan.family.name,
        "model": plan.spec.to_json(),
        "scan_layers": plan.scan_layers,
        "not_exported": list(plan.not_exported),
        "dtype": request.dtype,
        "tensors": len(plan.tensors),
        "files": [file_layout.name for file_layout in layouts],
        "output_bytes": plan.output_bytes,
        "shard_size": request.shard_size,
        **run_figures(timer, plan.output_bytes),
        "fingerprint": print_,
        "started_at": started,
        "finished_at": destination.now(),
        "pid": os.getpid(),
    }
