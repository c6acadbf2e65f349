"""The export task: one ``ckptconv export`` (MaxText -> HF) in a fresh child process, admitted by memory."""

from __future__ import annotations

import json
import os
import tempfile

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff

from tasks.admission import admitted, configured_limit, ensure_limit, slots_needed
from tasks.child import child_env, stream_child
from tasks.failures import retryable
from tasks.job import Export
from tasks.progress import ProgressReporter

DEFAULT_TIMEOUT_SECONDS = 6 * 3600
# What an export holds at most, whatever the model: one read unit in flight (measured ~0.25 GiB).
EXPORT_PEAK_BYTES = 1024**3


@task(name="export-checkpoint", task_run_name="export-{job.slug}", cache_policy=NO_CACHE,
      retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=10), retry_jitter_factor=0.5,
      retry_condition_fn=retryable)
def export_checkpoint(job: Export, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> dict:
    """Export in a child holding 1 GiB of the worker's memory limit; returns the child's JSON report."""
    logger = get_run_logger()
    limit = ensure_limit(configured_limit())
    with tempfile.TemporaryDirectory(prefix="ckptconv-") as tmp, \
            admitted(limit, slots_needed(EXPORT_PEAK_BYTES, limit)) as admission:
        progress = ProgressReporter(job.slug, logger, kind="export")
        report_path = os.path.join(tmp, "report.json")
        result = stream_child(job.export_args(report_path), child_env(1), progress.on_line, timeout_seconds)
        result.check(f"ckptconv export {job.checkpoint}", timeout_seconds)
        with open(report_path) as f:
            report = json.load(f)
    progress.finish("skipped: output already complete" if report.get("skipped") else "complete")
    logger.info("exported %d tensors to %s; peak RSS %d bytes (the export's VmHWM)", report["tensors"],
                job.destination, report["peak_rss_bytes"])
    return {**report, "own_peak_rss_bytes": result.own_peak_rss_bytes, "child_seconds": round(result.seconds, 3),
            "attempts": task_run.run_count, "admission": admission}
