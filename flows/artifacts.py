"""What a conversion leaves in Prefect, under stable keys: one page for people, the rest for machines.

Per model (``<slug>`` from the model's name or destination):

- ``conversion-<slug>`` (markdown), the one to read: status and headline, the RSS plot (RSS over
  time, predicted and measured peaks, stages as bands), the stage table in human units with the
  wall time beside it, where the output is and how it was verified;
- ``conversion-<slug>-progress`` (made by the conversion task while it runs);
- ``conversion-<slug>-row`` (a one-row table with raw figures: a zoo that dispatched the run reads it back);
- ``conversion-<slug>-restore-check`` (a one-row table, on a pool that asks for it: the checkpoint restored onto
  the worker's accelerator, restore seconds, GiB/s, device memory, host peak RSS, every leaf checked there).

Per zoo run: ``zoo-<name>`` (markdown: one line per model, eight columns, each linking to the model's
page) and ``zoo-<name>-rows`` (the same rows with every raw field, as a table). Builders are pure;
the tasks only publish.
"""

from __future__ import annotations

import os

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.settings import get_current_settings

from ckptconv import rssplot
from ckptconv.settings import STAGES, Status
from ckptconv.units import human_bytes, human_seconds
from tasks.job import Conversion, slugify

MIB = 1024**2
OVERLAP_NOTE = ("Read and transform run in a background thread while the writer writes, so their busy "
                "times overlap the write's and the stages add up to more than the wall time. Time in no "
                "band is start-up (loading JAX and Orbax) and waiting.")
ERROR_CHARS = 160  # an error in the zoo table is one line; the model's own run has the rest


def stage_rows(report: dict) -> list[dict]:
    """One row per stage (busy seconds, bytes moved, rate), then the wall time with the conversion's peak RSS.

    The peak is the conversion process's own high-water mark (VmHWM). A skipped run describes the
    conversion that wrote the checkpoint (its report's figures).
    """
    moved = {"read": report["source_bytes"], "transform": report["output_bytes"], "write": report["output_bytes"]}
    rows = [{"stage": stage, "seconds": seconds, "bytes": moved.get(stage),
             "mib_per_s": rate_mib_per_s(moved.get(stage), seconds), "peak_rss_bytes": None}
            for stage, seconds in ordered_stages(report["stage_seconds"])]
    rows.append({"stage": "total (wall)", "seconds": report["wall_seconds"], "bytes": report["output_bytes"],
                 "mib_per_s": rate_mib_per_s(report["output_bytes"], report["wall_seconds"]),
                 "peak_rss_bytes": report["peak_rss_bytes"]})
    return rows


def headline(report: dict, predicted: int | None) -> str:
    """``1.1 GiB in 6.4 s, peak RSS 340 MiB (80% of the predicted 428 MiB)``."""
    peak = report.get("peak_rss_bytes")
    share = f" ({peak / predicted:.0%} of the predicted {human_bytes(predicted)})" if peak and predicted else ""
    return (f"{human_bytes(report.get('output_bytes'))} in {human_seconds(report.get('wall_seconds'))}, "
            f"peak RSS {human_bytes(peak)}{share}")


def summary_markdown(job: Conversion, plan: dict, report: dict, verified: dict | None, sharding: str,
                     restored: dict | None = None) -> str:
    """The model's page: status and headline, the plot, the stage table (with wall time), output, details."""
    predicted = plan.get("predicted_peak_rss_bytes")
    status = "skipped: a complete, identical conversion was already there" if report.get("skipped") else "converted"
    origin = " (the figures are those of the conversion that wrote it)" if report.get("skipped") else ""
    svg = rssplot.render_report(report, predicted)
    plot = (f"![RSS over time, predicted peak and stages]({rssplot.data_uri(svg)})\n\n" if svg
            else "_(no RSS timeline in this report)_\n\n")
    parts = [f"## Conversion `{job.slug}`: {status}\n",
             f"**{headline(report, predicted)}**{origin}. Verify: {_verify_text(verified, report)}\n"
             + (f"\nOn the accelerator: {restore_check_text(restored)}\n" if restored else ""),
             f"Output: [{job.destination}]({output_link(job.destination)}) (MaxText: "
             f"`load_parameters_path={job.destination.rstrip('/')}/0/items`)\n",
             plot + f"### Stages\n\n{OVERLAP_NOTE}\n\n{_stage_table(report)}\n",
             "### Details\n\n| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in _details(
                 job, report, predicted, verified, sharding, status, restored)) + "\n"]
    return "\n".join(parts)


