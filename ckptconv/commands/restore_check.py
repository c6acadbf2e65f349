"""``restore-check``: restore a checkpoint onto this host's accelerators as a training job does, then prove every
leaf landed there bit for bit.

The restore is Orbax's own (``PyTreeCheckpointHandler`` as MaxText builds it, a sharded target: what MaxText's
``load_parameters_path`` does): each leaf's stored sharding is mapped onto a 1-D mesh of the host's devices under
the stored axis names, so a 16-device layout lands on 1, 4 or 8 chips, whatever the host has. A dimension the host's
device count does not divide is replicated instead (the report counts them); a leaf stored unsharded (a 1-device
layout) is sharded by MaxText's converter rule for the host's count.

"Stored data" means the checkpoint's own bytes: after the restore, every shard on every device is copied back one
at a time and compared, byte for byte, with the same region read from the stored chunks on the CPU with
tensorstore (decoded, each shard index's crc32c checked), in pieces of at most ``PIECE_BYTES``. So the host holds one
shard of one leaf and one piece, never the model, and the check is independent of Orbax's restore path: a shard
placed on the wrong device, a wrong mapping, a bad transfer are all found. That the stored bytes are the
transformed source is ``verify SRC DST``'s proof; ``--source SRC`` runs it first, so the chain from the HF files to
the chip is closed in one command. A chunk that does not decode is found by the restore and named by leaf.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ckptconv import layout, monitor
from ckptconv.accelerator import open_backends
from ckptconv.errors import RuntimeSetupError
from ckptconv.families.sharding import partition_spec
from ckptconv.read.stored import (
    StoredLeaf, decode_problems, finish_leaf_read, open_leaf_checked, read_ahead, read_back, read_leaf_region,
    read_metadata,
)

GIB = 1024**3
PIECE_BYTES = 64 * 1024**2  # stored bytes read and compared at a time (per shard: rows along its first axis)
READS_AHEAD = 3  # pieces in flight: tensorstore reads and decodes the next while one is compared
# The handler MaxText's load_params_from_path restores with: its checkpoint_storage_concurrent_gb (96 by default; older
# MaxText's bare PyTreeCheckpointer() has the same default), zarr3 and OCDBT (a restore follows the stored format).
# On the TPU v5e host 1 or 4 GB in flight restored no faster than 96 (docs/tpu.md): nothing there to tune.
MAXTEXT_HANDLER = {"restore_concurrent_gb": 96, "use_ocdbt": True, "use_zarr3": True}
# Orbax 0.12.8's coroutine that reads one shard and puts it on its device (orbax/checkpoint/_src/serialization/).
ORBAX_READ_COROUTINE = "_read_array_index_and_device_put"


@dataclass
class RestoreCheck:
    """What a restore onto the host's devices cost and whether every leaf arrived intact."""

    destination: str
    platform: str = ""
    devices: int = 0
    device_kind: str = ""
    leaves: int = 0
    bytes: int = 0
    open_seconds: float = 0.0  # the backend's start (the TPU runtime: ~15 s)
    metadata_seconds: float = 0.0
    restore_seconds: float = 0.0
    check_seconds: float = 0.0
    device_bytes_in_use: int | None = None  # the runtime's own figure after the restore (largest device)
    device_peak_bytes: int | None = None
    restored_bytes_per_device: int = 0  # the restored shards' bytes on the fullest device
    replicated_not_divisible: list[str] = field(default_factory=list)
    leaves_checked: int = 0
    bytes_checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    source_verified: dict | None = None
    peak_rss_bytes: int = 0  # VmHWM; where the kernel keeps none (gVisor), ru_maxrss, which includes the parent's
    rss_bytes: dict = field(default_factory=dict)  # VmRSS when opened, after the restore, after the check

    @property
    def ok(self) -> bool:
        return not self.mismatches and self.leaves_checked == self.leaves > 0

    @property
    def gib_per_s(self) -> float | None:
        return round(self.bytes / GIB / self.restore_seconds, 3) if self.restore_seconds > 0 else None

    def summary(self) -> str:
        verdict = "OK" if self.ok else f"FAILED ({len(self.mismatches)} mismatches)"
        memory = (f"{self.device_bytes_in_use / GIB:.2f} GiB in use on the fullest device"
                  if self.device_bytes_in_use is not None else
                  f"{self.restored_bytes_per_device / GIB:.2f} GiB restored on the fullest device")
        return (f"restore-check: {verdict}: {self.leaves} leaves, {self.bytes / GIB:.2f} GiB restored onto "
                f"{self.devices} {self.platform} device(s) in {self.restore_seconds:.2f} s ({self.gib_per_s} GiB/s); "
                f"{memory}; {self.leaves_checked} leaves ({self.bytes_checked / GIB:.2f} GiB) equal to the stored data "
                f"bit for bit ({self.check_seconds:.1f} s); peak RSS {self.peak_rss_bytes / GIB:.2f} GiB")

    def to_json(self) -> dict:
        return {"ok": self.ok, "destination": self.destination, "platform": self.platform, "devices": self.devices,
                "device_kind": self.device_kind, "leaves": self.leaves, "bytes": self.bytes,
                "open_seconds": round(self.open_seconds, 3), "metadata_seconds": round(self.metadata_seconds, 3),
                "restore_seconds": round(self.restore_seconds, 3), "gib_per_s": self.gib_per_s,
                "check_seconds": round(self.check_seconds, 3), "device_bytes_in_use": self.device_bytes_in_use,
                "device_peak_bytes": self.device_peak_bytes,
                "restored_bytes_per_device": self.restored_bytes_per_device,
                "replicated_not_divisible": self.replicated_not_divisible, "leaves_checked": self.leaves_checked,
                "bytes_checked": self.bytes_checked, "mismatches": self.mismatches,
                "source_verified": self.source_verified, "peak_rss_bytes": self.peak_rss_bytes,
                "rss_bytes": self.rss_bytes}


