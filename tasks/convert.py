"""The conversion task: one ``ckptconv convert`` in a fresh child process, admitted by memory."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from typing import Callable

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff

from ckptconv.progress import HOLD_ENV
from tasks.admission import admitted, configured_limit, ensure_limit, slots_needed
from tasks.child import child_env, stream_child
from tasks.failures import retryable
from tasks.job import Conversion
from tasks.progress import PREFIX, ProgressReporter

DEFAULT_TIMEOUT_SECONDS = 6 * 3600
KILL_HOOK = "CKPTCONV_TEST_KILL_ON_ATTEMPT"
KILL_MODEL_HOOK = "CKPTCONV_TEST_KILL_MODEL"


@task(name="convert-checkpoint", task_run_name="convert-{job.slug}", cache_policy=NO_CACHE,
      retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=10), retry_jitter_factor=0.5,
      retry_condition_fn=retryable)
def convert_checkpoint(job: Conversion, predicted_peak_bytes: int,
                       timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, extra_args: tuple[str, ...] = ()) -> dict:
    """Convert in a child holding its predicted GiB of the worker's memory limit; returns the report.

    ``extra_args``: more ``convert`` flags, e.g. ``("--partition", "0/4")`` or ``("--finalize", "4")``.
    """
    logger = get_run_logger()
    limit = ensure_limit(configured_limit())
    gb = slots_needed(predicted_peak_bytes, limit)
    logger.info("waiting for %d GB of %s (%d GB)", gb, limit.name, limit.gb)
    with tempfile.TemporaryDirectory(prefix="ckptconv-") as tmp, admitted(limit, gb) as admission:
        logger.info("admitted: holding %d GB of %s", gb, limit.name)
        progress = ProgressReporter(job.slug, logger)
        report_path = os.path.join(tmp, "report.json")
        # the run plans its workers within what it holds (ckptconv's --memory-budget): it uses what was reserved
        budget = ["--memory-budget", f"{gb}GiB"]
        on_line, hold = _kill_hook(job.slug, progress.on_line)
        result = stream_child(job.convert_args(report_path) + list(extra_args) + budget,
                              {**child_env(job.devices), **hold}, on_line, timeout_seconds)
        result.check(f"ckptconv convert {job.source}", timeout_seconds)
        with open(report_path) as f:
            report = json.load(f)
    progress.finish("skipped: output already complete" if report.get("skipped") else "complete")
    logger.info("peak RSS of the conversion: %d bytes (its VmHWM; wait4 says %d, which includes this worker at fork)",
                report["peak_rss_bytes"], result.wait4_maxrss_bytes)
    return {**report, "own_peak_rss_bytes": result.own_peak_rss_bytes,
            "wait4_maxrss_bytes": result.wait4_maxrss_bytes, "child_seconds": round(result.seconds, 3),
            "attempts": task_run.run_count, "admission": admission}


def _kill_hook(slug: str, on_line: Callable[[str, int], None]) -> tuple[Callable[[str, int], None], dict[str, str]]:
    """Test hooks, as an OOM kill would look: SIGKILL the child at its first event (its plan) on attempt N
    (CKPTCONV_TEST_KILL_ON_ATTEMPT=N), or on every attempt of one model on this worker
    (CKPTCONV_TEST_KILL_MODEL=slug). Returns the line handler and what the child's environment needs: the
    child holds itself at that event (ckptconv.progress.Hold), so a quick one cannot finish before the kill."""
    attempt = os.environ.get(KILL_HOOK)
    on_attempt = bool(attempt) and int(attempt) == task_run.run_count
    if not on_attempt and os.environ.get(KILL_MODEL_HOOK) != slug:
        return on_line, {}

    def killing(line: str, pid: int) -> None:
        on_line(line, pid)
        if line.startswith(PREFIX):
            os.kill(pid, signal.SIGKILL)

    return killing, {HOLD_ENV: "plan"}
