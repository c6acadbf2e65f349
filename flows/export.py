"""The ``export-model`` flow: a MaxText checkpoint back to HF safetensors, then its stage table.

The export itself runs as ``python -m ckptconv export ...`` in a child process (the task);
the flow only wires it to the artifacts: ``export-<slug>`` (seconds per stage and the peak RSS)
and ``export-<slug>-output`` (a link to the HF directory).
"""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from ckptconv import settings
from flows.artifacts import ordered_stages, rate_mib_per_s, output_link
from tasks.export import DEFAULT_TIMEOUT_SECONDS, export_checkpoint
from tasks.job import Export


def export_rows(report: dict) -> list[dict]:
    """One row per stage, then the wall-clock total with the export's own peak RSS (VmHWM)."""
    written = report["output_bytes"]
    rows = [{"stage": stage, "seconds": seconds, "bytes": written if stage in ("read", "transform", "write") else None,
             "mib_per_s": rate_mib_per_s(written, seconds) if stage == "write" else None, "peak_rss_bytes": None}
            for stage, seconds in ordered_stages(report["stage_seconds"])]
    rows.append({"stage": "total (wall)", "seconds": report["wall_seconds"], "bytes": written,
                 "mib_per_s": rate_mib_per_s(written, report["wall_seconds"]), "peak_rss_bytes": report["peak_rss_bytes"]})
    return rows


@task(name="publish-export-artifacts", task_run_name="publish-export-{job.slug}", cache_policy=NO_CACHE)
def publish_export_artifacts(job: Export, report: dict) -> list[str]:
    """The export's stage table and output link; returns their keys."""
    key = f"export-{job.slug}"
    origin = " (skipped now; figures of the export that wrote it)" if report.get("skipped") else ""
    create_table_artifact(export_rows(report), key=key,
                          description=f"{job.checkpoint} -> {job.destination}: seconds per stage{origin}")
    create_link_artifact(output_link(job.destination), link_text=job.destination, key=f"{key}-output",
                         description="the HF model directory (safetensors, config, tokenizer)")
    return [key, f"{key}-output", f"{key}-progress"]


@flow(name="export-model", log_prints=True)
def export_model(checkpoint: str, destination: str, like: str, dtype: str = settings.DTYPE, shard_size: str = settings.SHARD_SIZE,
                 overwrite: bool = False, name: str | None = None,
                 timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> dict:
    """Export one MaxText Orbax checkpoint to HF safetensors shaped like ``like``; returns the report."""
    job = Export(checkpoint, destination, like, dtype, shard_size, overwrite, name)
    report = export_checkpoint(job, timeout_seconds)
    publish_export_artifacts(job, report)
    return report