def _stage_table(report: dict) -> str:
    lines = ["| stage | busy | moved | rate |", "|---|---|---|---|"]
    for row in stage_rows(report):
        wall = row["stage"] == "total (wall)"
        name = "**wall time**" if wall else row["stage"]
        seconds = f"**{human_seconds(row['seconds'])}**" if wall else human_seconds(row["seconds"])
        rate = "-" if row["mib_per_s"] is None else f"{human_bytes(row['mib_per_s'] * MIB)}/s"
        lines.append(f"| {name} | {seconds} | {human_bytes(row['bytes'])} | {rate} |")
    return "\n".join(lines)


def _details(job: Conversion, report: dict, predicted: int | None, verified: dict | None, sharding: str,
             status: str, restored: dict | None = None) -> list[tuple[str, str]]:
    source = report["source"]
    # a local source's per-file fingerprint details stay in the report
    provenance = ", ".join(f"{k} {v}" for k, v in source.items() if k not in ("uri", "files")) or "-"
    admission = report.get("admission") or {}
    cpu = report.get("cpu_seconds_per_gib")
    return [
        ("status", status),
        ("source", f"`{source.get('uri', job.source)}` ({provenance})"),
        ("destination", f"`{job.destination}`"),
        ("layout", f"{report['devices']} devices, scan_layers={str(report['scan_layers']).lower()}, {report['dtype']}"
                   + (f", {report['compression']} chunks" if "compression" in report else "")
                   + (", data files by device" if report.get("data_files_by_device") else "")),
        ("model", f"{report['family']} (decoder block {report['maxtext_decoder_block']}), "
                  f"{report['tensors']} tensors -> {report['leaves']} leaves"),
        ("size", f"source {human_bytes(report['source_bytes'])}, output {human_bytes(report['output_bytes'])}"),
        ("time", f"{human_seconds(report['wall_seconds'])} wall in ckptconv"
                 + (f"; CPU {human_seconds(report['cpu_seconds'])}, {human_seconds(cpu)} per GiB written"
                    if cpu is not None else "")),
        ("peak RSS", f"{human_bytes(report['peak_rss_bytes'])} (the conversion's own high-water mark, VmHWM); "
                     f"predicted {human_bytes(predicted)}"
                     + (f"; wait4 {human_bytes(report['wait4_maxrss_bytes'])} (includes the worker at fork)"
                        if report.get("wait4_maxrss_bytes") else "")),
        ("RSS plot", f"`{job.destination.rstrip('/')}/{rssplot.PLOT_NAME}` (beside the report)"),
        ("admission", f"held {admission.get('held_gb', '?')} GB of `{admission.get('limit', '?')}` "
                      f"(limit {admission.get('limit_gb', '?')} GB)"),
        ("sharding", sharding),
        ("restore", restore_text(report.get("restore"))),
        ("verify", _verify_text(verified, report)),
        ("restore check", restore_check_text(restored) if restored else "-"),
        ("attempts", str(report.get("attempts", 1))),
    ]


