"""Restore cost of a converted checkpoint on the TPU host: ckptconv's output against MaxText 0.2.5's (issue 27).

    nice -n 10 .venv/bin/python -m bench restore [--layers 28] [--repeats 3] [--devices 16,1] [--locations local,gcs]
    nice -n 10 .venv/bin/python -m bench restore --prepare-only --shape 8b --layers 8   # inputs for --checkpoints
    nice -n 10 .venv/bin/python -m bench restore --checkpoints NAME=DIR [NAME=DIR ...] [--shard-of 16] [--latency-ms 20]

What one run does (everything under the git-ignored bench/work/restore/):
1. synthesises a Qwen3-0.6B-shaped random bf16 checkpoint (``ckptconv.commands.synth``; ``--layers`` makes it
   shallower for a smoke run) unless it is there;
2. converts it once with ``python -m ckptconv convert SRC DST --devices 16`` and once with MaxText 0.2.5's
   ``to_maxtext`` (its venv, lazy loading, 16 simulated devices, scan_layers=true, as ``python -m bench speed``
   runs it); both outputs are kept and reused by later runs (``--fresh`` redoes them);
3. starts the real fake-gcs-server (memory backend) behind a tiny counting HTTP proxy (its own process, started
   by this script: the server's own request log gives 0 as the size of every download), and uploads both
   checkpoints to a bucket;
4. for each round, device count, location and checkpoint (the two checkpoints alternate, A B A B ...): a fresh
   child process (ckptconv's venv, ``XLA_FLAGS=--xla_force_host_platform_device_count=N``) restores
   ``<ckpt>/0/items`` with Orbax onto N simulated CPU devices, every leaf onto a ``NamedSharding`` built from its
   own stored sharding spec, so each device reads its own shard as a TPU host would; it prints the restore
   call's wall time, its VmHWM and the number of stored chunks; for gs:// it brackets the restore with two
   marker requests, so the proxy's log gives the requests and bytes of the restore alone;
5. writes docs/bench/RESTORE.md (medians) and bench/work/restore/results.json (every run).

``--checkpoints NAME=DIR ...``: given checkpoints (each DIR holding ``0/items``, e.g. the ones kept under
bench/work/restore/ckpt/) restored from gs:// in alternation, after one uncounted warm-up each; besides the figures
above it splits the requests into data-file reads (``.../d/<file>`` objects: the layout's part) and the rest
(metadata, listings, existence probes: about the same for any checkpoint). ``--shard-of N``: instead of restores,
one host's reads (device 0's shard of every leaf of a checkpoint written for N devices). Prints a summary table and
writes every run to bench/work/restore/ab-<time>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORK = BENCH / "work" / "restore"
GIB = 1024**3
MIB = 1024**2
MARK = "/__restore_bench_mark__/"
KEEP = "<!-- hand-written below: kept when `python -m bench restore` rewrites this file -->"
CHECKPOINTS = ("ckptconv", "maxtext")
DYNAMIC = "hf-safetensors_dynamic"  # MaxText 0.2.5 loading the HF files at start-up, no conversion


# ---------------------------------------------------------------------------------------------
# The child: one restore in a fresh process (ckptconv's venv)


def _mark(mark_url: str | None, what: str) -> None:
    """Tell the counting proxy (``mark_url``) where the child is, so requests are counted by phase."""
    if mark_url:
        urllib.request.urlopen(f"{mark_url}{MARK}{what}", timeout=30).read()


def child(path: str, devices: int, mark_url: str | None) -> None:
    import math

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert len(jax.devices()) == devices, (jax.devices(), devices)
    rss_start = _status_kib("VmRSS:")
    t0 = time.perf_counter()
    checkpointer = ocp.PyTreeCheckpointer()
    metadata = checkpointer.metadata(path)
    metadata = getattr(metadata, "item_metadata", metadata)
    metadata_seconds = time.perf_counter() - t0
    meshes: dict = {}
    counts = {"leaves": 0, "chunks": 0, "bytes": 0, "sharded_leaves": 0}

    def is_leaf(x) -> bool:
        return hasattr(x, "shape") and hasattr(x, "dtype")

    def abstract(leaf):
        shape = tuple(leaf.shape)
        meta = getattr(leaf, "sharding", None)
        axis_names = tuple(getattr(meta, "axis_names", None) or ("checkpoint_sharding_axis",))
        spec = PartitionSpec(*getattr(meta, "partition_spec", ()) or ())
        if axis_names not in meshes:  # all devices on the first axis: 1-D meshes are what both converters write
            grid = np.array(jax.devices()).reshape((devices,) + (1,) * (len(axis_names) - 1))
            meshes[axis_names] = Mesh(grid, axis_names)
        storage = getattr(leaf, "storage", None)
        chunk = tuple(getattr(storage, "chunk_shape", None) or shape)
        counts["leaves"] += 1
        counts["sharded_leaves"] += bool(meta is not None and any(p is not None for p in spec))
        counts["chunks"] += math.prod(-(-s // c) for s, c in zip(shape, chunk)) if shape else 1
        counts["bytes"] += math.prod(shape) * np.dtype(leaf.dtype).itemsize
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=NamedSharding(meshes[axis_names], spec))

    target = jax.tree.map(abstract, metadata, is_leaf=is_leaf)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)

    rss_before = _status_kib("VmRSS:")
    _mark(mark_url, "begin-restore")
    t0 = time.perf_counter()
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))
    jax.block_until_ready(restored)
    restore_seconds = time.perf_counter() - t0
    _mark(mark_url, "end-restore")
    arrays = [x for x in jax.tree.leaves(restored) if isinstance(x, jax.Array)]
    wrong = [x.shape for x in arrays if len(x.sharding.device_set) != devices]
    print(json.dumps({
        "restore_seconds": round(restore_seconds, 4), "metadata_seconds": round(metadata_seconds, 4),
        "peak_rss_bytes": _status_kib("VmHWM:") * 1024, "rss_after_imports_bytes": rss_start * 1024,
        "rss_before_restore_bytes": rss_before * 1024, "devices": len(jax.devices()), **counts,
        "restored_arrays": len(arrays), "arrays_not_on_all_devices": len(wrong),
        "versions": {"jax": jax.__version__, "orbax": _version("orbax-checkpoint"), "tensorstore": _version("tensorstore")},
    }), flush=True)


def shard_child(path: str, device: int, devices: int, mark_url: str | None) -> None:
    """What one TPU host holding device ``device`` of ``devices`` reads: that device's box of every leaf (the whole leaf
    when replicated), every leaf opened and read concurrently with tensorstore through the kvstore spec and context
    Orbax's restore uses (OCDBT, its read coalescing), no JAX devices needed. Counted like a restore."""
    import asyncio
    import math

    import numpy as np
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    sys.path.insert(0, str(REPO))
    from ckptconv.read.restore_cost import device_boxes
    from ckptconv.read.stored import read_items_metadata

    rss_start = _status_kib("VmRSS:")
    leaves = [leaf for leaf in read_items_metadata(path) if leaf.chunk_shape is not None and leaf.shape]
    context = ts_utils.get_ts_context(use_ocdbt=True)

    async def read(leaf):
        kvstore = ts_utils.build_kvstore_tspec(path, name=".".join(leaf.path), use_ocdbt=True)
        array = await ts.open({"driver": "zarr3", "kvstore": kvstore}, context=context, open=True)
        box = device_boxes(leaf, device)
        data = await array[tuple(slice(lo, hi) for lo, hi in box)].read()
        return data.nbytes

    async def read_all():
        return await asyncio.gather(*(read(leaf) for leaf in leaves))

    rss_before = _status_kib("VmRSS:")
    _mark(mark_url, "begin-restore")
    t0 = time.perf_counter()
    nbytes = asyncio.run(read_all())
    restore_seconds = time.perf_counter() - t0
    _mark(mark_url, "end-restore")
    print(json.dumps({
        "restore_seconds": round(restore_seconds, 4), "peak_rss_bytes": _status_kib("VmHWM:") * 1024,
        "rss_after_imports_bytes": rss_start * 1024, "rss_before_restore_bytes": rss_before * 1024,
        "devices": 1, "device": device, "leaves": len(leaves), "shard_bytes": sum(nbytes),
        "chunks": sum(math.prod(-(-s // c) for s, c in zip(leaf.shape, leaf.chunk_shape)) for leaf in leaves),
        "versions": {"tensorstore": _version("tensorstore"), "numpy": np.__version__},
    }), flush=True)


def dynamic_child(src: str, config_dir: str, template: str, devices: int, mark_url: str | None, layers: int) -> None:
    """MaxText 0.2.5's ``safetensors_dynamic`` load (MaxText's venv): the HF files read, sharded and transformed on
    the devices, into the same target tree and shardings the Orbax restores use (those of MaxText's own checkpoint)."""
    import jax
    import maxtext
    import orbax.checkpoint as ocp
    import transformers
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from maxtext.checkpoint_conversion.utils import hf_model_configs, load_dynamic
    from maxtext.configs import pyconfig

    import numpy as np

    assert len(jax.devices()) == devices, (jax.devices(), devices)
    rss_start = _status_kib("VmRSS:")
    # MaxText's table holds the 28-layer qwen3-0.6b; the checkpoint's own config.json serves any depth (as
    # bench/maxtext_convert_tiny.py does)
    hf_model_configs.HF_MODEL_CONFIGS["qwen3-0.6b"] = transformers.AutoConfig.from_pretrained(config_dir)
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    config = pyconfig.initialize(["restore", base, "model_name=qwen3-0.6b", "hardware=cpu", "skip_jax_distributed_system=True",
                                  "scan_layers=true", "override_model_config=True", f"base_num_decoder_layers={layers}",
                                  f"load_parameters_path={src}", "source_checkpoint_layout=safetensors_dynamic",
                                  "enable_checkpointing=False", "run_name=restore-bench",
                                  f"base_output_directory={WORK / 'dynamic-out'}"])
    metadata = ocp.PyTreeCheckpointer().metadata(template)
    metadata = getattr(metadata, "item_metadata", metadata)
    mesh = Mesh(np.array(jax.devices()), ("checkpoint_sharding_axis",))

    def abstract(leaf):
        spec = list(getattr(getattr(leaf, "sharding", None), "partition_spec", ()) or ())
        spec += [None] * (len(leaf.shape) - len(spec))  # MaxText's stacking drops one entry per layer axis
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    target = jax.tree.map(abstract, metadata["params"], is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))

    rss_before = _status_kib("VmRSS:")
    _mark(mark_url, "begin-restore")
    t0 = time.perf_counter()
    _, restored = load_dynamic.load_safetensors_dynamic_state(src, target, config)
    jax.block_until_ready(restored)
    restore_seconds = time.perf_counter() - t0
    _mark(mark_url, "end-restore")
    got = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(restored)}
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(target)}
    print(json.dumps({
        "restore_seconds": round(restore_seconds, 4), "peak_rss_bytes": _status_kib("VmHWM:") * 1024,
        "rss_after_imports_bytes": rss_start * 1024, "rss_before_restore_bytes": rss_before * 1024,
        "devices": len(jax.devices()), "leaves": len(got), "chunks": None, "same_tree_as_maxtext_checkpoint": got == want,
        "versions": {"maxtext": _version("maxtext"), "jax": jax.__version__, "orbax": _version("orbax-checkpoint")},
    }), flush=True)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def _version(package: str) -> str:
    from importlib.metadata import version
    return version(package)


