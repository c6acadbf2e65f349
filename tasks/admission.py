"""Memory-aware admission: a conversion holds its predicted peak, in GiB, of a per-worker limit.

Each worker host has one Prefect global concurrency limit, ``ckptconv-memory-gb-<host>``,
whose size is the host's RAM in GiB minus some headroom. A conversion occupies
``ceil(predicted peak / GiB)`` slots of it while its child runs, so several small models
share a VM but two that together exceed its RAM never run at once. Settings (environment,
e.g. a deployment's job variables): ``CKPTCONV_MEMORY_LIMIT`` (name),
``CKPTCONV_MEMORY_GB`` (size; default RAM, or the container's memory limit, minus
``CKPTCONV_MEMORY_HEADROOM_GB``, default 2).
An existing limit keeps the size it has on the server; a missing one is created.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from tasks.failures import TooBigForWorker
from tasks.job import slugify

GIB = 1024**3
DEFAULT_HEADROOM_GB = 2
_CREATING = threading.Lock()  # one creator per process: concurrent zoo entries would race
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


@dataclass(frozen=True)
class MemoryLimit:
    """A global concurrency limit whose slots are GiB of this worker's RAM."""

    name: str
    gb: int


def configured_limit(env: Mapping[str, str] = os.environ) -> MemoryLimit:
    """This worker's limit as configured: name and size from the environment, else host name and RAM."""
    name = env.get("CKPTCONV_MEMORY_LIMIT") or f"ckptconv-memory-gb-{slugify(socket.gethostname())}"
    if env.get("CKPTCONV_MEMORY_GB"):
        return MemoryLimit(name, int(env["CKPTCONV_MEMORY_GB"]))
    ram_gb = ram_bytes() // GIB
    return MemoryLimit(name, max(1, ram_gb - int(env.get("CKPTCONV_MEMORY_HEADROOM_GB", DEFAULT_HEADROOM_GB))))


def ram_bytes() -> int:
    """Physical memory, or the container's cgroup memory limit if that is lower (workers run in containers)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(physical, int(text))
    return physical


def ensure_limit(wanted: MemoryLimit) -> MemoryLimit:
    """Create the limit if the server lacks it; return it as the server has it."""
    with _CREATING, get_client(sync_client=True) as client:
        try:
            return MemoryLimit(wanted.name, client.read_global_concurrency_limit_by_name(wanted.name).limit)
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=wanted.name, limit=wanted.gb))
            return wanted
        except ObjectAlreadyExists:  # another process on this worker created it first
            return MemoryLimit(wanted.name, client.read_global_concurrency_limit_by_name(wanted.name).limit)


def slots_needed(predicted_peak_bytes: int, limit: MemoryLimit) -> int:
    """Whole GiB to hold for a predicted peak; a model bigger than the worker fails here, clearly."""
    gb = max(1, math.ceil(predicted_peak_bytes / GIB))
    if gb > limit.gb:
        raise TooBigForWorker(
            f"predicted peak memory {predicted_peak_bytes / GIB:.1f} GiB needs {gb} GB of '{limit.name}', "
            f"which has {limit.gb} GB: run this model on a pool with more memory, or raise CKPTCONV_MEMORY_GB"
        )
    return gb


@contextmanager
def admitted(limit: MemoryLimit, gb: int) -> Iterator[dict]:
    """Hold ``gb`` slots of ``limit`` for the block; yields a record of when (filled on exit)."""
    record = {"limit": limit.name, "limit_gb": limit.gb, "held_gb": gb, "requested_at": _now()}
    with concurrency(limit.name, occupy=gb, strict=True):
        record["admitted_at"] = _now()
        try:
            yield record
        finally:
            record["released_at"] = _now()


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")