def restore_check_text(restored: dict) -> str:
    """One line: the checkpoint restored onto the worker's devices, how fast, what it held, and the check's verdict."""
    device = (f"{human_bytes(restored['device_bytes_in_use'])} in use on the fullest device"
              if restored.get("device_bytes_in_use") is not None else
              f"{human_bytes(restored['restored_bytes_per_device'])} restored on the fullest device")
    return (f"OK: {restored['leaves']} leaves, {human_bytes(restored['bytes'])} restored onto {restored['devices']} "
            f"{restored['platform']} device(s) in {human_seconds(restored['restore_seconds'])} "
            f"({restored['gib_per_s']} GiB/s); {device}; every leaf equal to the stored data bit for bit there "
            f"({human_seconds(restored['check_seconds'])}); host peak RSS {human_bytes(restored['peak_rss_bytes'])}")


def restore_check_row(job: Conversion, restored: dict) -> dict:
    """The restore check's raw figures, one row (``conversion-<slug>-restore-check``)."""
    keys = ("ok", "platform", "devices", "device_kind", "leaves", "bytes", "open_seconds", "restore_seconds",
            "gib_per_s", "check_seconds", "device_bytes_in_use", "restored_bytes_per_device", "peak_rss_bytes")
    return {"model": job.slug, "destination": job.destination, **{key: restored.get(key) for key in keys},
            "waited_for_accelerator_since": (restored.get("admission") or {}).get("requested_at")}


def restore_text(figures: dict | None) -> str:
    """What a TPU host pays to restore the checkpoint, from its stored layout (the report's ``restore``)."""
    if not figures:
        return "-"
    if "error" in figures:
        return f"layout not read: {_cell(figures['error'])}"
    return (f"{figures['chunks']} chunks in {figures['data_files']} OCDBT data files (largest "
            f"{human_bytes(figures['largest_data_file_bytes'])}); a host restoring device {figures['device']}'s shard "
            f"makes {figures['device_reads']} storage reads ({human_bytes(figures['device_read_bytes'])}, "
            f"{figures['device_chunks']} chunks in {figures['device_data_files']} data files), one host restoring all "
            f"{figures['devices']} shards {figures['all_devices_reads']} (computed from the layout, ranges of one file "
            f"closer than {human_bytes(figures['coalescing_bytes'])} read together, as Orbax's restore does)"
            + (f"; device {figures['device']}'s shard{_sampled(figures)} read back from the output in "
               f"{figures['device_read_seconds']} s from the converting worker" if "device_read_seconds" in figures
               else ""))


def _sampled(figures: dict) -> str:
    """What of the shard the probe read, where it read an even sample of it (a shard over its limit)."""
    read, shard = figures.get("device_decoded_bytes"), figures.get("device_shard_bytes")
    if read is None or shard is None or read >= shard:
        return ""
    return f" (an even sample, {human_bytes(read)} of {human_bytes(shard)})"


def output_link(destination: str) -> str:
    """A clickable address for the output: the GCS console for ``gs://``, the repo's branch for ``hf://``,
    ``file://`` for local paths."""
    if destination.startswith("gs://"):
        return "https://console.cloud.google.com/storage/browser/" + destination.removeprefix("gs://")
    if destination.startswith("hf://"):  # the repo's files on the branch, on the hub the export used
        repo, _, branch = destination.removeprefix("hf://").rstrip("/").partition("@")
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        return f"{endpoint}/{repo}/tree/{branch or 'main'}"
    if "://" in destination:
        return destination
    return "file://" + os.path.abspath(destination)


