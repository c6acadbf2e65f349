"""One model over N workers: ``convert-partition`` flow runs, then one finalize.

``convert-partitioned`` plans the conversion, starts N flow runs of the ``convert-partition``
deployment (``run_deployment``: any worker of its pool takes each, admitted by the partition's
predicted memory), waits for all, then finalizes in a child (``ckptconv convert --finalize N``:
Orbax merges the partitions' OCDBT databases and commits once), verifies and publishes the
usual artifacts with one row per partition. A failed partition fails the run before anything is
committed; rerunning the flow reruns only the partitions without a marker (the others skip).
Every wait has an end, as the zoo's (``flows/run_waits.py``): a partition no worker of its pool
takes within ``start_wait_seconds`` is cancelled and fails the run in one line naming the pool.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.deployments import run_deployment
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from ckptconv import settings
from flows.artifacts import publish_model_artifacts
from flows.model import checked_on_accelerator, worker_name
from flows.run_waits import DEFAULT_START_WAIT_SECONDS, RUN_WAIT_TIMEOUTS, NeverStarted, RunOverdue, wait_for_run
from flows.zoo import published_row
from tasks import Conversion, convert_checkpoint, inspect_checkpoint, plan_conversion, verify_checkpoint
from tasks.convert import DEFAULT_TIMEOUT_SECONDS
from tasks.failures import ChildFailed

PARTITION_DEPLOYMENT = "convert-partition/convert-partition-cpu"


@flow(name="convert-partition", log_prints=True)
def convert_partition(source: str, destination: str, partition: int, partitions: int, devices: int = settings.DEVICES,
                      scan_layers: bool | None = settings.SCAN_LAYERS, dtype: str = settings.DTYPE, name: str | None = None,
                      timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, multimodal: bool = False,
                      data_file_size: str = settings.DATA_FILE_SIZE,
                      data_files_by_device: bool | None = settings.DATA_FILES_BY_DEVICE,
                      compression: str | None = settings.COMPRESSION) -> dict:
    """Write partition ``partition`` of ``partitions`` (``ckptconv convert --partition I/N``) on this worker."""
    job = Conversion(source, destination, devices, scan_layers, dtype, False, name, multimodal, data_file_size,
                     data_files_by_device, compression)
    spec = f"{partition}/{partitions}"
    plan = plan_conversion(job)
    convert = convert_checkpoint.with_options(task_run_name=f"convert-{job.slug}-partition{partition}")
    report = convert(job, plan["predicted_peak_rss_bytes"], timeout_seconds, ("--partition", spec))
    row = {"partition": spec, "worker": worker_name(), "skipped": bool(report.get("skipped")),
           "leaves": report.get("leaves"), "output_bytes": report.get("output_bytes"),
           "wall_seconds": report.get("wall_seconds"), "peak_rss_bytes": report.get("peak_rss_bytes")}
    create_table_artifact([row], key=f"conversion-{job.slug}-partition{partition}-row",
                          description=f"{source}: partition {spec}")
    return row


@task(name="run-partition", task_run_name="partition-{partition}-of-{partitions}", cache_policy=NO_CACHE)
def run_partition(job: Conversion, partition: int, partitions: int, deployment: str, timeout_seconds: float,
                  start_wait_seconds: float = DEFAULT_START_WAIT_SECONDS, run_wait_seconds: float | None = None) -> dict:
    """One partition as its own flow run of ``deployment``; its row, read back from the server.

    Waits as the zoo does: at most ``start_wait_seconds`` while no worker of the pool can take it,
    at most ``run_wait_seconds`` (default ``RUN_WAIT_TIMEOUTS`` x ``timeout_seconds``) once started.
    """
    parameters = {"source": job.source, "destination": job.destination, "partition": partition,
                  "partitions": partitions, "devices": job.devices, "scan_layers": job.scan_layers, "dtype": job.dtype,
                  "multimodal": job.multimodal, "data_file_size": job.data_file_size,
                  "data_files_by_device": job.data_files_by_device, "compression": job.compression,
                  "name": job.name, "timeout_seconds": timeout_seconds}
    run = run_deployment(deployment, parameters=parameters, timeout=0,
                         flow_run_name=f"{job.slug}-partition{partition}of{partitions}", as_subflow=True)
    try:
        run = wait_for_run(run, start_wait_seconds, run_wait_seconds or RUN_WAIT_TIMEOUTS * timeout_seconds)
    except (NeverStarted, RunOverdue) as stuck:
        raise ChildFailed(f"partition {partition}/{partitions}: {stuck}") from None
    if not run.state.is_completed():
        raise ChildFailed(f"partition {partition}/{partitions}: {run.state.message}")
    return {**published_row(run.id, f"{job.slug}-partition{partition}"), "flow_run": run.name}


@flow(name="convert-partitioned", task_runner=ThreadPoolTaskRunner(max_workers=64), log_prints=True)
def convert_partitioned(source: str, destination: str, partitions: int = 2, devices: int = settings.DEVICES,
                        scan_layers: bool | None = settings.SCAN_LAYERS, dtype: str = settings.DTYPE, name: str | None = None,
                        deployment: str = PARTITION_DEPLOYMENT,
                        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
                        start_wait_seconds: float = DEFAULT_START_WAIT_SECONDS, multimodal: bool = False,
                        data_file_size: str = settings.DATA_FILE_SIZE,
                        data_files_by_device: bool | None = settings.DATA_FILES_BY_DEVICE,
                        compression: str | None = settings.COMPRESSION, restore_check: bool = False,
                        restore_check_cpu_devices: int | None = None) -> dict:
    """Convert one checkpoint as ``partitions`` flow runs on any workers, then finalize, verify, publish.

    ``start_wait_seconds``: how long a partition may wait while no worker of its pool can take it.
    ``restore_check``: after the finalize, restore the checkpoint onto this worker's accelerator and check it
    there (``restore_check_cpu_devices``: onto that many CPU devices instead).
    """
    job = Conversion(source, destination, devices, scan_layers, dtype, False, name, multimodal, data_file_size,
                     data_files_by_device, compression, restore_check, restore_check_cpu_devices)
    plan = plan_conversion(job)
    futures = [run_partition.submit(job, i, partitions, deployment, timeout_seconds, start_wait_seconds)
               for i in range(partitions)]
    wait(futures)
    failed = [f"{i}/{partitions}: {f.state.message}" for i, f in enumerate(futures) if not f.state.is_completed()]
    if failed:
        raise ChildFailed(f"{len(failed)} of {partitions} partitions failed (rerun to redo only those): "
                          + "; ".join(failed))
    rows = [future.result() for future in futures]
    get_run_logger().info("partitions done on %s; finalizing", sorted({row["worker"] for row in rows}))
    finalize = convert_checkpoint.with_options(task_run_name=f"finalize-{job.slug}")
    report = finalize(job, plan["predicted_peak_rss_bytes"], timeout_seconds, ("--finalize", str(partitions)))
    verified = verify_checkpoint(job, timeout_seconds)
    sharding = inspect_checkpoint(job)["sharding_check"]
    restored = checked_on_accelerator(job, report, timeout_seconds)
    publish_model_artifacts(job, plan, report, verified, sharding, restored)
    create_table_artifact(rows, key=f"conversion-{job.slug}-partitions",
                          description=f"{source}: where each of {partitions} partitions ran")
    return {"report": report, "partitions": rows, "restore_check": restored}
