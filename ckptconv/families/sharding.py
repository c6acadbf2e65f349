"""MaxText's checkpoint sharding rule, as pure data (no JAX needed to decide it).

MaxText's converter places every leaf on a 1-D mesh of N simulated CPU devices named
``checkpoint_sharding_axis``: shard dim 0 if it divides by N, else dim 1, else replicate.
Deciding the spec without JAX lets the planner predict shard sizes (and memory) before
the conversion process ever starts JAX.
"""

from __future__ import annotations

MESH_AXIS = "checkpoint_sharding_axis"

PartitionSpec = tuple[str | None, ...]


def partition_spec(shape: tuple[int, ...], devices: int) -> PartitionSpec:
    """Return the partition spec MaxText uses for a leaf of ``shape`` on ``devices`` devices.

    Replicated is ``(None,)`` as MaxText records it (``P(None)``), or ``()`` for a scalar.
    ``devices == 1`` never shards (MaxText writes unsharded numpy leaves then).

    >>> partition_spec((151936, 1024), 16)
    ('checkpoint_sharding_axis',)
    >>> partition_spec((1000, 32, 64), 16)
    (None, 'checkpoint_sharding_axis')
    >>> partition_spec((3,), 16)
    (None,)
    """
    if devices <= 1 or len(shape) == 0:
        return ()
    if shape[0] % devices == 0:
        return (MESH_AXIS,)
    if len(shape) > 1 and shape[1] % devices == 0:
        return (None, MESH_AXIS)
    return (None,)


def shard_shape(shape: tuple[int, ...], devices: int) -> tuple[int, ...]:
    """Shape of one device's shard of a leaf under :func:`partition_spec`."""
    spec = partition_spec(shape, devices)
    return tuple(
        dim // devices if axis_index < len(spec) and spec[axis_index] == MESH_AXIS else dim
        for axis_index, dim in enumerate(shape)
    )


def write_shape(shape: tuple[int, ...], devices: int) -> tuple[int, ...]:
    """Shape Orbax records as ``write_shape``: one shard, or one replica's part of it.

    Orbax's replica-parallel save (the CPU default) splits a replicated leaf across the
    replicas on its first axis divisible by the device count; we record the same, and keep
    chunks inside it.

    >>> write_shape((4, 2, 32, 64), 16)
    (4, 2, 2, 64)
    """
    shard = shard_shape(shape, devices)
    if devices > 1 and MESH_AXIS not in partition_spec(shape, devices):
        axis = next((i for i, dim in enumerate(shard) if dim % devices == 0), None)
        if axis is not None:
            shard = shard[:axis] + (shard[axis] // devices,) + shard[axis + 1:]
    return shard