def zoo_row(job: Conversion, report: dict | None, error: str | None, attempts: int,
            predicted: int | None = None, artifact_id: str | None = None, restored: dict | None = None) -> dict:
    """One zoo row for this run: raw figures (status, wall, peak RSS (VmHWM), size, the OCDBT data files and the
    storage reads a host restoring device 0's shard makes, retries, memory held and when) and, for people, the model page's artifact id and the predicted peak."""
    report = report or {}
    admission = report.get("admission") or {}
    restore = report.get("restore") or {}
    status = Status.FAILED if error else Status.SKIPPED if report.get("skipped") else Status.COMPLETE
    return {
        "model": job.slug, "status": status, "source": job.source, "destination": job.destination,
        "devices": job.devices,
        "wall_seconds": report.get("child_seconds" if report.get("skipped") else "wall_seconds"),
        "peak_rss_mib": _round(report.get("peak_rss_bytes"), MIB), "output_mib": _round(report.get("output_bytes"), MIB),
        "predicted_peak_mib": _round(predicted, MIB),
        # what a TPU host pays to restore it (the report's ``restore``: computed from the stored layout, and the
        # read of device 0's shard back from the output, timed)
        "data_files": restore.get("data_files"),
        "device_restore_reads": restore.get("device_reads"),
        "device_restore_seconds": restore.get("device_read_seconds"),
        # restored onto the worker's accelerator and checked there (restore-check), where the run asked for it
        "restore_check": None if restored is None else ("ok" if restored.get("ok") else "failed"),
        "restore_check_platform": None if restored is None else f"{restored['devices']} {restored['platform']}",
        "restore_check_seconds": None if restored is None else restored.get("restore_seconds"),
        "restore_check_gib_per_s": None if restored is None else restored.get("gib_per_s"),
        "retries": max(attempts - 1, 0), "held_gb": admission.get("held_gb"),
        "admitted_at": admission.get("admitted_at"), "released_at": admission.get("released_at"), "error": error,
        "artifact_id": artifact_id,
    }


ZOO_COLUMNS = ("model", "status", "error or headline", "wall", "peak RSS", "output", "ran on", "retries")


def zoo_markdown(name: str, rows: list[dict], ui_url: str | None) -> str:
    """The zoo's page: one line per model (at most eight columns), failures first, each model linking to its
    own page (``<ui>/artifacts/artifact/<id>``) where the details are."""
    ok = sum(row.get("status") in (Status.COMPLETE, Status.SKIPPED) for row in rows)
    lines = [f"## Zoo `{name}`: {ok} of {len(rows)} models ok\n",
             "| " + " | ".join(ZOO_COLUMNS) + " |", "|" + "---|" * len(ZOO_COLUMNS)]
    ordered = sorted(rows, key=lambda row: row.get("status") in (Status.COMPLETE, Status.SKIPPED))  # stable: problems first
    for row in ordered:
        cells = (_model_cell(row, ui_url), _status_cell(row.get("status")), _note(row),
                 human_seconds(row.get("wall_seconds")), _mib(row.get("peak_rss_mib")), _mib(row.get("output_mib")),
                 _where(row), str(row.get("retries", "-")))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n\nWall is the conversion's own; peak RSS its VmHWM. Every raw field: `zoo-" \
        f"{slugify(name)}-rows`.\n"


def _model_cell(row: dict, ui_url: str | None) -> str:
    model = str(row.get("model", "?"))
    if not row.get("artifact_id"):
        return model
    return f"[{model}]({(ui_url or '').rstrip('/')}/artifacts/artifact/{row['artifact_id']})"


def _status_cell(status: str | None) -> str:
    return {Status.COMPLETE: "complete", Status.SKIPPED: "skipped (done before)"}.get(status or "", f"**{status or '?'}**")


def _note(row: dict) -> str:
    """The error's first line for a model that did not complete; else the peak against its prediction."""
    if row.get("error"):
        first = str(row["error"]).strip().splitlines()[0] if str(row["error"]).strip() else "?"
        return first if len(first) <= ERROR_CHARS else first[:ERROR_CHARS - 1] + "…"
    peak, predicted = row.get("peak_rss_mib"), row.get("predicted_peak_mib")
    share = f"peak {peak / predicted:.0%} of predicted {_mib(predicted)}" if peak and predicted else ""
    restored = (f"restored onto {row['restore_check_platform']} in {human_seconds(row['restore_check_seconds'])}"
                if row.get("restore_check") == "ok" else "")
    return ", ".join(p for p in ("verified" if row.get("status") == Status.COMPLETE else "", restored, share)
                     if p) or "-"


