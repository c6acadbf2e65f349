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
    """One line: how many leaves are sharded over how many devices, and whether chunks stay inside shards.

    A chunk crosses a shard boundary only along a *sharded* dim, where it would hold rows of two
    devices' shards (a host loading its shard then reads and decompresses another's). Along an
    unsharded dim every device holds the whole extent, so any chunk size is fine there, dividing
    the dim or not (the last chunk is simply partial): only sharded dims are checked.
    """
    sharded, replicated, crossing, meshes = 0, 0, [], set()
    for leaf in leaves:
        cuts = shard_counts(leaf)
        if any(count > 1 for count in cuts):
            sharded += 1
            meshes.add(math.prod(leaf["mesh_shape"]))
        else:
            replicated += 1
        bad = crossing_dims(leaf["shape"], cuts, leaf.get("chunk_shape"))
        if bad:
            crossing.append(f"{leaf['name']} ({'; '.join(bad)})")
    over = ", ".join(str(m) for m in sorted(meshes)) or str(devices)
    text = f"{sharded} leaves sharded over {over} devices, {replicated} replicated"
    if not sharded and devices == 1:
        text = f"{replicated} leaves unsharded (1 device)"
    if meshes and meshes != {devices}:
        text += f" (requested {devices} devices!)"
    if crossing:
        return text + f"; {len(crossing)} leaves have chunks crossing shard boundaries: {', '.join(crossing[:5])}"
    return text + "; chunks within shards"


def shard_counts(leaf: dict) -> list[int]:
    """Into how many shards each dim of the leaf is cut: the product of the mesh axes its
    partition spec names for that dim (a name, a list of names, or None for unsharded)."""
    mesh, spec = leaf.get("mesh_shape") or [], leaf.get("partition_spec") or []
    names = leaf.get("axis_names") or []
    sizes = dict(zip(names, mesh))
    counts = []
    for dim in range(len(leaf["shape"])):
        entry = spec[dim] if dim < len(spec) else None
        axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
        # without axis names (a 1-D mesh as recorded by older writers) a named dim is cut across the whole mesh
        counts.append(math.prod(sizes.get(axis, math.prod(mesh)) for axis in axes) if axes and mesh else 1)
    return counts


def crossing_dims(shape: list[int], cuts: list[int], chunk: list[int] | None) -> list[str]:
    """Per sharded dim whose chunks do not tile its shards, why: the shard boundaries (every
    ``ceil(dim / count)`` rows) must fall on chunk boundaries (multiples of the chunk size)."""
    if not chunk:
        return []
    bad = []
    for axis, (dim, count, size) in enumerate(zip(shape, cuts, chunk)):
        shard = -(-dim // count)
        if count > 1 and shard % size:
            bad.append(f"dim {axis}: chunks of {size} in shards of {shard}")
    return bad