def restore_check(dst: str, *, source: str | None = None, hf_token_file: str | None = None,
                  check: bool = True) -> RestoreCheck:
    """Restore ``dst`` onto this process's JAX devices and compare every shard with the stored data.

    ``source``: first ``verify`` the stored data against it (the transformed HF checkpoint, on the CPU).
    ``check=False`` restores and measures only (benchmark rounds after a checked one).
    """
    dst = layout.absolute(dst)
    result = RestoreCheck(destination=dst)
    started = time.perf_counter()
    devices = open_backends()
    result.open_seconds = time.perf_counter() - started
    result.platform, result.devices, result.device_kind = devices[0].platform, len(devices), devices[0].device_kind
    result.rss_bytes["opened"] = monitor.current_rss_bytes()
    if source is not None:
        from ckptconv.commands.verification import verify

        verified = read_back(dst, lambda: verify(source, dst, hf_token_file=hf_token_file))
        result.source_verified = verified.to_json()
        result.mismatches += [f"against {source}: {line}" for line in verified.mismatches]
    started = time.perf_counter()
    stored, _ = read_back(dst, lambda: read_metadata(dst))
    result.metadata_seconds = time.perf_counter() - started
    result.leaves = len(stored)
    result.bytes = sum(_nbytes(leaf) for leaf in stored)
    target = host_target(stored, devices, result.replicated_not_divisible)
    restored = restore(dst, stored, target, result)
    if restored is not None:
        try:
            result.rss_bytes["restored"] = monitor.current_rss_bytes()
            _device_memory(devices, restored, result)
            if check:
                started = time.perf_counter()
                compare(dst, stored, restored, result)
                result.check_seconds = time.perf_counter() - started
                result.rss_bytes["checked"] = monitor.current_rss_bytes()
        finally:  # however the check ends (a stored chunk that fails, an interrupt): the devices are the caller's
            free(restored)
    result.peak_rss_bytes = monitor.peak_rss_bytes()
    return result


