"""Restoring ckptconv checkpoints onto a TPU host's chip, against the least a start without conversion does (issue 39).

    python -m bench tpu-restore --out DIR                      (or: python -m bench.tpu_restore --out DIR)
    python -m bench tpu-restore --shapes 0.6b --layers-8b 4 --rounds 3 --work /tmp/tpu-restore --out DIR

On the TPU host (docs/tpu.md says how to install ckptconv there), in one command:
1. synthesises Qwen3-0.6B's shape (28 layers, 1.1 GiB) and Llama-3-8B's widths with ``--layers-8b`` layers
   (``ckptconv.commands.synth``, ``fast``: random bf16 cut from one pool, as incompressible as fresh values);
2. converts each three ways, side by side, each in its own ``python -m ckptconv convert`` (JAX on the CPU):
   16 devices with data files by device (the default at these sizes), 16 devices in the source's order
   (``--no-data-files-by-device``), and 1 device (``--layouts`` picks from LAYOUTS, which also holds the
   chunks uncompressed or zstd);
3. in ONE child that opens the chip once (opening it costs ~15 s), for each round: every checkpoint restored
   with ``ckptconv.commands.restore_check`` (Orbax's restore, the stored shardings mapped onto the host's
   devices; the first round also checks every shard against the stored data), and the no-conversion floor:
   each safetensors tensor of the source read (``pread``) and ``jax.device_put`` onto the chip, no transform,
   timed to the last byte on device. Once per checkpoint, where the restore's time goes: Orbax's restore into
   host NumPy alone, ``jax.device_put`` of those arrays alone, and tensorstore's reads of every leaf alone.
   ``--batched``: also, each round, the bounded batched restore (``batched()``); ``--diagnose``: once per
   checkpoint, Orbax's device path timed in its parts and with one part changed at a time (``diagnose()``);
4. writes ``results.json`` (every run) and ``table.md`` (min-max per case) to ``--out``, after every step, so
   a command cut off by its time limit still returns what it measured, and prints the table at the end.

The figures measured so far, and what they say: docs/tpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3
REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {  # name -> convert flags
    "16-by-device": ["--devices", "16", "--data-files-by-device"],  # 16 devices, data files by device (the default)
    "16-source-order": ["--devices", "16", "--no-data-files-by-device"],  # 16 devices, in the source's order
    "1-device": ["--devices", "1"],
    # the chunks' codec (the default above: blosc lz4 over bit planes) against Orbax's restore path (issue 39)
    "16-by-device-uncompressed": ["--devices", "16", "--data-files-by-device", "--compression", "none"],
    "1-device-uncompressed": ["--devices", "1", "--compression", "none"],
    "16-by-device-zstd": ["--devices", "16", "--data-files-by-device", "--compression", "zstd"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpu_restore", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.6b,8b", help="comma-separated: 0.6b, 8b (tiny: a smoke run)")
    parser.add_argument("--layers-8b", type=int, default=4, help="layers of the Llama-3-8B-wide model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default="/tmp/tpu-restore", help="where checkpoints are written (kept, reused)")
    parser.add_argument("--out", default=".", help="where results.json and table.md go")
    parser.add_argument("--layouts", default="16-by-device,16-source-order,1-device", help="comma-separated, of: " + ", ".join(LAYOUTS))
    parser.add_argument("--batched", action="store_true", help="also time the batched restore (Orbax into host NumPy "
                        "a batch of leaves at a time, one device_put per batch while the next is read)")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the breakdown runs")
    parser.add_argument("--diagnose-reps", type=int, default=2, help="runs of each diagnosis variant")
    parser.add_argument("--no-check", dest="check", action="store_false", help="restore only; no round checks "
                        "every shard against the stored data")
    parser.add_argument("--diagnose", action="store_true", help="also, once per checkpoint: Orbax's device path timed "
                        "in its parts, and with one part changed at a time (see diagnose())")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child's plan (JSON)
    args = parser.parse_args(argv)
    if args.measure:
        return _measure(json.loads(Path(args.measure).read_text()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = {"cases": [], "rounds": args.rounds, "out": str(out), "batched": args.batched, "breakdown": args.breakdown,
            "diagnose": args.diagnose, "check": args.check,
            "diagnose_reps": args.diagnose_reps}
    layouts = {name: LAYOUTS[name] for name in args.layouts.split(",")}
    for shape in args.shapes.split(","):
        plan["cases"].append(prepare(shape, args.layers_8b, Path(args.work), layouts))
        (out / "plan.json").write_text(json.dumps(plan, indent=2))
    child = subprocess.run([sys.executable, "-m", "bench.tpu_restore", "--measure", str(out / "plan.json")],
                           cwd=REPO, env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})
    if (out / "table.md").exists():
        print((out / "table.md").read_text(), end="")
    return child.returncode


def prepare(shape: str, layers_8b: int, work: Path, layouts: dict[str, list[str]]) -> dict:
    """Synthesise ``shape`` and convert it in each layout (reused when already there); the case's paths."""
    from dataclasses import replace

    from ckptconv.commands import synth

    model = {"0.6b": synth.QWEN3_0_6B, "8b": replace(synth.LLAMA3_8B, num_layers=layers_8b),
             "tiny": synth.SynthModel()}[shape]  # tiny: a smoke run of this script anywhere
    name = f"{shape}-{model.num_layers}l"
    src = work / name / "src"
    case = {"shape": name, "source": str(src), "checkpoints": {}, "prepare_seconds": {}}
    if not (src / "config.json").exists():
        started = time.perf_counter()
        synth.write_checkpoint(model, str(src), max_shard_bytes=5 * GIB, fast=True)
        case["prepare_seconds"]["synth"] = round(time.perf_counter() - started, 1)
    running = {}
    for layout, flags in layouts.items():
        dst = work / name / layout
        case["checkpoints"][layout] = str(dst)
        env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
        running[layout] = (time.perf_counter(), subprocess.Popen(
            [sys.executable, "-m", "ckptconv", "convert", str(src), str(dst), *flags, "--progress", "none"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for layout, (started, proc) in running.items():
        text, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"convert {layout} failed: {text[-2000:]}")
        case["prepare_seconds"][f"convert {layout} (side by side)"] = round(time.perf_counter() - started, 1)
    return case


# ---------------------------------------------------------------------------------------------
# The child: opens the chip once and measures every case


def _measure(plan: dict) -> int:
    import jax

    from ckptconv.accelerator import open_backends
    from ckptconv.commands.restore_check import restore_check

    out = Path(plan["out"])
    started = time.perf_counter()
    devices = open_backends()
    results = {"open_seconds": round(time.perf_counter() - started, 2), "devices": [str(d) for d in devices],
               "versions": {"jax": jax.__version__}, "runs": [], "breakdown": [],
               "env": {k: v for k, v in os.environ.items() if k.startswith(("TPU_", "LIBTPU", "XLA_"))}}
    for case in plan["cases"]:
        _read_all(Path(case["source"]))  # the page cache warm for everyone, as for every round after
        for dst in case["checkpoints"].values():
            _read_all(Path(dst))
    for round_ in range(plan["rounds"]):
        for case in plan["cases"]:
            for layout, dst in case["checkpoints"].items():
                checked = round_ == 0 and plan.get("check", True)
                check = restore_check(dst, check=checked).to_json()
                results["runs"].append({"shape": case["shape"], "case": layout, "round": round_, **{
                    k: check[k] for k in ("ok", "restore_seconds", "metadata_seconds", "gib_per_s", "bytes",
                                          "check_seconds", "leaves_checked", "leaves", "device_bytes_in_use",
                                          "device_peak_bytes", "peak_rss_bytes", "rss_bytes", "mismatches", "devices",
                                          "replicated_not_divisible")}})
                _write(out, results)
                if plan.get("batched"):
                    results["runs"].append({"shape": case["shape"], "case": f"{layout}, batched", "round": round_,
                                            **batched(dst, devices, check=checked)})
                    _write(out, results)
            results["runs"].append({"shape": case["shape"], "case": "floor: safetensors read + device_put",
                                    "round": round_, **floor(Path(case["source"]), devices[0])})
            _write(out, results)
    for case in plan["cases"] if plan.get("breakdown", True) else []:
        for layout, dst in case["checkpoints"].items():
            results["breakdown"].append({"shape": case["shape"], "case": layout, **breakdown(dst, devices)})
            _write(out, results)
    for case in plan["cases"] if plan.get("diagnose") else []:
        for layout, dst in case["checkpoints"].items():
            entry = {"shape": case["shape"], "case": layout}
            results.setdefault("diagnosis", []).append(entry)
            diagnose(dst, devices, entry, lambda: _write(out, results), reps=plan.get("diagnose_reps", 2))
            _write(out, results)
    return 0


def floor(src: Path, device) -> dict:
    """Each safetensors tensor read with ``pread`` and put on ``device`` as it is, timed to the last byte there."""
    import jax
    import ml_dtypes
    import numpy as np

    dtypes = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16}
    started = time.perf_counter()
    arrays, nbytes = [], 0
    for file in sorted(src.glob("*.safetensors")):
        fd = os.open(file, os.O_RDONLY)
        try:
            (length,) = np.frombuffer(os.pread(fd, 8, 0), dtype="<u8")
            header = json.loads(os.pread(fd, int(length), 8))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                begin, end = entry["data_offsets"]
                buffer = np.empty(end - begin, dtype=np.uint8)
                os.preadv(fd, [buffer], 8 + int(length) + begin)
                host = buffer.view(dtypes[entry["dtype"]]).reshape(entry["shape"])
                arrays.append(jax.device_put(host, device))
                nbytes += host.nbytes
        finally:
            os.close(fd)
    jax.block_until_ready(arrays)
    seconds = time.perf_counter() - started
    for array in arrays:
        array.delete()
    return {"restore_seconds": round(seconds, 3), "bytes": nbytes, "gib_per_s": round(nbytes / GIB / seconds, 3)}


def batched(dst: str, devices: list, check: bool, batch_bytes: int = 2 * GIB) -> dict:
    """The cut the breakdown points to: Orbax reads leaves into host NumPy, a batch of at most ``batch_bytes`` at a
    time, and each batch goes onto the devices in one ``jax.device_put`` (a thread) while the next is read; so at most
    two batches are in host RAM. Timed to the last byte on device; ``check``: every shard compared with the stored
    data (restore_check.compare) afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from ckptconv import layout
    from ckptconv.commands.restore_check import RestoreCheck, compare, host_target
    from ckptconv.read.stored import read_metadata

    items = layout.items_path(dst).as_posix()
    stored, _ = read_metadata(dst)
    target = host_target(stored, devices, [])
    paths = [leaf.path for leaf in stored]
    shapes = {leaf.path: _at(target, leaf.path) for leaf in stored}
    batches, size = [[]], 0
    for leaf in stored:
        nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        if batches[-1] and size + nbytes > batch_bytes:
            batches.append([])
            size = 0
        batches[-1].append(leaf.path)
        size += nbytes
    placed: dict = {}
    started = time.perf_counter()
    with ThreadPoolExecutor(1) as put:
        pending = None
        for batch in batches:
            item = _tree({path: shapes[path] for path in batch})
            args = jax.tree.map(lambda t: ocp.RestoreArgs(restore_type=np.ndarray), item)
            host = ocp.PyTreeCheckpointer().restore(items, args=ocp.args.PyTreeRestore(
                item=item, restore_args=args, partial_restore=True))
            if pending is not None:
                placed.update(pending.result())
            values = [_at(host, path) for path in batch]
            pending = put.submit(lambda b, v: dict(zip(b, jax.block_until_ready(
                jax.device_put(v, [shapes[p].sharding for p in b])))), batch, values)
        placed.update(pending.result())
    seconds = time.perf_counter() - started
    nbytes = sum(array.nbytes for array in placed.values())
    result = RestoreCheck(destination=dst, leaves=len(stored))
    if check:
        compare(dst, stored, placed, result)
    for array in placed.values():
        array.delete()
    return {"restore_seconds": round(seconds, 3), "bytes": nbytes, "gib_per_s": round(nbytes / GIB / seconds, 3),
            "batches": len(batches), "ok": result.ok if check else None, "leaves_checked": result.leaves_checked,
            "mismatches": result.mismatches, "paths": len(paths)}


def _tree(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def breakdown(dst: str, devices: list) -> dict:
    """Where one restore's time goes: Orbax into host NumPy alone, ``device_put`` of that alone, tensorstore's reads
    alone (every leaf opened and read concurrently, no Orbax)."""
    import asyncio

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from ckptconv import layout
    from ckptconv.commands.restore_check import host_target
    from ckptconv.read.stored import open_items_leaf, read_metadata

    items = layout.items_path(dst).as_posix()
    stored, _ = read_metadata(dst)
    target = host_target(stored, devices, [])
    host_args = jax.tree.map(lambda t: ocp.RestoreArgs(restore_type=np.ndarray), target)
    started = time.perf_counter()
    host = ocp.PyTreeCheckpointer().restore(items, args=ocp.args.PyTreeRestore(
        item=target, restore_args=host_args, partial_restore=True))
    orbax_host = time.perf_counter() - started
    leaves, treedef = jax.tree.flatten(host)
    shardings = [t.sharding for t in jax.tree.leaves(target)]
    started = time.perf_counter()
    placed = jax.device_put(leaves, shardings)
    jax.block_until_ready(placed)
    put = time.perf_counter() - started
    for array in placed:
        array.delete()
    del host, leaves

    async def read_all():
        async def one(leaf):
            store = await asyncio.to_thread(open_items_leaf, items, leaf.path)
            return (await store.read()).nbytes
        return sum(await asyncio.gather(*(one(leaf) for leaf in stored)))

    started = time.perf_counter()
    nbytes = asyncio.run(read_all())
    reads = time.perf_counter() - started
    return {"orbax_to_host_seconds": round(orbax_host, 3), "device_put_seconds": round(put, 3),
            "tensorstore_reads_seconds": round(reads, 3), "bytes": nbytes}


# Orbax's restore, one part of its device path changed at a time: (read with tensorstore's own ``read()`` instead of
# np.zeros + a copy into it, device_put from a thread instead of the event loop, the read into a 4096-byte aligned
# buffer instead of np.zeros'). Every variant is timed in its parts (see _instrumented).
VARIANTS = {
    "orbax as is": dict(direct=False, threaded=False, aligned=False),
    "read(): no np.zeros + copy": dict(direct=True, threaded=False, aligned=False),
    "device_put off the event loop": dict(direct=False, threaded=True, aligned=False),
    "read() and device_put off the loop": dict(direct=True, threaded=True, aligned=False),
    "np.zeros -> 4096-aligned buffer": dict(direct=False, threaded=False, aligned=True),
}


def diagnose(dst: str, devices: list, entry: dict, save, reps: int = 2) -> None:
    """Where Orbax's restore onto the devices spends what the reads and one batched ``device_put`` do not (issue 39).

    Fills ``entry`` (``save()`` after each run): ``orbax``, per variant (VARIANTS, and Orbax's own
    ``restore_concurrent_gb`` at 1 and 4 GB), each rep's wall and its parts: ``setup_s`` (restore call to the first
    shard's read: metadata, opening, shardings), ``reads_span_s``, ``read_sum_s``, ``put_sum_s`` (time inside
    ``device_put`` calls), ``after_last_put_s`` (to the last byte on device); ``device_put``: the checkpoint's leaves
    in host memory put onto the devices in one call, one call per leaf, or from 8 threads, for tensorstore's own
    arrays, malloc'd copies (np.empty) and 4096-byte aligned copies."""
    from ckptconv import layout
    from ckptconv.commands.restore_check import host_target
    from ckptconv.read.stored import read_metadata

    items = layout.items_path(dst).as_posix()
    stored, _ = read_metadata(dst)
    target = host_target(stored, devices, [])
    entry["orbax"] = {}
    for _ in range(reps):
        for name, variant in VARIANTS.items():
            entry["orbax"].setdefault(name, []).append(_timed_orbax(items, target, variant))
            save()
        for gb in (1, 4):
            entry["orbax"].setdefault(f"restore_concurrent_gb={gb}", []).append(
                _timed_orbax(items, target, None, concurrent_gb=gb))
            save()
    entry["device_put"] = _puts(items, target, reps)
    save()


