"""The ``convert-model`` flow: plan -> (skip if done) -> convert -> verify -> inspect -> artifacts.

``convert_one`` is the whole pipeline for one model; the zoo flow runs it once per manifest
entry. Every step that touches JAX runs as ``python -m ckptconv ...`` in a child process.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.states import State

from flows.artifacts import publish_model_artifacts, zoo_row
from tasks import Conversion, convert_checkpoint, inspect_checkpoint, plan_conversion, verify_checkpoint
from tasks.convert import DEFAULT_TIMEOUT_SECONDS


def convert_one(job: Conversion, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> dict:
    """Run one model's pipeline; returns its zoo row (raises the first step's error)."""
    plan = plan_conversion(job)
    report = convert_checkpoint(job, plan["predicted_peak_rss_bytes"], timeout_seconds)
    inspected = inspect_checkpoint.submit(job)  # runs while verify does: both only read the output
    verified = None if report["skipped"] else verify_checkpoint(job, timeout_seconds)
    inspected.wait()
    sharding = _sharding(job, inspected.state)
    publish_model_artifacts(job, plan, report, verified, sharding)
    return zoo_row(job, report, None, report.get("attempts", 1))


def _sharding(job: Conversion, state: State) -> str:
    """The inspect task's sharding line; its failure is reported, not raised (verify is the check that counts)."""
    if state.is_completed():
        return state.result()["sharding_check"]
    get_run_logger().warning("%s: inspect failed: %s", job.slug, state.message)
    return f"unknown: inspect failed: {state.message}"


@flow(name="convert-model", log_prints=True)
def convert_model(source: str, destination: str, devices: int = 16, scan_layers: bool = True,
                  dtype: str = "bfloat16", overwrite: bool = False, name: str | None = None,
                  timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> dict:
    """Convert one HF safetensors checkpoint into a sharded MaxText Orbax checkpoint, verified."""
    job = Conversion(source, destination, devices, scan_layers, dtype, overwrite, name)
    return convert_one(job, timeout_seconds)
