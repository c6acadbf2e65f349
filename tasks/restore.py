"""The restore check on a TPU pool: ``ckptconv restore-check`` in a child that opens this host's accelerator.

Only one program at a time may hold a TPU host's chips, so the child holds this host's accelerator limit
(``ckptconv-accelerator-<host>``, one slot) while it runs: two flow runs on one worker check one after the
other instead of failing each other. A program outside Prefect holding the chips (a training job) makes the
child exit 75 (accelerator busy): retried after a delay, never taken for a damaged checkpoint.
"""

from __future__ import annotations

import os
import socket

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ckptconv.plan.devices import device_env
from tasks.admission import MemoryLimit, admitted, ensure_limit
from tasks.child import run_json
from tasks.failures import AcceleratorBusy, ChildFailed
from tasks.job import Conversion, slugify

ACCELERATOR_LIMIT_ENV = "CKPTCONV_ACCELERATOR_LIMIT"  # the limit's name (default: per host)


class RestoreCheckFailed(ChildFailed):
    """A leaf on the accelerator differs from the stored data (not retried)."""


def accelerator_limit() -> MemoryLimit:
    """This host's accelerator: a global concurrency limit of one slot (the chips, whole)."""
    name = os.environ.get(ACCELERATOR_LIMIT_ENV) or f"ckptconv-accelerator-{slugify(socket.gethostname())}"
    return MemoryLimit(name, 1)


def restore_env(cpu_devices: int | None) -> dict[str, str]:
    """The child's environment: JAX's own choice of devices (the host's accelerator), or ``cpu_devices`` CPU devices."""
    env = device_env(cpu_devices) if cpu_devices else dict(os.environ)
    return {**env, "MALLOC_ARENA_MAX": "2", "PYTHONUNBUFFERED": "1"}


def busy(task, task_run, state) -> bool:
    """``retry_condition_fn``: retry only while the accelerator is held by another program."""
    return isinstance(state.result(raise_on_failure=False), AcceleratorBusy)


@task(name="restore-check", task_run_name="restore-check-{job.slug}", cache_policy=NO_CACHE,
      retries=5, retry_delay_seconds=60, retry_condition_fn=busy)
def restore_check(job: Conversion, timeout_seconds: float = 3600) -> dict:
    """Run ``ckptconv restore-check --json`` holding this host's accelerator; its report, with the admission."""
    limit = ensure_limit(accelerator_limit())
    args = ["restore-check", job.destination, "--json"]
    if job.restore_check_cpu_devices:
        args += ["--cpu-devices", str(job.restore_check_cpu_devices)]
    with admitted(limit, 1) as admission:
        result = run_json(args, restore_env(job.restore_check_cpu_devices), timeout_seconds, ok_codes=(0, 1))
    if not result["ok"]:
        raise RestoreCheckFailed(f"restore-check {job.destination}: {len(result['mismatches'])} leaves differ on the "
                                 f"{result['platform']} devices, first: {(result['mismatches'] or ['none checked'])[0]}")
    get_run_logger().info("restore-check OK: %d leaves, %.2f GiB onto %d %s device(s) in %.2f s", result["leaves"],
                          result["bytes"] / 2**30, result["devices"], result["platform"], result["restore_seconds"])
    return {**result, "admission": admission}