# ---------------------------------------------------------------------------------------------
# The counting proxy: its own process, one log line per request with the bytes it returned

PROXY_PIECE = 1024 * 1024  # bytes the proxy passes on at a time


def proxy(port: int, upstream: str, log_path: str, latency_ms: float = 0.0) -> None:
    """Forward to ``upstream``, logging each request; ``latency_ms`` > 0 holds every request that long before
    forwarding it (each in its own thread, so concurrent requests wait together, as round trips to GCS do)."""
    import http.client
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlsplit

    up = urlsplit(upstream)
    lock = threading.Lock()
    log = open(log_path, "a", buffering=1)
    local = threading.local()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # the log below is the only one
            pass

        def _forward(self) -> None:
            if self.path.startswith(MARK):
                with lock:
                    log.write(f"MARK {self.path[len(MARK):]}\n")
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if latency_ms > 0:
                time.sleep(latency_ms / 1000)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            for attempt in range(2):  # a kept-alive upstream connection may have been closed
                conn = getattr(local, "conn", None)
                if conn is None:
                    conn = local.conn = http.client.HTTPConnection(up.hostname, up.port, timeout=300)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    break
                except (http.client.HTTPException, OSError):
                    conn.close()
                    local.conn = None
                    if attempt:
                        raise
            # The body is passed on as it arrives, as GCS streams it: a whole-body store and forward would
            # delay every response by its own transfer, most for the largest ones.
            size = response.getheader("Content-Length")
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(key, value)
            pieces: list[bytes] = []
            if size is None:  # not known up front: take it all, then send it with its length
                pieces.append(response.read())
                size = str(len(pieces[0]))
            self.send_header("Content-Length", size)
            self.end_headers()
            aborted, sent = "", 0
            try:
                while True:
                    piece = pieces.pop() if pieces else response.read(PROXY_PIECE)
                    if not piece:
                        break
                    sent += len(piece)
                    if self.command != "HEAD":
                        self.wfile.write(piece)
            except OSError:  # the client hung up before taking the whole body: the server still sent it
                aborted, self.close_connection = " aborted", True
                sent += len(response.read())  # drain, so the kept-alive upstream connection stays usable
            with lock:
                log.write(f"REQ {self.command} {response.status} {sent} {length} {self.path}"
                          f"{' ' + self.headers['Range'] if self.headers.get('Range') else ''}{aborted}\n")

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _forward

    ThreadingHTTPServer.daemon_threads = True
    # socketserver's listen backlog is 5: a restore opens more connections at once than that, and the kernel
    # drops the extra SYNs, which the client resends after its initial 1 s retransmission timeout. Every such
    # restore then took about 1 s longer (walls of 0.4 or 1.4 s for the same checkpoint), a stall of this
    # proxy, not of GCS.
    ThreadingHTTPServer.request_queue_size = 1024
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def requests_between(log_path: Path, start: int, tag: str | None) -> dict:
    """Requests and response bytes in the proxy log after byte offset ``start``: between the ``begin-TAG`` and
    ``end-TAG`` marks if ``tag``, else all of them."""
    lines = log_path.read_text()[start:].splitlines() if log_path.exists() else []
    if tag:
        try:
            lines = lines[lines.index(f"MARK begin-{tag}") + 1: lines.index(f"MARK end-{tag}")]
        except ValueError:
            return {}
    aborted = sum(1 for line in lines if line.startswith("REQ ") and line.endswith(" aborted"))
    reqs = [line.split(" ", 5) for line in lines if line.startswith("REQ ")]
    by_kind: dict[str, int] = {}
    for _, method, _status, _nbytes, _, path in reqs:
        kind = f"{method} {'media' if 'alt=media' in path or path.startswith('/download/') else 'json'}"
        by_kind[kind] = by_kind.get(kind, 0) + 1
    return {"requests": len(reqs), "bytes_read": sum(int(r[3]) for r in reqs), "by_kind": by_kind,
            "errors": sum(1 for r in reqs if not r[2].startswith(("2", "3")) and r[2] != "404"),
            "not_found": sum(1 for r in reqs if r[2] == "404"), "aborted_by_client": aborted}