def _timed_orbax(items: str, target: dict, variant: dict | None, concurrent_gb: int | None = None) -> dict:
    """One Orbax restore of ``target`` as restore_check.restore does it (MaxText's handler, ``concurrent_gb`` in place
    of its restore_concurrent_gb when given), with ``variant``'s read-and-put in place of Orbax's own (None: Orbax's
    own, untimed in its parts)."""
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.serialization import serialization as ser

    from ckptconv.commands.restore_check import MAXTEXT_HANDLER

    log: list[tuple] = []
    original = ser._read_array_index_and_device_put  # noqa: SLF001
    if variant is not None:
        ser._read_array_index_and_device_put = _instrumented(log, **variant)  # noqa: SLF001
    try:
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        handler = {**MAXTEXT_HANDLER, **({} if concurrent_gb is None else {"restore_concurrent_gb": concurrent_gb})}
        checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**handler))
        started = time.perf_counter()
        tree = checkpointer.restore(items, args=ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args, partial_restore=True))
        jax.block_until_ready(tree)
        ended = time.perf_counter()
    finally:
        ser._read_array_index_and_device_put = original  # noqa: SLF001
    for array in jax.tree.leaves(tree):
        array.delete()
    run = {"seconds": round(ended - started, 3)}
    if log:
        run.update({"shards": len(log), "setup_s": round(min(r[0] for r in log) - started, 3),
                    "reads_span_s": round(max(r[1] for r in log) - min(r[0] for r in log), 3),
                    "read_sum_s": round(sum(r[1] - r[0] for r in log), 3),
                    "put_sum_s": round(sum(r[2] - r[1] for r in log), 3),
                    "after_last_put_s": round(ended - max(r[2] for r in log), 3),
                    "misaligned_4096": sum(1 for r in log if r[4])})
    return run


