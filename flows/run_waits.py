"""How long the zoo waits for a flow run it dispatched to a work pool: never for ever.

Two waits, told apart by whether a worker has started the run. Unstarted, the *start wait* runs
only while nobody can take it (its pool has no worker online, or is paused): a queue behind
busy workers of a live pool is not counted. Started, the *run wait* is far beyond the run's own
timeouts, so only a run whose worker vanished with it (a preempted VM) reaches it. Either way
the run is cancelled, so nothing runs later unasked, and the exception says what happened in
one line.
"""

from __future__ import annotations

import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, StateType, WorkPoolStatus
from prefect.client.schemas.responses import SetStateStatus
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Cancelling

POLL_SECONDS = 2.0  # how often the zoo looks at a dispatched run's state
DEFAULT_START_WAIT_SECONDS = 30 * 60  # how long a dispatched run may wait while no worker can take it
RUN_WAIT_TIMEOUTS = 6  # a started run's bound, in timeout_seconds: 4 conversion attempts, verify, and planning/slack
UNSTARTED = (StateType.SCHEDULED, StateType.PENDING)  # with run_count 0: no worker has run it yet


class NeverStarted(Exception):
    """No worker took a dispatched run within its start wait; the run was cancelled."""


class RunOverdue(Exception):
    """A started run gave no result within the run wait (its worker lost with it?); the run was cancelled."""


def wait_for_run(run: FlowRun, start_wait_seconds: float, run_wait_seconds: float) -> FlowRun:
    """Wait until a dispatched flow run ends; returns it in its final state.

    The start wait runs only while nobody can take the run: it is unstarted and its pool has no
    worker online (or is paused). A queue behind busy workers of a live pool does not count (each
    run ahead of it ends within its own timeout). When the start wait is over the run is cancelled
    (a worker arriving later must not run it unasked) and NeverStarted says which pool and how to
    give it a worker. A started run has the run wait, far beyond its own timeouts: only a run
    whose worker vanished with it (a preempted VM) stays Running that long; it is cancelled and
    RunOverdue says so.
    """
    pool = run.work_pool_name
    unattended_since, started_at = time.monotonic(), None
    with get_client(sync_client=True) as client:
        while not _ended(run := client.read_flow_run(run.id)):
            now = time.monotonic()
            if _started(run):
                started_at = started_at or now
                if now - started_at >= run_wait_seconds:
                    reason = (f"no result {_duration(run_wait_seconds)} after a worker of pool '{pool}' started it "
                              "(the worker lost with it?); its flow run was cancelled")
                    client.set_flow_run_state(run.id, Cancelling(message=reason), force=True)
                    raise RunOverdue(reason)
            elif (status := _pool_status(client, pool)) == WorkPoolStatus.READY:
                unattended_since = now  # a worker is online to take it
            elif now - unattended_since >= start_wait_seconds:
                reason = never_started_reason(pool, status, start_wait_seconds)
                if _withdraw(client, run, reason):
                    raise NeverStarted(reason)
                # refused: a worker took it just now (or the server asks to wait): look again after the
                # usual pause, never in a tight loop against the server
            time.sleep(POLL_SECONDS)
    return run


def _ended(run: FlowRun) -> bool:
    return run.state is not None and run.state.is_final()


def _started(run: FlowRun) -> bool:
    """A worker has run it (Running, Paused, Cancelling, or back to Scheduled for a retry)."""
    return bool(run.run_count) or run.state is None or run.state.type not in UNSTARTED


def _pool_status(client, pool: str | None) -> WorkPoolStatus | None:
    """READY when a worker of ``pool`` is online (busy or not), PAUSED, NOT_READY; None for a pool that is gone."""
    if pool is None:
        return None
    try:
        return client.read_work_pool(pool).status
    except ObjectNotFound:
        return None


def _withdraw(client, run: FlowRun, reason: str) -> bool:
    """Cancel a run no worker has taken; False if one took it meanwhile (the server refuses the cancel)."""
    result = client.set_flow_run_state(run.id, Cancelled(message=reason))
    return result.status == SetStateStatus.ACCEPT


def never_started_reason(pool: str | None, status: WorkPoolStatus | None, waited_seconds: float) -> str:
    """One line: which pool, how long, and the command that gives it a worker."""
    within = _duration(waited_seconds)
    if status == WorkPoolStatus.PAUSED:
        return (f"never started: pool '{pool}' is paused and no worker picked it up within {within}; "
                f"resume it with: prefect work-pool resume {pool}")
    if status is None:
        return f"never started: work pool '{pool}' does not exist; create it and start a worker for it"
    return (f"never started: no worker picked it up on pool '{pool}' within {within}; "
            f"start one with: prefect worker start --pool {pool}")


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 7200 else f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"