# ---------------------------------------------------------------------------------------------
# The bench

class Gcs:
    """fake-gcs-server (memory backend, or files under ``root``) and the counting proxy in front of it, both this
    script's children. Keep GBs on disk: the memory backend held 22 GiB for three 4 GiB checkpoints (OOM-killed)."""

    def __init__(self, logs: Path, latency_ms: float = 0.0, root: Path | None = None) -> None:
        from tests.gcs_server import STATIC_ENV, _binary, _free_port, _wait_ready

        self.server_port, self.proxy_port = _free_port(), _free_port()
        self.server_url = f"http://127.0.0.1:{self.server_port}"
        self.url = f"http://127.0.0.1:{self.proxy_port}"
        self.proxy_log = logs / "proxy-requests.log"
        self.proxy_log.write_text("")
        self._server_err = open(logs / "fake-gcs-server.log", "wb")
        self.server = subprocess.Popen(
            [str(_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.server_port),
             *(["-backend", "filesystem", "-filesystem-root", str(root)] if root else ["-backend", "memory"]),
             "-log-level", "warn", "-external-url", self.url],
            stdin=subprocess.DEVNULL, stdout=self._server_err, stderr=self._server_err)
        if not _wait_ready(self.server_url, self.server):
            raise SystemExit(f"fake-gcs-server did not start; see {logs}")
        self.proxy = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_proxy", str(self.proxy_port),
                                       self.server_url, str(self.proxy_log), str(latency_ms)], stdin=subprocess.DEVNULL,
                                      stdout=self._server_err, stderr=self._server_err)
        if not _wait_ready(self.url, self.proxy):
            raise SystemExit("the counting proxy did not start")
        self.env = {**STATIC_ENV, "STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url}
        os.environ.update({**STATIC_ENV, "STORAGE_EMULATOR_HOST": self.server_url})  # uploads go to the server

    def upload_tree(self, directory: Path, bucket: str, prefix: str) -> str:
        from google.cloud import storage

        client = storage.Client(project="test")
        target = client.lookup_bucket(bucket) or client.create_bucket(bucket)
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                target.blob(f"{prefix}/{path.relative_to(directory)}").upload_from_filename(str(path))
        return f"gs://{bucket}/{prefix}"

    def stop(self) -> None:
        for proc in (self.proxy, self.server):
            proc.kill()
            proc.wait()
        self._server_err.close()


# --shape: (synth preset, MaxText model name, the release's layer count, input and checkpoint name prefixes)
SHAPES = {"0.6b": ("QWEN3_0_6B", "qwen3-0.6b", 28, "qwen3-0.6b", ""),
          "8b": ("LLAMA3_8B", "llama3.1-8b", 32, "llama3-8b", "8b-")}


def ensure_input(layers: int, shape: str = "0.6b") -> Path:
    from ckptconv.commands import synth

    preset, _, _, prefix, _ = SHAPES[shape]
    path = WORK / "inputs" / f"{prefix}-{layers}l"
    if (path / "config.json").exists():
        return path
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    print(f"synthesising {path.name} (random bf16)", flush=True)
    synth.write_checkpoint(dataclasses.replace(getattr(synth, preset), num_layers=layers), str(partial))
    partial.rename(path)
    return path


def convert(tool: str, src: Path, layers: int, ctx: dict | None, fresh: bool, shape: str = "0.6b") -> tuple[Path, dict]:
    """Convert once with ``tool`` (kept and reused across runs unless ``fresh``): (checkpoint, facts)."""
    from bench.steps import ckptconv_cmd, error_line, maxtext_cmd, maxtext_convert_cmd, run

    _, model_name, release_layers, _, prefix = SHAPES[shape]
    dst = WORK / "ckpt" / f"{tool}-{prefix}{layers}l"
    facts_path = dst.with_name(dst.name + ".json")
    if not fresh and (dst / "0" / "items").exists() and facts_path.exists():
        return dst, {**json.loads(facts_path.read_text()), "reused": True}
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    log = WORK / "logs" / f"convert-{tool}-{prefix}{layers}l.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if tool == "ckptconv":
        cmd, env = ckptconv_cmd(src, dst)[:-2] + ["--progress", "none"], {}
    elif layers == release_layers:
        cmd, env = maxtext_cmd(ctx["mt_python"], ctx["base_yml"], model_name, src, dst, lazy=True), ctx["mt_env"]
    else:  # MaxText's table has only the release's layer count: the tiny runner takes the checkpoint's own config
        cmd = maxtext_convert_cmd(model_name, src, dst, [f"base_num_decoder_layers={layers}", "scan_layers=true"],
                                  ["--lazy_load_tensors=true", "--simulated_cpu_devices_count=16"])
        env = ctx["mt_env"]
    print(f"converting with {tool}: {' '.join(map(str, cmd))}", flush=True)
    start = time.monotonic()
    result = run(cmd, log, env)
    if result.returncode or not (dst / "0" / "items").exists():
        raise SystemExit(f"{tool} conversion failed (exit {result.returncode}, see {log}): {error_line(result)}")
    facts = {"command": " ".join(map(str, cmd)), "wall_seconds": round(time.monotonic() - start, 1),
             "bytes": sum(f.stat().st_size for f in (dst / "0" / "items").rglob("*") if f.is_file()),
             "files": sum(1 for f in (dst / "0" / "items").rglob("*") if f.is_file())}
    facts_path.write_text(json.dumps(facts))
    return dst, {**facts, "reused": False}


def restore_once(name: str, path: str, devices: int, gcs: Gcs | None, dynamic: dict | None = None,
                 shard_of: int | None = None) -> dict:
    """One restore in a fresh child; ``dynamic`` ({ctx, config_dir, template, layers}): MaxText's
    ``safetensors_dynamic`` load of the HF files at ``path`` instead of an Orbax restore."""
    from bench.steps import error_line, last_json, run

    env = {**(dynamic["ctx"]["mt_env"] if dynamic else {}), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "PYTHONUNBUFFERED": "1",
           **(gcs.env if gcs else {})}
    start = gcs.proxy_log.stat().st_size if gcs else 0
    log = WORK / "logs" / f"{name}.log"
    if dynamic:
        cmd = [dynamic["ctx"]["mt_python"], str(Path(__file__).resolve()), "_dynamic", path, dynamic["config_dir"],
               dynamic["template"], str(devices), gcs.url if gcs else "", str(dynamic["layers"])]
    elif shard_of:  # one host's reads: device 0's shard of a checkpoint written for ``shard_of`` devices
        cmd = [sys.executable, str(Path(__file__).resolve()), "_shard", path, "0", str(shard_of), gcs.url if gcs else ""]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "_child", path, str(devices), gcs.url if gcs else ""]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    result = run(cmd, log, env)
    row = {"name": name, "returncode": result.returncode, "process_seconds": round(time.monotonic() - t0, 2),
           "load_before": round(load, 2), **last_json(result)}
    if result.returncode:
        row["error"] = error_line(result)
    if gcs:
        time.sleep(0.2)  # the proxy writes its line after sending the response
        row["server"] = requests_between(gcs.proxy_log, start, "restore")
        row["server_whole_process"] = requests_between(gcs.proxy_log, start, None)
    status = "ok" if not result.returncode else f"FAILED: {row['error']}"
    srv = row.get("server") or {}
    print(f"  {name:<34} restore {row.get('restore_seconds', 0):6.2f} s  peak RSS "
          f"{row.get('peak_rss_bytes', 0) / GIB:5.2f} GiB  chunks {row.get('chunks', '-')}"
          + (f"  requests {srv.get('requests')}  read {srv.get('bytes_read', 0) / MIB:.1f} MiB" if gcs else "")
          + f"  load {load:.1f}  {status}", flush=True)
    return row


