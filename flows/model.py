"""The ``convert-model`` flow: plan -> (skip if done) -> convert -> verify -> inspect -> [restore check] -> artifacts.

``convert_one`` is the whole pipeline for one model; the zoo flow runs it once per manifest
entry. Every step that touches JAX runs as ``python -m ckptconv ...`` in a child process. On a TPU pool
(``restore_check``) the checkpoint is then restored onto the worker's accelerator and checked there.
"""

from __future__ import annotations

import os
import socket

from prefect import flow, get_run_logger
from prefect.states import State

from ckptconv import settings
from flows.artifacts import publish_model_artifacts, publish_restore_check, publish_row, zoo_row
from tasks import Conversion, convert_checkpoint, inspect_checkpoint, plan_conversion, restore_check, verify_checkpoint
from tasks.convert import DEFAULT_TIMEOUT_SECONDS
from tasks.failures import retryable_io

WORKER_ENV = "CKPTCONV_WORKER"  # how a worker names itself in the zoo table (default: its host name)


def worker_name() -> str:
    """Who ran this flow run: ``$CKPTCONV_WORKER`` (set it per worker) or the host name."""
    return os.environ.get(WORKER_ENV) or socket.gethostname()


def convert_one(job: Conversion, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, retry_kills: bool = True) -> dict:
    """Run one model's pipeline; returns its zoo row (raises the first step's error).

    ``retry_kills=False`` when a bigger pool takes over after a kill (the zoo's ``retry_pool``):
    admission already reserved the predicted peak, so a SIGKILL here would most likely recur.
    """
    plan = plan_conversion(job)
    convert = convert_checkpoint if retry_kills else convert_checkpoint.with_options(retry_condition_fn=retryable_io)
    report = convert(job, plan["predicted_peak_rss_bytes"], timeout_seconds)
    inspected = inspect_checkpoint.submit(job)  # runs while verify does: both only read the output
    verified = None if report["skipped"] else verify_checkpoint(job, timeout_seconds)
    inspected.wait()
    sharding = _sharding(job, inspected.state)
    restored = checked_on_accelerator(job, report, timeout_seconds)
    page = publish_model_artifacts(job, plan, report, verified, sharding, restored)
    row = zoo_row(job, report, None, report.get("attempts", 1), plan["predicted_peak_rss_bytes"], page, restored)
    return {**row, "worker": worker_name()}


def checked_on_accelerator(job: Conversion, report: dict, timeout_seconds: float) -> dict | None:
    """``restore-check`` after a conversion, where the job asks for it (a TPU pool), and its artifact; None where
    it does not, or where the output was already complete (unchanged since the run that wrote it, as verify)."""
    if not job.restore_check or report.get("skipped"):
        return None
    restored = restore_check(job, timeout_seconds)
    publish_restore_check(job, restored)
    return restored


def _sharding(job: Conversion, state: State) -> str:
    """The inspect task's sharding line; its failure is reported, not raised (verify is the check that counts)."""
    if state.is_completed():
        return state.result()["sharding_check"]
    get_run_logger().warning("%s: inspect failed: %s", job.slug, state.message)
    return f"unknown: inspect failed: {state.message}"


@flow(name="convert-model", log_prints=True)
def convert_model(source: str, destination: str, devices: int = settings.DEVICES, scan_layers: bool | None = settings.SCAN_LAYERS,
                  dtype: str = settings.DTYPE, overwrite: bool = False, name: str | None = None,
                  timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, retry_kills: bool = True,
                  multimodal: bool = False, data_file_size: str = settings.DATA_FILE_SIZE,
                  data_files_by_device: bool | None = settings.DATA_FILES_BY_DEVICE,
                  compression: str | None = settings.COMPRESSION, restore_check: bool = False,
                  restore_check_cpu_devices: int | None = None) -> dict:
    """Convert one HF safetensors checkpoint into a sharded MaxText Orbax checkpoint, verified.

    ``restore_check``: then restore it onto this worker's accelerator and check every leaf there (a TPU pool);
    ``restore_check_cpu_devices``: onto that many CPU devices instead (a worker without one).

    Its zoo row is also published as an artifact: a zoo that started this run through the
    deployment (on another worker) reads it back from the server, no shared result storage needed.
    """
    job = Conversion(source, destination, devices, scan_layers, dtype, overwrite, name, multimodal, data_file_size,
                     data_files_by_device, compression, restore_check, restore_check_cpu_devices)
    row = convert_one(job, timeout_seconds, retry_kills)
    publish_row(job, row)
    return row