def host_target(stored: list[StoredLeaf], devices: list, replicated: list[str]) -> dict:
    """The restore target, one ``jax.ShapeDtypeStruct`` per leaf (nested as stored), sharded over ``devices``.

    Each stored axis name becomes a mesh axis: the first holds every device, any other has size 1, as the
    converters' 1-D meshes do. ``replicated`` collects the leaves with a dimension the host cannot divide.
    """
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from ckptconv.families.sharding import MESH_AXIS

    meshes: dict[tuple[str, ...], Mesh] = {}
    tree: dict = {}
    for leaf in stored:
        axes = tuple(leaf.axis_names or ()) or (MESH_AXIS,)
        if axes not in meshes:
            grid = np.array(devices, dtype=object).reshape((len(devices),) + (1,) * (len(axes) - 1))
            meshes[axes] = Mesh(grid, axes)
        sizes = dict(zip(axes, meshes[axes].devices.shape))
        spec = list(leaf.partition_spec) if leaf.mesh_shape is not None else list(partition_spec(leaf.shape, len(devices)))
        for dim, entry in enumerate(spec[:len(leaf.shape)]):
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            if leaf.shape[dim] % int(np.prod([sizes.get(name, 1) for name in names])):
                spec[dim] = None
                replicated.append(leaf.name)
        node = tree
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        sharding = NamedSharding(meshes[axes], PartitionSpec(*spec[:len(leaf.shape)]))
        node[leaf.path[-1]] = jax.ShapeDtypeStruct(leaf.shape, np.dtype(leaf.dtype), sharding=sharding)
    return tree


