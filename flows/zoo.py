"""The ``convert-zoo`` flow: convert every model of a manifest, then publish one summary table.

Models run concurrently (threads), each one's conversion admitted by its predicted memory
(see ``tasks.admission``), so small models pack onto one worker and big ones wait their turn.
A broken model fails on its own: the others complete, and the summary says which and why.

Manifest (YAML)::

    name: nightly
    defaults: {devices: 16, scan_layers: true, dtype: bfloat16, pool: cpu-pool}
    models:
      - {name: qwen3-0-6b, source: hf://Qwen/Qwen3-0.6B, destination: gs://bucket/qwen3-0.6b}
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import yaml
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName
from prefect.futures import wait
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State
from prefect.task_runners import ThreadPoolTaskRunner

from flows.artifacts import publish_zoo_summary, zoo_row
from flows.model import convert_one
from tasks.convert import DEFAULT_TIMEOUT_SECONDS
from tasks.job import Conversion

ENTRY_FIELDS = {f.name for f in fields(Conversion)} | {"pool"}
MAX_PARALLEL = 8  # threads; the memory limit, not this, decides how many conversions run at once


class ManifestError(ValueError):
    """The zoo manifest is malformed; the message names the entry and the field."""


@dataclass(frozen=True)
class Zoo:
    """A parsed manifest: its name and (conversion, pool) per model."""

    name: str
    entries: list[tuple[Conversion, str | None]]

    def jobs(self, pool: str | None) -> list[Conversion]:
        """The conversions for ``pool`` (all of them when ``pool`` is None)."""
        return [job for job, entry_pool in self.entries if pool is None or entry_pool == pool]


def load_manifest(path: str) -> Zoo:
    """Read and check a zoo manifest: every model needs ``source`` and ``destination``; unknown keys are errors."""
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    defaults = data.get("defaults") or {}
    entries = []
    for index, raw in enumerate(data.get("models") or []):
        entry = {**defaults, **raw}
        label = f"{path}: models[{index}] ({entry.get('name') or entry.get('source', '?')})"
        if unknown := sorted(set(entry) - ENTRY_FIELDS):
            raise ManifestError(f"{label}: unknown field(s) {unknown}; allowed: {sorted(ENTRY_FIELDS)}")
        if missing := [key for key in ("source", "destination") if not entry.get(key)]:
            raise ManifestError(f"{label}: missing {missing}")
        pool = entry.pop("pool", None)
        entries.append((Conversion(**entry), pool))
    slugs = [job.slug for job, _ in entries]
    if duplicates := sorted({slug for slug in slugs if slugs.count(slug) > 1}):
        raise ManifestError(f"{path}: several models share the artifact key(s) {duplicates}; give them distinct names")
    return Zoo(str(data.get("name") or "zoo"), entries)


convert_entry = task(convert_one, name="convert-model-entry", task_run_name="model-{job.slug}", cache_policy=NO_CACHE)


@flow(name="convert-zoo", task_runner=ThreadPoolTaskRunner(max_workers=MAX_PARALLEL), log_prints=True)
def convert_zoo(manifest: str = "deploy/zoo.yaml", pool: str | None = None,
                timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> State:
    """Convert every model of ``manifest`` meant for ``pool`` (all if None); publish one summary table."""
    zoo = load_manifest(manifest)
    jobs = zoo.jobs(pool)
    get_run_logger().info("zoo %s: %d of %d models for pool %s", zoo.name, len(jobs), len(zoo.entries), pool or "any")
    futures = [convert_entry.submit(job, timeout_seconds) for job in jobs]
    wait(futures)
    attempts = _conversion_attempts([f"convert-{job.slug}" for job in jobs])
    rows = [_row(job, future.state, attempts.get(f"convert-{job.slug}", 0)) for job, future in zip(jobs, futures)]
    key = publish_zoo_summary(zoo.name, rows)
    failed = [f"{row['model']}: {row['error']}" for row in rows if row["status"] == "failed"]
    if failed:
        return Failed(message=f"{len(failed)} of {len(rows)} models failed (see artifact {key}): " + "; ".join(failed))
    return Completed(message=f"{len(rows)} models converted (see artifact {key})", data=rows)


def _row(job: Conversion, state: State, attempts: int) -> dict:
    if state.is_completed():
        return state.result()
    return zoo_row(job, None, _error(state), attempts)


def _error(state: State) -> str:
    """The exception a failed entry raised, as ``Type: message`` (the state message if there is none)."""
    error = state.result(raise_on_failure=False)
    return f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(state.message)


def _conversion_attempts(names: list[str]) -> dict[str, int]:
    """How many times each named conversion task ran in this flow run (retries + 1), from the server."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=names)),
        )
    return {run.name: run.run_count for run in runs}