def _where(row: dict) -> str:
    return " / ".join(str(row[k]) for k in ("pool", "worker") if row.get(k)) or "-"


def _cell(text: str) -> str:
    """A table cell: one line, no column breaks."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _mib(value: float | None) -> str:
    return "-" if value is None else human_bytes(value * MIB)


def ui_url() -> str | None:
    """The Prefect UI's address, for links that work outside the UI too (None: links relative to the UI)."""
    return get_current_settings().ui_url


@task(name="publish-artifacts", task_run_name="publish-{job.slug}", cache_policy=NO_CACHE)
def publish_model_artifacts(job: Conversion, plan: dict, report: dict, verified: dict | None, sharding: str,
                            restored: dict | None = None) -> str:
    """Create the model's page (``conversion-<slug>``); returns its artifact id (for the zoo's link)."""
    origin = " (skipped now; figures of the conversion that wrote it)" if report.get("skipped") else ""
    artifact_id = create_markdown_artifact(summary_markdown(job, plan, report, verified, sharding, restored),
                                           key=f"conversion-{job.slug}",
                                           description=f"{job.source} -> {job.destination}{origin}")
    return str(artifact_id)


@task(name="publish-restore-check", task_run_name="publish-restore-check-{job.slug}", cache_policy=NO_CACHE)
def publish_restore_check(job: Conversion, restored: dict) -> str:
    """The restore check beside the conversion's page: ``conversion-<slug>-restore-check``, one row."""
    key = f"conversion-{job.slug}-restore-check"
    create_table_artifact([restore_check_row(job, restored)], key=key,
                          description=f"{job.destination}: restored onto {restored['devices']} {restored['platform']} "
                                      f"device(s) and checked there")
    return key


@task(name="publish-row", task_run_name="publish-row-{job.slug}", cache_policy=NO_CACHE)
def publish_row(job: Conversion, row: dict) -> str:
    """The model's zoo row as a one-row table (``conversion-<slug>-row``), for a dispatching zoo to read."""
    key = f"conversion-{job.slug}-row"
    create_table_artifact([row], key=key, description=f"{job.source}: this run's row of the zoo table")
    return key


@task(name="publish-zoo-summary", cache_policy=NO_CACHE)
def publish_zoo_summary(name: str, rows: list[dict]) -> str:
    """Create the zoo run's page (``zoo-<name>``) and its raw table (``zoo-<name>-rows``); returns the page's key."""
    key = f"zoo-{slugify(name)}"
    failed = sum(row.get("status") not in (Status.COMPLETE, Status.SKIPPED) for row in rows)
    summary = f"zoo '{name}': {len(rows) - failed} of {len(rows)} models ok"
    create_markdown_artifact(zoo_markdown(name, rows, ui_url()), key=key, description=summary)
    create_table_artifact(rows, key=f"{key}-rows", description=f"{summary}; every raw field")
    return key


def ordered_stages(stage_seconds: dict) -> list[tuple[str, float]]:
    return sorted(stage_seconds.items(), key=lambda item: (STAGES.index(item[0]) if item[0] in STAGES else len(STAGES)))


def _verify_text(verified: dict | None, report: dict) -> str:
    if verified is None:
        return "not rerun: the output is unchanged since the conversion that wrote it" if report.get("skipped") else "-"
    return (f"OK: {verified['leaves']} leaves, {verified['tensors']} tensors, {human_bytes(verified['bytes'])} "
            f"equal to the transformed source bit for bit ({human_seconds(verified['seconds'])})")


def rate_mib_per_s(nbytes: int | None, seconds: float) -> float | None:
    return None if not nbytes or seconds <= 0 else round(nbytes / MIB / seconds, 1)


def _round(value: int | None, unit: int) -> float | None:
    return None if value is None else round(value / unit, 1)
