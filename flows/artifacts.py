"""What a conversion leaves in Prefect: tables, a markdown summary and a link, under stable keys.

Per model (``<slug>`` from the model's name or destination): ``conversion-<slug>`` (a table,
one row per stage), ``conversion-<slug>-summary`` (markdown), ``conversion-<slug>-output``
(a link), ``conversion-<slug>-progress`` (made by the conversion task while it runs) and
``conversion-<slug>-row`` (the model's zoo row, read back by a zoo that dispatched the run).
Per zoo run: ``zoo-<name>``, one row per model. Builders are pure; the tasks only publish.
"""

from __future__ import annotations

import os

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from tasks.job import Conversion, slugify

GIB = 1024**3
MIB = 1024**2
STAGES = ("plan", "read", "transform", "write", "commit")  # pipeline order (the report's JSON is sorted)


def stage_rows(report: dict) -> list[dict]:
    """One row per stage (seconds, bytes, MiB/s), then the wall-clock total with the conversion's peak RSS.

    The peak is the conversion process's own high-water mark (VmHWM). A skipped run describes the
    conversion that wrote the checkpoint (its report's figures).
    """
    peak = report["peak_rss_bytes"]
    moved = {"read": report["source_bytes"], "transform": report["output_bytes"], "write": report["output_bytes"]}
    rows = [{"stage": stage, "seconds": seconds, "bytes": moved.get(stage), "mib_per_s": rate_mib_per_s(moved.get(stage), seconds),
             "peak_rss_bytes": None} for stage, seconds in ordered_stages(report["stage_seconds"])]
    rows.append({"stage": "total (wall)", "seconds": report["wall_seconds"], "bytes": report["output_bytes"],
                 "mib_per_s": rate_mib_per_s(report["output_bytes"], report["wall_seconds"]),
                 "peak_rss_bytes": peak})
    return rows


def summary_markdown(job: Conversion, plan: dict, report: dict, verified: dict | None, sharding: str) -> str:
    """The human summary: where from (with provenance), where to, layout, memory, sharding, verify."""
    source = report["source"]
    # a local source's per-file fingerprint details stay in the report
    provenance = ", ".join(f"{k} {v}" for k, v in source.items() if k not in ("uri", "files")) or "-"
    admission = report.get("admission") or {}
    status = "skipped: a complete, identical conversion was already there" if report.get("skipped") else "converted"
    rows = [
        ("status", status),
        ("source", f"`{source.get('uri', job.source)}` ({provenance})"),
        ("destination", f"`{job.destination}` (MaxText: `load_parameters_path={job.destination.rstrip('/')}/0/items`)"),
        ("layout", f"{report['devices']} devices, scan_layers={str(report['scan_layers']).lower()}, {report['dtype']}"),
        ("model", f"{report['family']} (decoder block {report['maxtext_decoder_block']}), "
                  f"{report['tensors']} tensors -> {report['leaves']} leaves"),
        ("size", f"source {report['source_bytes'] / GIB:.3f} GiB, output {report['output_bytes'] / GIB:.3f} GiB"),
        ("time", f"{report['wall_seconds']:.1f} s in ckptconv ({_stages(report)})"
                 + (f"; CPU {report['cpu_seconds']:.1f} s, {report['cpu_seconds_per_gib']:.1f} s per GiB written"
                    if report.get("cpu_seconds_per_gib") is not None else "")),
        ("peak RSS", f"{_gib(report['peak_rss_bytes'])} (the conversion's own high-water mark, VmHWM); "
                     f"predicted {_gib(plan['predicted_peak_rss_bytes'])}"
                     + (f"; wait4 {_gib(report['wait4_maxrss_bytes'])} (includes the worker at fork)"
                        if report.get("wait4_maxrss_bytes") else "")),
        ("admission", f"held {admission.get('held_gb', '?')} GB of `{admission.get('limit', '?')}` "
                      f"(limit {admission.get('limit_gb', '?')} GB)"),
        ("sharding", sharding),
        ("verify", _verify_text(verified, report)),
        ("attempts", str(report.get("attempts", 1))),
    ]
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    return f"## Conversion `{job.slug}`\n\n| | |\n|---|---|\n{table}\n"