def restore(dst: str, stored: list[StoredLeaf], target: dict, result: RestoreCheck) -> dict | None:
    """Orbax's restore of the whole tree onto the target's devices, timed to the last byte on device; the
    restored leaves by path. A chunk that does not decode becomes a mismatch line naming its leaf (None back)."""
    import jax
    import orbax.checkpoint as ocp

    items = layout.items_path(dst).as_posix()
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    started = time.perf_counter()
    tree, too_big, damaged = None, False, []
    loud_again = _quiet_abandoned_reads()  # before: the other reads may end the moment one fails
    try:
        # partial: the stored tree may hold empty nodes (MaxText's opt_state {}), which hold no leaf to restore
        tree = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**MAXTEXT_HANDLER)).restore(
            items, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
        jax.block_until_ready(tree)
    except BaseException as err:
        if tree is not None:  # restored, then a transfer failed: these leaves are nobody else's to free
            free_tree(tree)
        if isinstance(err, jax.errors.JaxRuntimeError):
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            too_big = True
        elif isinstance(err, Exception):  # Orbax wraps tensorstore's DATA_LOSS (a digest mismatch) in a bare one
            damaged = decode_problems(items, stored)  # read one chunk at a time: which leaf holds the damage
            if not damaged:
                raise
        else:  # an interrupt
            raise
    if too_big or damaged:
        # out here the failure is gone: the leaves the restore had placed before it failed, held in its coroutines'
        # frames (reference cycles), go back to the devices now, not whenever the collector next runs. (Orbax leaves
        # the tasks still reading on its closed loop: what they hold goes once tensorstore drops them.)
        gc.collect()
        if too_big:
            raise RuntimeSetupError(f"{dst}: {result.bytes / GIB:.2f} GiB do not fit the memory of {result.devices} "
                                    f"{result.platform} device(s) as stored sharded; run on a host with more devices "
                                    "(the checkpoint was not found at fault)")
        result.mismatches += damaged
        return None
    loud_again()
    result.restore_seconds = time.perf_counter() - started
    return {leaf.path: _at(tree, leaf.path) for leaf in stored}


def _quiet_abandoned_reads() -> Callable[[], None]:
    """When one read fails, Orbax closes its event loop with the other shards' reads still in flight: as they end, or
    as their coroutines are collected (now, later, at exit), Python printed "Exception ignored in <coroutine
    _read_array_index_and_device_put>" or "RuntimeError: Event loop is closed" with a traceback, of the very failure
    this check reports as one mismatch line. Those two, and only those, go unprinted (sys.unraisablehook, measured
    as the printer of both) until the returned function is called, after a restore that did not fail: a failed one
    leaves them unprinted to the process's end. Anything else unraisable is passed to the hook that was there."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_orbax_reads", False):
        return lambda: None

    def hook(unraisable) -> None:
        abandoned_read = getattr(unraisable.object, "__qualname__", None) == ORBAX_READ_COROUTINE
        closed_loop = unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
        if not (abandoned_read or closed_loop):
            previous(unraisable)

    hook.quiets_orbax_reads = True
    sys.unraisablehook = hook

    def undo() -> None:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous

    return undo


def free(restored: dict) -> None:
    """Delete every restored leaf from its devices (one already deleted by the check is passed over): a library
    caller whose check raised must not be left holding the model's device memory until garbage collection."""
    free_tree(list(restored.values()))


def free_tree(tree) -> None:
    """Delete every array of ``tree`` (a pytree) from its devices, those not deleted already."""
    import jax

    for array in jax.tree.leaves(tree):
        if isinstance(array, jax.Array) and not array.is_deleted():
            array.delete()


def compare(dst: str, stored: list[StoredLeaf], restored: dict, result: RestoreCheck) -> None:
    """Every shard of every restored leaf against the stored region it should hold; one line per leaf that differs."""
    items = layout.items_path(dst).as_posix()
    for leaf in stored:
        array = restored[leaf.path]
        store = open_leaf_checked(items, leaf.path)
        problem = None
        for shard in array.addressable_shards:
            held = np.asarray(shard.data)  # one shard on the host at a time
            box = _box(shard.index, leaf.shape)
            problem = _compare_shard(items, leaf, store, held, box, shard.device)
            if problem:
                break
            result.bytes_checked += held.nbytes
            del held
        if problem:
            result.mismatches.append(problem)
        else:
            result.leaves_checked += 1
        array.delete()


def _compare_shard(items: str, leaf: StoredLeaf, store, held: np.ndarray, box: tuple[slice, ...], device) -> str | None:
    """The mismatch line for one shard, or None when every byte equals the stored region."""
    if held.ndim == 0:  # a scalar (MaxText's step, int64 stored, int32 on devices while JAX runs without x64)
        expected = read_leaf_region(items, leaf.name, store, ())
        if expected.astype(held.dtype).tobytes() != held.tobytes() or expected.astype(held.dtype) != expected:
            return f"{leaf.name}: on device {device.id}: {held} restored, {expected} stored"
        return None
    held = np.ascontiguousarray(held)  # C order, whatever layout the device's copy came back in
    rows = max(1, PIECE_BYTES // max(1, held[:1].nbytes))
    starts = range(0, held.shape[0], rows)
    pieces = ((start, store[_piece(box, start, rows)].read()) for start in starts)
    for start, reading in read_ahead(pieces, READS_AHEAD):  # READS_AHEAD pieces read while one is compared
        expected = finish_leaf_read(items, leaf.name, reading)
        got = held[start:start + rows]
        if not np.array_equal(got.view(np.uint8), expected.view(np.uint8)):
            diff = np.flatnonzero(got.view(np.uint8).reshape(-1) != expected.view(np.uint8).reshape(-1))
            return (f"{leaf.name}: on device {device.id}, region {_fmt(_piece(box, start, rows))} differs from the "
                    f"stored data (first differing byte {int(diff[0]) if diff.size else '?'} of the region)")
    return None


def _piece(box: tuple[slice, ...], start: int, rows: int) -> tuple[slice, ...]:
    """Rows ``start:start + rows`` of the shard at ``box``, in the leaf's coordinates."""
    return (slice(box[0].start + start, min(box[0].stop, box[0].start + start + rows)),) + box[1:]


def _device_memory(devices: list, restored: dict, result: RestoreCheck) -> None:
    """The runtime's bytes in use (TPU, GPU; None where it keeps no account, as on CPU) and the restored shards'
    bytes on the fullest device."""
    per_device: dict[int, int] = {}
    for array in restored.values():
        for shard in array.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    result.restored_bytes_per_device = max(per_device.values(), default=0)
    stats = [device.memory_stats() or {} for device in devices]
    in_use = [s["bytes_in_use"] for s in stats if "bytes_in_use" in s]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    result.device_bytes_in_use = max(in_use) if in_use else None
    result.device_peak_bytes = max(peaks) if peaks else None


def _at(tree, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _box(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(dim)[:2]) for s, dim in zip(index, shape))


def _nbytes(leaf: StoredLeaf) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _fmt(index: tuple[slice, ...]) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in index) + "]"