def _instrumented(log: list, direct: bool, threaded: bool, aligned: bool):
    """Orbax 0.12.8's ``serialization._read_array_index_and_device_put`` (its strict path), each shard's read start,
    read end and device_put end logged, with one part changed per flag."""
    import asyncio

    import jax
    import numpy as np
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import limits
    from orbax.checkpoint._src.serialization import serialization as ser

    async def read_and_put(devices, index, t, *, global_shape, new_shard_shape, dtype, byte_limiter, strict, dll,
                           memory_kind):
        if tuple(t.shape) != tuple(global_shape):
            raise ValueError(f"diagnose: stored shape {t.shape} is not the target's {global_shape}")
        domain = ts.IndexDomain(shape=global_shape)[ts.d[:][index]]
        requested = ser.estimate_read_memory_footprint(t, domain)
        result = []
        async with limits.reserved_bytes(byte_limiter, requested):
            started = time.perf_counter()
            if direct:
                shard = await t[domain].read()
            else:
                dtype_ = t.dtype.numpy_dtype
                if aligned:
                    size = int(np.prod(new_shard_shape, dtype=np.int64)) * dtype_.itemsize
                    raw = np.empty(size + 4096, np.uint8)
                    skip = -raw.ctypes.data % 4096
                    shard = raw[skip:skip + size].view(dtype_).reshape(new_shard_shape)
                else:
                    shard = np.zeros(new_shard_shape, dtype=dtype_)
                await ts.array(shard)[ts.d[:].translate_to[domain.origin]][domain].write(t[domain])
            if dtype is not None:
                shard = shard.astype(dtype, copy=False)
            read = time.perf_counter()
            for device in devices:
                format_ = ser.Format(dll, ser.make_single_device_sharding(device, memory_kind=memory_kind))
                if threaded:
                    result.append(await asyncio.to_thread(jax.device_put, shard, format_))
                else:
                    result.append(jax.device_put(shard, format_))
            log.append((started, read, time.perf_counter(), shard.nbytes, shard.ctypes.data % 4096))
        return result, requested

    return read_and_put