def output_link(destination: str) -> str:
    """A clickable address for the output: the GCS console for ``gs://``, ``file://`` for local paths."""
    if destination.startswith("gs://"):
        return "https://console.cloud.google.com/storage/browser/" + destination.removeprefix("gs://")
    if "://" in destination:
        return destination
    return "file://" + os.path.abspath(destination)


def zoo_row(job: Conversion, report: dict | None, error: str | None, attempts: int) -> dict:
    """One zoo summary row for this run: status, wall time, peak RSS (VmHWM), size, retries, memory held and when."""
    report = report or {}
    admission = report.get("admission") or {}
    status = "failed" if error else "skipped" if report.get("skipped") else "complete"
    return {
        "model": job.slug, "status": status, "source": job.source, "destination": job.destination,
        "devices": job.devices,
        "wall_seconds": report.get("child_seconds" if report.get("skipped") else "wall_seconds"),
        "peak_rss_mib": _round(report.get("peak_rss_bytes"), MIB), "output_mib": _round(report.get("output_bytes"), MIB),
        "retries": max(attempts - 1, 0), "held_gb": admission.get("held_gb"),
        "admitted_at": admission.get("admitted_at"), "released_at": admission.get("released_at"), "error": error,
    }


@task(name="publish-artifacts", task_run_name="publish-{job.slug}", cache_policy=NO_CACHE)
def publish_model_artifacts(job: Conversion, plan: dict, report: dict, verified: dict | None, sharding: str) -> list[str]:
    """Create the model's stage table, markdown summary and output link; returns their keys."""
    key = f"conversion-{job.slug}"
    origin = " (skipped now; figures of the conversion that wrote it)" if report.get("skipped") else ""
    create_table_artifact(stage_rows(report), key=key,
                          description=f"{job.source} -> {job.destination}: seconds per stage{origin}")
    create_markdown_artifact(summary_markdown(job, plan, report, verified, sharding), key=f"{key}-summary",
                             description=f"conversion of {job.source}")
    create_link_artifact(output_link(job.destination), link_text=job.destination, key=f"{key}-output",
                         description="the MaxText checkpoint (load DST/0/items)")
    return [key, f"{key}-summary", f"{key}-output", f"{key}-progress"]


@task(name="publish-row", task_run_name="publish-row-{job.slug}", cache_policy=NO_CACHE)
def publish_row(job: Conversion, row: dict) -> str:
    """The model's zoo row as a one-row table (``conversion-<slug>-row``), for a dispatching zoo to read."""
    key = f"conversion-{job.slug}-row"
    create_table_artifact([row], key=key, description=f"{job.source}: this run's row of the zoo table")
    return key


@task(name="publish-zoo-summary", cache_policy=NO_CACHE)
def publish_zoo_summary(name: str, rows: list[dict]) -> str:
    """Create the zoo run's one summary table; returns its key."""
    key = f"zoo-{slugify(name)}"
    failed = sum(row["status"] == "failed" for row in rows)
    create_table_artifact(rows, key=key, description=f"zoo '{name}': {len(rows) - failed} of {len(rows)} models ok")
    return key


def _stages(report: dict) -> str:
    return ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in ordered_stages(report["stage_seconds"]))


def ordered_stages(stage_seconds: dict) -> list[tuple[str, float]]:
    return sorted(stage_seconds.items(), key=lambda item: (STAGES.index(item[0]) if item[0] in STAGES else len(STAGES)))


def _verify_text(verified: dict | None, report: dict) -> str:
    if verified is None:
        return "not rerun: the output is unchanged since the conversion that wrote it" if report.get("skipped") else "-"
    return (f"OK: {verified['leaves']} leaves, {verified['tensors']} tensors, {verified['bytes'] / MIB:.1f} MiB "
            f"equal to the transformed source bit for bit ({verified['seconds']:.1f} s)")


def rate_mib_per_s(nbytes: int | None, seconds: float) -> float | None:
    return None if not nbytes or seconds <= 0 else round(nbytes / MIB / seconds, 1)


def _round(value: int | None, unit: int) -> float | None:
    return None if value is None else round(value / unit, 1)


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f} GiB"
