"""The ``convert-zoo`` flow: convert every model of a manifest, then publish one summary table.

Two ways to run the entries, chosen by the manifest:

- with a ``deployments`` table (pool -> ``convert-model`` deployment), each model becomes its own
  flow run of its pool's deployment (``run_deployment``), so any worker of that pool takes it and
  memory admission stays per worker; a run killed by the kernel (SIGKILL: the OOM killer) is
  started again on the entry's ``retry_pool``. The zoo waits for all and publishes the table,
  with the pool and worker each model finally ran on. A run nobody can take (its pool has no
  worker online, or is paused) waits at most ``start_wait_seconds``: then it is cancelled, so a
  worker arriving later does not run it unasked, and its row says ``never started``. A run a
  worker took is bounded by the conversion's own ``timeout_seconds``, however long it takes, and
  by ``run_wait_seconds`` here, for a worker lost with its run;
- without one, every model runs in this flow run (threads), each conversion admitted by its
  predicted memory (see ``tasks.admission``): small models pack onto one worker, big ones wait.

A broken model fails on its own: the others complete, and the summary says which and why.

Manifest (YAML; a local path or ``gs://BUCKET/zoo.yaml``)::

    name: nightly
    deployments: {cpu-pool: convert-model/convert-model-cpu, highmem-pool: convert-model/convert-model-highmem}
    defaults: {devices: 16, scan_layers: true, dtype: bfloat16, pool: cpu-pool, start_wait_seconds: 1800}
    models:
      - {name: qwen3-0-6b, source: hf://Qwen/Qwen3-0.6B, destination: gs://bucket/qwen3-0.6b}
      - {name: qwen3-235b, source: ..., destination: ..., retry_pool: highmem-pool}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import fsspec
import yaml
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId, TaskRunFilter,
    TaskRunFilterName,
)
from prefect.deployments import run_deployment
from prefect.futures import wait
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State
from prefect.task_runners import ThreadPoolTaskRunner

from ckptconv.settings import Status
from flows.artifacts import publish_zoo_summary, zoo_row
from flows.model import convert_one
from flows.run_waits import DEFAULT_START_WAIT_SECONDS, RUN_WAIT_TIMEOUTS, NeverStarted, RunOverdue, wait_for_run
from tasks.convert import DEFAULT_TIMEOUT_SECONDS
from tasks.failures import ChildFailed, killed
from tasks.job import Conversion

ENTRY_FIELDS = {f.name for f in fields(Conversion)} | {"pool", "retry_pool", "start_wait_seconds"}
MAX_PARALLEL = 8  # threads; the memory limit (per worker), not this, decides how many conversions run at once
NEVER_STARTED = Status.NEVER_STARTED  # the zoo row's status of an entry no worker took


class ManifestError(ValueError):
    """The zoo manifest is malformed; the message names the entry and the field."""


@dataclass(frozen=True)
class Entry:
    """One model of the zoo: the conversion, the pool it runs on, the pool that takes it after a kill."""

    job: Conversion
    pool: str | None
    retry_pool: str | None = None
    start_wait_seconds: float | None = None  # None: the flow's parameter

    @property
    def pools(self) -> tuple[str, ...]:
        """The pools to try, in order."""
        return tuple(p for p in (self.pool, self.retry_pool) if p)


@dataclass(frozen=True)
class Zoo:
    """A parsed manifest: its name, its entries, and the deployment that converts on each pool."""

    name: str
    entries: list[Entry]
    deployments: dict[str, str]

    def select(self, pool: str | None) -> list[Entry]:
        """The entries for ``pool`` (all of them when ``pool`` is None)."""
        return [entry for entry in self.entries if pool is None or entry.pool == pool]

    def jobs(self, pool: str | None) -> list[Conversion]:
        return [entry.job for entry in self.select(pool)]


def read_manifest(path: str) -> dict:
    """The manifest's YAML as a mapping, from a local path or ``gs://`` (gcsfs: Application Default
    Credentials, ``STORAGE_EMULATOR_HOST`` honoured); anything unreadable is one ManifestError naming it."""
    try:
        with fsspec.open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ManifestError(f"{path}: zoo manifest not found") from None
    except Exception as err:  # permission, network, a directory, bad bytes: one line, whatever the client raised
        raise ManifestError(f"{path}: cannot read the zoo manifest: {_one_line(err)}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ManifestError(f"{path}: not valid YAML: {_one_line(err)}") from None
    if not isinstance(data, dict | None):
        raise ManifestError(f"{path}: expected a mapping (name, deployments, defaults, models), got {type(data).__name__}")
    return data or {}


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def load_manifest(path: str) -> Zoo:
    """Read and check a zoo manifest: every model needs ``source`` and ``destination``; unknown keys are errors;
    with a ``deployments`` table, every pool an entry names must have a deployment."""
    data = read_manifest(path)
    defaults = data.get("defaults") or {}
    deployments = {str(pool): str(name) for pool, name in (data.get("deployments") or {}).items()}
    entries = []
    for index, raw in enumerate(data.get("models") or []):
        entry = {**defaults, **raw}
        label = f"{path}: models[{index}] ({entry.get('name') or entry.get('source', '?')})"
        if unknown := sorted(set(entry) - ENTRY_FIELDS):
            raise ManifestError(f"{label}: unknown field(s) {unknown}; allowed: {sorted(ENTRY_FIELDS)}")
        if missing := [key for key in ("source", "destination") if not entry.get(key)]:
            raise ManifestError(f"{label}: missing {missing}")
        pool, retry_pool = entry.pop("pool", None), entry.pop("retry_pool", None)
        start_wait = entry.pop("start_wait_seconds", None)
        if start_wait is not None and (isinstance(start_wait, bool) or not isinstance(start_wait, int | float)
                                       or start_wait <= 0):
            raise ManifestError(f"{label}: start_wait_seconds must be a positive number of seconds, got {start_wait!r}")
        if retry_pool and not deployments:
            raise ManifestError(f"{label}: retry_pool needs a top-level 'deployments' table (pool -> deployment)")
        if deployments and (unknown_pools := [p for p in (pool, retry_pool) if p and p not in deployments]):
            raise ManifestError(f"{label}: no deployment for pool(s) {unknown_pools}; 'deployments' names "
                                f"{sorted(deployments)}")
        if deployments and not pool:
            raise ManifestError(f"{label}: missing 'pool' (needed to pick a deployment)")
        entries.append(Entry(Conversion(**entry), pool, retry_pool, start_wait))
    slugs = [entry.job.slug for entry in entries]
    if duplicates := sorted({slug for slug in slugs if slugs.count(slug) > 1}):
        raise ManifestError(f"{path}: several models share the artifact key(s) {duplicates}; give them distinct names")
    return Zoo(str(data.get("name") or "zoo"), entries, deployments)


convert_entry = task(convert_one, name="convert-model-entry", task_run_name="model-{job.slug}", cache_policy=NO_CACHE)


@task(name="dispatch-model", task_run_name="dispatch-{entry.job.slug}", cache_policy=NO_CACHE)
def dispatch_entry(entry: Entry, deployments: dict[str, str], timeout_seconds: float, start_wait_seconds: float,
                   run_wait_seconds: float) -> dict:
    """Run the entry as a flow run of its pool's deployment; after a kill, again on its retry pool.

    Returns the run's zoo row (read from its ``conversion-<slug>-row`` artifact) with the pool it
    ran on and the pools tried, or a ``never started`` row when no worker took it in time; raises
    with every pool's failure otherwise.
    """
    logger = get_run_logger()
    failures = []
    start_wait = entry.start_wait_seconds or start_wait_seconds
    for n, pool in enumerate(entry.pools):
        last = n == len(entry.pools) - 1
        parameters = {**entry.job.flow_parameters(), "timeout_seconds": timeout_seconds, "retry_kills": last}
        run = run_deployment(deployments[pool], parameters=parameters, timeout=0,
                             flow_run_name=f"{entry.job.slug}-on-{pool}", as_subflow=True)
        try:
            run = wait_for_run(run, start_wait, run_wait_seconds)
        except NeverStarted as never:
            logger.error("%s: %s", entry.job.slug, never)
            return never_started_row(entry, pool, str(never), failures)
        except RunOverdue as overdue:
            failures.append(f"{pool}: {overdue}")
            break
        if run.state.is_completed():
            row = published_row(run.id, entry.job.slug)
            return {**row, "pool": pool, "pools_tried": list(entry.pools[:n + 1]), "flow_run": run.name}
        failures.append(f"{pool}: {run.state.message}")
        if last or not killed(run.state.message):
            break
        logger.warning("%s was killed on %s (out of memory?): retrying on %s", entry.job.slug, pool,
                       entry.pools[n + 1])
    raise ChildFailed("; then ".join(failures))


def never_started_row(entry: Entry, pool: str, reason: str, failures: list[str]) -> dict:
    """The zoo row of an entry no worker took (after a kill on an earlier pool, that failure comes first)."""
    error = "; then ".join([*failures, f"{pool}: {reason}"]) if failures else reason
    return {**zoo_row(entry.job, None, error, 0), "status": NEVER_STARTED, "pool": pool, "worker": None,
            "pools_tried": list(entry.pools[:entry.pools.index(pool) + 1])}


def published_row(run_id, slug: str) -> dict:
    """The zoo row a ``convert-model`` flow run published."""
    key = f"conversion-{slug}-row"
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), key=ArtifactFilterKey(any_=[key])))
    if not found:
        raise ChildFailed(f"flow run {run_id} completed without its {key} artifact")
    data = found[0].data
    return (json.loads(data) if isinstance(data, str) else data)[0]


@flow(name="convert-zoo", task_runner=ThreadPoolTaskRunner(max_workers=MAX_PARALLEL), log_prints=True)
def convert_zoo(manifest: str = "deploy/zoo.yaml", pool: str | None = None,
                timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
                start_wait_seconds: float = DEFAULT_START_WAIT_SECONDS, run_wait_seconds: float | None = None) -> State:
    """Convert every model of ``manifest`` (a path or ``gs://``) meant for ``pool`` (all if None); publish one
    summary table. ``start_wait_seconds``: how long a dispatched model may wait while no worker of its pool
    can take it (a model's or the manifest's ``defaults``' own value wins). ``run_wait_seconds``: how long
    the zoo waits for a started one (default ``RUN_WAIT_TIMEOUTS`` x ``timeout_seconds``)."""
    logger = get_run_logger()
    try:
        zoo = load_manifest(manifest)
    except ManifestError as err:
        logger.error("%s", err)
        return Failed(message=str(err))
    entries = zoo.select(pool)
    how = "dispatched to their pools' deployments" if zoo.deployments else "in this flow run"
    logger.info("zoo %s: %d of %d models for pool %s, %s", zoo.name, len(entries), len(zoo.entries), pool or "any", how)
    if zoo.deployments:
        run_wait = run_wait_seconds or RUN_WAIT_TIMEOUTS * timeout_seconds
        futures = [dispatch_entry.submit(entry, zoo.deployments, timeout_seconds, start_wait_seconds, run_wait)
                   for entry in entries]
    else:
        futures = [convert_entry.submit(entry.job, timeout_seconds) for entry in entries]
    wait(futures)
    attempts = _conversion_attempts([f"convert-{entry.job.slug}" for entry in entries])
    rows = [_row(entry, future.state, attempts.get(f"convert-{entry.job.slug}", 0))
            for entry, future in zip(entries, futures)]
    key = publish_zoo_summary(zoo.name, rows)
    return _final_state(rows, key)


def _final_state(rows: list[dict], key: str) -> State:
    """Completed if every model converted; else Failed, naming the failed models and those that never started."""
    failed = [f"{row['model']}: {row['error']}" for row in rows if row["status"] == Status.FAILED]
    never = [f"{row['model']} (pool '{row['pool']}')" for row in rows if row["status"] == NEVER_STARTED]
    if not failed and not never:
        return Completed(message=f"{len(rows)} models converted (see artifact {key})", data=rows)
    parts = [f"{len(failed)} of {len(rows)} models failed: " + "; ".join(failed)] if failed else []
    if never:
        parts.append(f"{len(never)} of {len(rows)} models never started (no worker took them; see each row's "
                     f"error): " + ", ".join(never))
    return Failed(message=" | ".join(parts) + f" (see artifact {key})")


def _row(entry: Entry, state: State, attempts: int) -> dict:
    if state.is_completed():
        return {"pool": entry.pool, **state.result()}  # the row names its worker (or why it never started)
    return {**zoo_row(entry.job, None, _error(state), attempts), "pool": None, "worker": None}


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
