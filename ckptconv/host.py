"""What the host lends a run: the cores this process may use and the memory available to it.

A run's parallelism and memory budget default from these (:func:`run_options`), read once when the command starts,
so ``plan`` and the report can say what was found. Both look past the machine's totals to what a container is given:
scheduler affinity (``taskset``, a Kubernetes CPU set) and a cgroup's CPU quota for cores; ``MemAvailable`` and a
cgroup's memory limit for memory.
"""

from __future__ import annotations

import math
import os

from ckptconv import settings

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # v2: "QUOTA PERIOD" or "max PERIOD"
CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # v2
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))  # v1


def cores() -> int:
    """The cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota where one is set."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        with open(CGROUP_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, count)


def available_bytes(meminfo: str | None = None) -> int | None:
    """Memory a new allocation can still get without swapping: ``MemAvailable`` (``meminfo``, default
    /proc/meminfo), or a cgroup's limit less its usage where that is lower; None where neither can be read."""
    found = None
    try:
        text = meminfo if meminfo is not None else open("/proc/meminfo").read()
        for line in text.splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if meminfo is None:
        for limit_path, usage_path in CGROUP_MEMORY:
            try:
                with open(limit_path) as f:
                    limit = f.read().strip()
                with open(usage_path) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit.isdigit() and int(limit) < 1 << 60:
                room = max(0, int(limit) - usage)
                found = room if found is None else min(found, room)
            break
    return found


def run_options(*, data_file_bytes: int = settings.IN_FLIGHT.data_file_bytes,
                data_files_by_device: bool | None = settings.DATA_FILES_BY_DEVICE,
                workers: int | None = settings.WORKERS, budget_bytes: int | None = None) -> settings.RunOptions:
    """A run's options from its command line and this host: the budget, unless given, is
    ``settings.BUDGET_SHARE_OF_AVAILABLE`` of the memory available now; the workers are chosen against it once the
    plan is made (:func:`ckptconv.plan.estimate.choose_workers`)."""
    if workers is not None and workers < 1:
        from ckptconv.errors import BadInputError

        raise BadInputError(f"--workers {workers}: at least 1")
    available = available_bytes()
    budget = budget_bytes if budget_bytes is not None else (
        None if available is None else int(available * settings.BUDGET_SHARE_OF_AVAILABLE))
    return settings.RunOptions(data_file_bytes=data_file_bytes, data_files_by_device_asked=data_files_by_device,
                               workers_asked=workers, budget_bytes=budget, budget_asked=budget_bytes is not None,
                               host_cores=cores(), host_available_bytes=available, sandboxed=sandboxed())


def sandboxed() -> bool:
    """Whether this kernel keeps no ``VmHWM`` for a process (gVisor): there the runtime's RSS is counted higher
    (:data:`ckptconv.plan.estimate.BASELINE_SANDBOX_BYTES`) and the peak is sampled (:mod:`ckptconv.monitor`)."""
    from ckptconv import monitor

    return monitor.peak_source(monitor._status()) == monitor.SAMPLED