def data_reads(log: Path, start: int) -> list[str]:
    """The data-file reads between the restore marks after byte ``start`` of the proxy log (object and range)."""
    lines = log.read_text()[start:].splitlines()
    try:
        lines = lines[lines.index("MARK begin-restore") + 1: lines.index("MARK end-restore")]
    except ValueError:
        return []
    return [line.split(" ", 5)[5] for line in lines if line.startswith("REQ ") and "%2Fd%2F" in line]


def given(args, argv: list[str] | None) -> int:
    """``--checkpoints``: the given checkpoints restored from gs:// in alternation, their requests counted."""
    named = dict(item.split("=", 1) for item in args.checkpoints)
    devices = [1] if args.shard_of else [int(d) for d in args.devices.split(",")]
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    results = {"command": "nice -n 10 .venv/bin/python -m bench restore " + " ".join(argv or sys.argv[1:]),
               "started_at": _now(), "latency_ms": args.latency_ms, "shard_of": args.shard_of, "runs": []}
    root = WORK / "gcs-root" if args.on_disk else None
    if root:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    gcs = Gcs(WORK / "logs", args.latency_ms, root)
    try:
        uris = {name: gcs.upload_tree(Path(directory) / "0" / "items", "restore-ab", f"{name}/0/items")
                for name, directory in named.items()}
        for name, uri in uris.items():
            restore_once(f"ab-{name}-warmup", uri, max(devices), gcs, shard_of=args.shard_of)
        for index in range(args.repeats):
            for n in devices:
                for name, uri in uris.items():
                    start = gcs.proxy_log.stat().st_size
                    row = restore_once(f"ab-{name}-{n}dev-{index}", uri, n, gcs, shard_of=args.shard_of)
                    reads = data_reads(gcs.proxy_log, start)
                    results["runs"].append({"checkpoint": name, "devices": n, "index": index, **row,
                                            "data_reads": len(reads), "data_files_read": len({r.split()[0] for r in reads})})
    finally:
        gcs.stop()
        if root:
            shutil.rmtree(root, ignore_errors=True)
        results["finished_at"] = _now()
        out = WORK / f"ab-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\n{results['command']}  (latency {args.latency_ms:g} ms per request; medians over {args.repeats} rounds"
          + (f"; device 0's shard of {args.shard_of} read by one host" if args.shard_of else "") + ")")
    print("| checkpoint | devices | requests (each run) | data-file reads (each run) | restore wall median (s) | walls (s) | peak RSS median (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for n in devices:
        for name in named:
            runs = [r for r in results["runs"] if (r["checkpoint"], r["devices"]) == (name, n) and not r["returncode"]]
            if not runs:
                continue
            reqs = [r["server"].get("requests", 0) for r in runs]
            walls = [r["restore_seconds"] for r in runs]
            print(f"| {name} | {n} | {statistics.median(reqs):.0f} ({', '.join(map(str, reqs))}) | "
                  f"{statistics.median(r['data_reads'] for r in runs):.0f} ({', '.join(str(r['data_reads']) for r in runs)}) | "
                  f"{statistics.median(walls):.2f} | {', '.join(f'{w:.2f}' for w in walls)} | "
                  f"{statistics.median(r['peak_rss_bytes'] for r in runs) / GIB:.2f} |")
    print(f"runs: {out}")
    return 0



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the Qwen3-0.6B shape (28; 2 for a smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", default="16,1")
    parser.add_argument("--locations", default="local,gcs")
    parser.add_argument("--fresh", action="store_true", help="convert again even if the outputs are there")
    parser.add_argument("--results", default=str(REPO / "docs" / "bench" / "RESTORE.md"))
    parser.add_argument("--dynamic", action="store_true",
                        help="also MaxText's safetensors_dynamic load of the HF files, third in each alternation")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="gs:// only: the counting proxy holds every request this long before forwarding it "
                             "(a round trip to real GCS costs tens of ms; fake-gcs-server on loopback none)")
    parser.add_argument("--report-only", action="store_true", help="rewrite --results from bench/work/restore/results.json")
    parser.add_argument("--shape", choices=SHAPES, default="0.6b",
                        help="with --prepare-only: 8b is Llama-3-8B's widths (--layers of its 32)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="only synthesise the input and convert it with both tools (kept under bench/work/restore/"
                             "ckpt/), e.g. for --checkpoints ... --shard-of 16, which reads one host's shard only")
    parser.add_argument("--checkpoints", nargs="+", metavar="NAME=DIR",
                        help="restore these checkpoints (DIR holding 0/items) from gs:// in alternation instead")
    parser.add_argument("--shard-of", type=int, default=0,
                        help="with --checkpoints: instead of restores, one host's reads: device 0's shard of every "
                             "leaf of a checkpoint written for this many devices (the _shard child; --devices ignored)")
    parser.add_argument("--on-disk", action="store_true",
                        help="with --checkpoints: the server keeps the objects under bench/work/restore/gcs-root "
                             "(GBs of checkpoints)")
    args = parser.parse_args(argv)
    if args.checkpoints:
        return given(args, argv)
    sys.path.insert(0, str(REPO))
    devices = [int(d) for d in args.devices.split(",")]
    locations = [x.strip() for x in args.locations.split(",")]
    if args.report_only:
        write_results(json.loads((WORK / "results.json").read_text()), Path(args.results), devices, locations)
        return 0
    from bench.measure import ckptconv_versions, machine_facts
    from bench.steps import setup_maxtext

    if args.prepare_only:
        src, ctx = ensure_input(args.layers, args.shape), setup_maxtext()
        for tool in CHECKPOINTS:
            dst, facts = convert(tool, src, args.layers, ctx, args.fresh, args.shape)
            print(f"{tool}: {dst} ({facts['bytes'] / GIB:.2f} GiB in {facts['files']} files, {facts['wall_seconds']} s)")
        return 0

    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "logs").mkdir(exist_ok=True)
    results = {"command": "nice -n 10 .venv/bin/python -m bench restore " + " ".join(argv if argv is not None else sys.argv[1:]),
               "started_at": _now(), "load_start": [round(x, 2) for x in os.getloadavg()], "machine": machine_facts(),
               "ckptconv_versions": ckptconv_versions(), "layers": args.layers, "runs": [], "warmup": []}
    src = ensure_input(args.layers)
    ctx = setup_maxtext()
    results["mt_versions"] = ctx["mt_versions"]
    ckpts, results["conversions"] = {}, {}
    for tool in CHECKPOINTS:
        ckpts[tool], results["conversions"][tool] = convert(tool, src, args.layers, ctx, args.fresh)
    results["latency_ms"] = args.latency_ms
    gcs = Gcs(WORK / "logs", args.latency_ms) if "gcs" in locations else None
    try:
        where = {tool: {"local": str(ckpts[tool] / "0" / "items")} for tool in CHECKPOINTS}
        tools = CHECKPOINTS + ((DYNAMIC,) if args.dynamic else ())
        uploads = {tool: (ckpts[tool] / "0" / "items", f"{tool}-{args.layers}l/0/items") for tool in CHECKPOINTS}
        if args.dynamic:
            where[DYNAMIC] = {"local": str(src)}
            uploads[DYNAMIC] = (src, f"hf-{args.layers}l")
        dynamic = {"ctx": ctx, "config_dir": str(src), "template": where["maxtext"]["local"], "layers": args.layers}
        if gcs:
            for tool in tools:
                t0 = time.monotonic()
                uri = gcs.upload_tree(uploads[tool][0], "restore-bench", uploads[tool][1])
                where[tool]["gcs"] = uri
                print(f"uploaded {tool} to {uri} in {time.monotonic() - t0:.1f} s", flush=True)
        for tool in tools:  # not counted: .pyc files, page cache, the proxy's first connections
            for location in locations:
                results["warmup"].append(restore_once(f"{tool}-{location}-{max(devices)}dev-warmup",
                                                      where[tool][location], max(devices),
                                                      gcs if location == "gcs" else None,
                                                      dynamic if tool == DYNAMIC else None))
        for index in range(args.repeats):
            for n in devices:
                for location in locations:
                    for tool in tools:  # alternating: ckptconv, maxtext, [dynamic,] ckptconv, maxtext ...
                        row = restore_once(f"{tool}-{location}-{n}dev-{index}", where[tool][location], n,
                                           gcs if location == "gcs" else None, dynamic if tool == DYNAMIC else None)
                        results["runs"].append({"checkpoint": tool, "location": location, "devices": n,
                                                "index": index, **row})
    finally:
        if gcs:
            gcs.stop()
        results["finished_at"] = _now()
        results["load_end"] = [round(x, 2) for x in os.getloadavg()]
        (WORK / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_results(results, Path(args.results), devices, locations)
    print(f"wrote {args.results} and {WORK / 'results.json'}")
    return 0


def summarise(results: dict, devices: list[int], locations: list[str]) -> list[dict]:
    rows = []
    for location in locations:
        for n in devices:
            for tool in CHECKPOINTS + (DYNAMIC,):
                runs = [r for r in results["runs"] if (r["checkpoint"], r["location"], r["devices"]) == (tool, location, n)]
                ok = [r for r in runs if r["returncode"] == 0 and "restore_seconds" in r]
                if not runs:
                    continue
                med = (lambda key: statistics.median(key(r) for r in ok) if ok else None)
                rows.append({"checkpoint": tool, "location": location, "devices": n, "ok": len(ok), "runs": len(runs),
                             "wall": med(lambda r: r["restore_seconds"]), "walls": [r["restore_seconds"] for r in ok],
                             "rss": med(lambda r: r["peak_rss_bytes"]), "chunks": ok[0].get("chunks") if ok else None,
                             "leaves": ok[0]["leaves"] if ok else None,
                             "requests": med(lambda r: r["server"].get("requests", 0)) if location == "gcs" and ok else None,
                             "bytes": med(lambda r: r["server"].get("bytes_read", 0)) if location == "gcs" and ok else None,
                             "server": ok[-1].get("server") if ok else None,
                             "by_kind": ok[-1].get("server", {}).get("by_kind") if ok else None})
    return rows


def write_results(results: dict, path: Path, devices: list[int], locations: list[str]) -> None:
    rows = summarise(results, devices, locations)
    m = results["machine"]
    conv = results["conversions"]
    first_ok = next((r for r in results["runs"] if r.get("versions")), {})
    lines = ["# Restore: ckptconv's checkpoint against MaxText 0.2.5's (issue 27)", "",
             f"Written by `python -m bench restore` ({results['started_at']} to {results['finished_at']} UTC). Command:", "",
             f"    {results['command']}", "",
             f"Model: a Qwen3-0.6B-shaped random bf16 checkpoint ({results['layers']} layers, `ckptconv.commands.synth`), "
             "converted once by each tool for 16 devices and reused by every restore:", ""]
    for tool in CHECKPOINTS:
        c = conv[tool]
        lines.append(f"- {tool}: `{c['command']}` ({c['files']} files, {c['bytes'] / MIB:.1f} MiB under `0/items`"
                     + (f", converted in {c['wall_seconds']:.0f} s" if c.get("wall_seconds") else "") + ")")
    for tool in CHECKPOINTS:
        data = [f.stat().st_size for f in (WORK / "ckpt" / f"{tool}-{results['layers']}l" / "0" / "items").glob("ocdbt.process_*/d/*")]
        if data:
            lines.append(f"  - {tool}'s OCDBT data files: {len(data)}, largest {max(data) / MIB:.1f} MiB, "
                         f"median {statistics.median(data) / MIB:.1f} MiB")
    lines += ["", "Every restore is a fresh child process (ckptconv's venv: "
              + ", ".join(f"{k} {v}" for k, v in first_ok.get("versions", {}).items())
              + ") with `XLA_FLAGS=--xla_force_host_platform_device_count=N`, restoring `<ckpt>/0/items` with "
              "`PyTreeCheckpointer().restore` onto N simulated CPU devices; every leaf's target is "
              "`jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, stored spec))` from the checkpoint's "
              "own metadata, so each device reads its own shard. Restore wall: the `restore` call alone (until every "
              "array is ready; metadata read and imports excluded). Peak RSS: the child's VmHWM (imports included). "
              "Stored chunks: sum over leaves of the chunks in the metadata's storage `chunk_shape`. Requests and bytes "
              "read: counted at the server by a counting proxy in front of fake-gcs-server, between two marker requests "
              "the child sends right before and after the restore call (so metadata reads before the call are not "
              "counted; the reads the restore call itself makes are). Bytes read are response bodies (compressed "
              "OCDBT data as stored, plus JSON).", "",
              f"Rounds: {results['runs'][-1]['index'] + 1 if results['runs'] else 0}; in each round, for each device "
              "count and location, ckptconv's checkpoint then MaxText's (then, with `--dynamic`, MaxText's "
              "safetensors_dynamic load of the HF files), alternating. Warm-up: one uncounted run of each first. "
              "Figures are medians.", "",
              "| checkpoint | location | devices | restore wall median (s) | peak RSS median (GiB) | stored chunks (leaves) "
              "| requests | bytes read (MiB) | runs ok | restore walls (s) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = (lambda v, f: "-" if v is None else f(v))
        lines.append(f"| {r['checkpoint']} | {r['location']} | {r['devices']} | {fmt(r['wall'], lambda v: f'{v:.2f}')} | "
                     f"{fmt(r['rss'], lambda v: f'{v / GIB:.2f}')} | {fmt(r['chunks'], str)} ({fmt(r['leaves'], str)}) | "
                     f"{fmt(r['requests'], lambda v: f'{v:.0f}')} | {fmt(r['bytes'], lambda v: f'{v / MIB:.1f}')} | "
                     f"{r['ok']}/{r['runs']} | {', '.join(f'{w:.2f}' for w in r['walls'])} |")
    ratios = []
    for location in locations:
        for n in devices:
            pair = {r["checkpoint"]: r for r in rows if (r["location"], r["devices"]) == (location, n)}
            a, b = pair.get("ckptconv"), pair.get("maxtext")
            if a and b and a["wall"] and b["wall"]:
                text = f"- {location}, {n} devices: wall {a['wall'] / b['wall']:.2f}x, peak RSS {a['rss'] / b['rss']:.2f}x"
                if a["chunks"] and b["chunks"]:
                    text += f", stored chunks {a['chunks'] / b['chunks']:.2f}x"
                if a["requests"] and b["requests"]:
                    text += f", requests {a['requests'] / b['requests']:.2f}x"
                ratios.append(text)
    if ratios:
        lines += ["", "ckptconv / MaxText (medians):", ""] + ratios
    if any(r["checkpoint"] == DYNAMIC for r in rows):
        lines += ["", f"`{DYNAMIC}`: no conversion; MaxText 0.2.5's `load_safetensors_dynamic_state` (the load "
                  "`source_checkpoint_layout=safetensors_dynamic` runs at every start) reads the HF safetensors files "
                  "(local directory, or the same files uploaded to the bucket), shards them over the N devices and "
                  "transforms them into MaxText's tree, in MaxText's venv ("
                  + ", ".join(f"{k} {v}" for k, v in next((r["versions"] for r in results["runs"]
                                                           if r["checkpoint"] == DYNAMIC and r.get("versions")), {}).items())
                  + "; Orbax's v1 safetensors layout). Its target is the same tree and the same shardings as the Orbax restores (those stored in "
                  "MaxText's checkpoint); its wall is that call alone (config parsing and imports excluded); it runs "
                  "third in each alternation. Stored chunks do not apply (the input holds "
                  "one safetensors entry per HF tensor).", ""]
        for location in locations:
            for n in devices:
                pair = {r["checkpoint"]: r for r in rows if (r["location"], r["devices"]) == (location, n)}
                a, d = pair.get("ckptconv"), pair.get(DYNAMIC)
                if a and d and a["wall"] and d["wall"]:
                    lines.append(f"- {location}, {n} devices: safetensors_dynamic / ckptconv restore: wall "
                                 f"{d['wall'] / a['wall']:.1f}x, peak RSS {d['rss'] / a['rss']:.2f}x"
                                 + (f", requests {d['requests'] / a['requests']:.2f}x" if a["requests"] and d["requests"] else ""))
    kinds = [r for r in rows if r["by_kind"]]
    if kinds:
        lines += ["", "Requests by kind (last run of each): " + "; ".join(
            f"{r['checkpoint']} {r['devices']} dev: " + ", ".join(f"{k} {v}" for k, v in sorted(r["by_kind"].items()))
            + f" ({r['server'].get('not_found', 0)} of them 404 existence probes, "
            f"{r['server'].get('aborted_by_client', 0)} hung up by the client before the whole body)"
            for r in kinds)]
    failures = [f"{r['name']}: {r.get('error')}" for r in results["runs"] if r["returncode"]]
    if failures:
        lines += ["", "Failed runs:", ""] + [f"- {f}" for f in failures]
    lines += ["", "## Machine and conditions", "",
              f"- {m['nproc']} CPUs ({m['cpu']}), {m['mem_total_bytes'] / GIB:.1f} GiB RAM, Linux {m['kernel']}; disk `{m['disk']}`",
              f"- Load averages (1/5/15 min) at start {results['load_start']}, at end {results['load_end']}; every process "
              "here ran under `nice -n 10`. Each run's 1-min load before it started is in "
              "`bench/work/restore/results.json`; it counts the bench's own runs before it (they follow each other "
              "without a pause). Compare the checkpoints through the alternating medians.",
              "- Local restores read from the page cache (the checkpoints were written or read just before; "
              "24 GiB RAM holds both), so they measure Orbax/tensorstore work, not the disk.",
              ("- gs:// is fake-gcs-server (memory backend, loopback, no throttling) behind a single-process Python "
               f"counting proxy that holds every request {results['latency_ms']:g} ms before forwarding it (`--latency-ms`, "
               "standing for a round trip to real GCS; concurrent requests wait together). Bandwidth is loopback's, not "
               "GCS's; the request counts are what transfers."
               if results.get("latency_ms") else
               "- gs:// is fake-gcs-server (memory backend, loopback, no latency, no throttling) behind a single-process "
               "Python counting proxy: the absolute gs:// times include the proxy's copying and say little about real "
               "GCS, where each request costs a round trip of tens of ms; the request counts are what transfers."),
              f"- ckptconv {results['ckptconv_versions'].get('ckptconv')} (git {results['ckptconv_versions'].get('git')}); "
              f"MaxText venv: " + ", ".join(f"{k} {v}" for k, v in results["mt_versions"].items()
                                            if k in ("maxtext", "jax", "orbax-checkpoint", "tensorstore")), ""]
    kept = path.read_text().partition(KEEP)[2] if path.exists() and KEEP in path.read_text() else ""
    path.write_text("\n".join(lines) + "\n" + (KEEP + kept if kept else ""))


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4] or None)
    elif len(sys.argv) > 1 and sys.argv[1] == "_shard":
        shard_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] or None)
    elif len(sys.argv) > 1 and sys.argv[1] == "_dynamic":
        dynamic_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6] or None, int(sys.argv[7]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_proxy":
        proxy(int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5]) if len(sys.argv) > 5 else 0.0)
    else:
        sys.exit(main())
