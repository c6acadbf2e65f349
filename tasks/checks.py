"""Checks after a conversion, each in a child process: ``verify`` (bits) and ``inspect`` (layout)."""

from __future__ import annotations

import math

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.child import child_env, run_json
from tasks.failures import ChildFailed, retryable
from tasks.job import Conversion


class VerificationFailed(ChildFailed):
    """The checkpoint does not hold the transformed source bit for bit (not retried)."""


@task(name="verify-checkpoint", task_run_name="verify-{job.slug}", cache_policy=NO_CACHE,
      retries=2, retry_delay_seconds=10, retry_condition_fn=retryable)
def verify_checkpoint(job: Conversion, timeout_seconds: float = 6 * 3600) -> dict:
    """Run ``ckptconv verify --json``: every leaf equals the transformed source, tile by tile."""
    result = run_json(["verify", job.source, job.destination, "--json"], child_env(1), timeout_seconds, ok_codes=(0, 1))
    if not result["ok"]:
        raise VerificationFailed(f"verify {job.destination}: {len(result['mismatches'])} mismatches, first: "
                                 f"{(result['mismatches'] or ['no leaves checked'])[0]}")
    get_run_logger().info("verify OK: %d leaves, %d tensors, %d bytes", result["leaves"], result["tensors"], result["bytes"])
    return result


@task(name="inspect-checkpoint", task_run_name="inspect-{job.slug}", cache_policy=NO_CACHE,
      retries=2, retry_delay_seconds=10, retry_condition_fn=retryable)
def inspect_checkpoint(job: Conversion, timeout_seconds: float = 900) -> dict:
    """Run ``ckptconv inspect --json`` and summarise how the leaves are sharded and chunked."""
    result = run_json(["inspect", job.destination, "--json"], child_env(1), timeout_seconds)
    result["sharding_check"] = sharding_check(result["leaves"], job.devices)
    get_run_logger().info("inspect: %s", result["sharding_check"])
    return result


def sharding_check(leaves: list[dict], devices: int) -> str:
    """One line: how many leaves are sharded over how many devices, and whether chunks stay inside shards."""
    sharded, replicated, crossing, meshes = 0, 0, [], set()
    for leaf in leaves:
        spec, mesh = leaf.get("partition_spec") or [], leaf.get("mesh_shape")
        size = math.prod(mesh) if mesh else 1
        if size > 1 and any(axis is not None for axis in spec):
            sharded += 1
            meshes.add(size)
            shard = [dim // size if i < len(spec) and spec[i] is not None else dim for i, dim in enumerate(leaf["shape"])]
        else:
            replicated += 1
            shard = leaf["shape"]
        chunk = leaf.get("chunk_shape") or shard
        if any(c > s or s % c for c, s in zip(chunk, shard)):
            crossing.append(leaf["name"])
    over = ", ".join(str(m) for m in sorted(meshes)) or str(devices)
    text = f"{sharded} leaves sharded over {over} devices, {replicated} replicated"
    if not sharded and devices == 1:
        text = f"{replicated} leaves unsharded (1 device)"
    if meshes and meshes != {devices}:
        text += f" (requested {devices} devices!)"
    if crossing:
        return text + f"; {len(crossing)} leaves have chunks crossing shard boundaries: {', '.join(crossing[:5])}"
    return text + "; chunks within shards"