def _puts(items: str, target: dict, reps: int) -> dict:
    """The checkpoint's leaves, read into host memory by Orbax, put onto the devices three ways (one call, a call per
    leaf, a call per leaf from 8 threads), from three kinds of host buffer; seconds per rep, to the last byte."""
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    host_args = jax.tree.map(lambda t: ocp.RestoreArgs(restore_type=np.ndarray), target)
    host = ocp.PyTreeCheckpointer().restore(items, args=ocp.args.PyTreeRestore(
        item=target, restore_args=host_args, partial_restore=True))
    leaves = [np.asarray(a) for a in jax.tree.leaves(host)]
    shardings = [t.sharding for t in jax.tree.leaves(target)]

    def aligned(a: np.ndarray) -> np.ndarray:
        raw = np.empty(a.nbytes + 4096, np.uint8)
        skip = -raw.ctypes.data % 4096
        out = raw[skip:skip + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        return out

    kinds = {"tensorstore's arrays": leaves, "np.empty copies": [a.copy() for a in leaves],
             "4096-aligned copies": [aligned(a) for a in leaves]}
    ways = {"one call": lambda xs: jax.device_put(xs, shardings),
            "a call per leaf": lambda xs: [jax.device_put(x, s) for x, s in zip(xs, shardings)]}
    out: dict = {"alignment_mod_4096": {k: sorted({int(a.ctypes.data % 4096) for a in xs}) for k, xs in kinds.items()}}
    with ThreadPoolExecutor(8) as pool:
        ways["8 threads"] = lambda xs: list(pool.map(jax.device_put, xs, shardings))
        for _ in range(reps):
            for kind, xs in kinds.items():
                for way, put in ways.items():
                    started = time.perf_counter()
                    placed = jax.block_until_ready(put(xs))
                    out.setdefault(f"{kind}, {way}", []).append(round(time.perf_counter() - started, 3))
                    for array in placed:
                        array.delete()
    return out


def _read_all(directory: Path) -> float:
    started = time.perf_counter()
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(64 * 1024**2):
                    pass
    return time.perf_counter() - started


def _write(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "table.md").write_text(table(results))


def table(results: dict) -> str:
    """Min-max restore seconds per shape and case (every round), GiB/s at the best, and the checks' verdicts."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for run in results["runs"]:
        rows.setdefault((run["shape"], run["case"]), []).append(run)
    lines = ["| shape | case | restore s (min-max) | GiB/s (best) | checked | device bytes | peak RSS |",
             "|---|---|---|---|---|---|---|"]
    for (shape, case), runs in rows.items():
        seconds = [run["restore_seconds"] for run in runs]
        best = max(run["gib_per_s"] or 0 for run in runs)
        checked = next((("OK" if run["ok"] else f"FAILED {run['mismatches'][:1]}") for run in runs
                        if run.get("leaves_checked") or run.get("mismatches")), "-")
        device = next((run.get("device_bytes_in_use") for run in runs if run.get("device_bytes_in_use")), None)
        peak = max((run.get("peak_rss_bytes") or 0) for run in runs)
        lines.append(f"| {shape} | {case} | {min(seconds):.2f}-{max(seconds):.2f} | {best:.2f} | {checked} | "
                     f"{'-' if device is None else f'{device / GIB:.2f} GiB'} | "
                     f"{'-' if not peak else f'{peak / GIB:.2f} GiB'} |")
    if results.get("breakdown"):
        lines += ["", "| shape | case | Orbax to host NumPy s | device_put s | tensorstore reads s |", "|---|---|---|---|---|"]
        lines += [f"| {b['shape']} | {b['case']} | {b['orbax_to_host_seconds']} | {b['device_put_seconds']} | "
                  f"{b['tensorstore_reads_seconds']} |" for b in results["breakdown"]]
    for d in results.get("diagnosis", []):
        lines += ["", f"{d['shape']}, {d['case']}: Orbax's restore with one part changed (best of its reps; parts of "
                  "that rep)", "", "| variant | s | setup s | reads span s | read sum s | device_put sum s | "
                  "after last put s | shards not 4096-aligned |", "|---|---|---|---|---|---|---|---|"]
        for name, runs in d.get("orbax", {}).items():
            r = min(runs, key=lambda run: run["seconds"])
            lines.append(f"| {name} | {', '.join(str(run['seconds']) for run in runs)} | " + " | ".join(
                str(r.get(k, "-")) for k in ("setup_s", "reads_span_s", "read_sum_s", "put_sum_s",
                                             "after_last_put_s", "misaligned_4096")) + " |")
        puts = {k: v for k, v in d.get("device_put", {}).items() if k != "alignment_mod_4096"}
        if puts:
            lines += ["", "| host leaves put onto the devices | s (each rep) |", "|---|---|"]
            lines += [f"| {k} | {', '.join(map(str, v))} |" for k, v in puts.items()]
            lines.append(f"\nalignment (address mod 4096): {d['device_put'].get('alignment_mod_4096')}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
