"""The Prefect layer's pieces without a server: failure classes, children, admission, artifacts, manifests."""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.states import Failed

from flows.artifacts import output_link, stage_rows, summary_markdown, zoo_row
from flows.zoo import ManifestError, load_manifest
from tasks.admission import GIB, MemoryLimit, configured_limit, ram_bytes, slots_needed
from tasks.checks import sharding_check
from tasks.child import child_env, run_json, stream_child
from tasks.failures import (BadInput, ChildFailed, ChildKilled, ChildTimeout, TooBigForWorker, TransientIOError, killed,
                            error_line, failure, retryable)
from tasks.job import Conversion, slugify
from tests.held import hold_at

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("jax", "jaxlib", "orbax", "tensorstore", "ckptconv.commands.convert", "ckptconv.write.orbax", "ckptconv.read.stored",
             "ckptconv.commands.verification", "ckptconv.commands.inspection")


def test_nothing_under_tasks_or_flows_imports_jax_or_orbax():
    modules = sorted(f"{p.parent.name}.{p.stem}" for d in ("tasks", "flows") for p in (ROOT / d).glob("*.py"))
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print([m for m in sys.modules if m in {FORBIDDEN!r} or m.split('.')[0] in {FORBIDDEN!r}])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    for path in [p for d in ("tasks", "flows") for p in (ROOT / d).glob("*.py")]:  # and not lazily either
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n in FORBIDDEN or n.split(".")[0] in FORBIDDEN], (path, names)


def test_conversion_speaks_the_cli():
    job = Conversion("hf://Qwen/Qwen3-0.6B", "gs://b/Qwen3-0.6B_scan/", devices=8, scan_layers=False, dtype="float32")
    assert job.slug == "qwen3-0-6b-scan"
    assert Conversion("s", "d", name="My Model!").slug == "my-model"
    assert slugify("__") == "model"
    assert job.convert_args("/r.json") == ["convert", "hf://Qwen/Qwen3-0.6B", "gs://b/Qwen3-0.6B_scan/", "--devices", "8",
                                           "--no-scan-layers", "--dtype", "float32", "--progress", "jsonl",
                                           "--report", "/r.json"]
    assert Conversion("s", "d", overwrite=True).convert_args("r")[-1] == "--overwrite"
    assert "--multimodal" in Conversion("s", "d", multimodal=True).layout_args()
    assert "--multimodal" not in Conversion("s", "d").layout_args()
    assert Conversion("s", "d", data_file_size="1GiB").layout_args()[-2:] == ["--data-file-size", "1GiB"]
    assert "--data-file-size" not in Conversion("s", "d").layout_args()  # the default: the CLI's own
    # the restore layout: a flag only where it differs from the CLI's default; the codec is convert's alone (plan's
    # prediction does not depend on it)
    assert Conversion("s", "d", data_files_by_device=True).layout_args()[-1:] == ["--data-files-by-device"]
    assert Conversion("s", "d", data_files_by_device=False).layout_args()[-1:] == ["--no-data-files-by-device"]
    assert not {"--data-files-by-device", "--no-data-files-by-device", "--compression"} & set(
        Conversion("s", "d").convert_args("r"))
    lz4 = Conversion("s", "d", compression="lz4")
    assert lz4.convert_args("r")[-2:] == ["--compression", "lz4"] and "--compression" not in lz4.layout_args()


@pytest.mark.parametrize("returncode, tail, timed_out, expected", [
    (2, ["ckptconv: error: /x/config.json: missing"], False, BadInput),
    (-signal.SIGKILL, [], False, ChildKilled),
    (-signal.SIGTERM, [], False, ChildKilled),
    (1, ["Traceback ...", "ConnectionResetError: [Errno 104] Connection reset by peer"], False, TransientIOError),
    (1, ["google.api_core.exceptions.ServiceUnavailable: 503 Service Unavailable"], False, TransientIOError),
    (1, ["ckptconv: error: orbax said no"], False, ChildFailed),
    (-signal.SIGKILL, [], True, ChildTimeout),
])
def test_failures_are_classified_by_exit(returncode, tail, timed_out, expected):
    error = failure("ckptconv convert x", returncode, tail, timed_out, 5)
    assert type(error) is expected
    retry = retryable(None, None, Failed(data=error))
    assert retry == (expected in (ChildKilled, TransientIOError))


def test_error_line_prefers_the_cli_message():
    assert error_line(["noise", "ckptconv: error: bad thing", "more"]) == "bad thing"
    assert error_line(["Traceback", "ValueError: x", ""]) == "ValueError: x"
    assert "SIGKILL" in str(failure("c", -9, [], False, None)) and "out of memory" in str(failure("c", -9, [], False, None))


def test_stream_child_reports_the_childs_own_peak_not_the_parents(synth_dir):
    """wait4's ru_maxrss of a child forked from a big process is the big process; VmHWM is the child's.

    This is why the Prefect artifacts show the conversion's VmHWM: a worker holding 600 MiB would
    otherwise report every conversion as at least 600 MiB.
    """
    ballast = bytearray(600 * 2**20)
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])  # touch every page: resident in this (parent) process
    lines = []
    # a real plan (about a second), not `--help`: a child gone within the first 0.2 s sample has no VmHWM
    result = stream_child(["plan", str(synth_dir())], child_env(1), lambda line, pid: lines.append((line, pid)))
    assert result.returncode == 0 and any("qwen3" in line for line, _ in lines), lines
    assert result.wait4_maxrss_bytes >= 600 * 2**20, "the kernel's ru_maxrss includes the parent at fork"
    assert 5 * 2**20 < result.own_peak_rss_bytes < 300 * 2**20, "VmHWM is the child's own address space"
    del ballast


def test_stream_child_timeout_kills_the_child(synth_dir, tmp_path):
    job = Conversion(str(synth_dir()), str(tmp_path / "out"), devices=4)
    start = time.monotonic()  # the child holds itself at its plan (tests.held): however quick, it cannot finish first
    result = stream_child(job.convert_args(str(tmp_path / "r.json")), {**child_env(4), **hold_at("plan")},
                          lambda *_: None, timeout=0.5)
    assert (result.timed_out, result.returncode) == (True, -signal.SIGKILL)
    assert time.monotonic() - start < 10
    with pytest.raises(ChildTimeout, match="no result after 0.5 s"):
        result.check("ckptconv convert", 0.5)


def test_run_json_raises_bad_input_for_exit_2(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        run_json(["plan", str(tmp_path / "nothing"), "--json"], child_env(1), timeout=120)


def test_child_env_sets_devices_and_arena_cap():
    env = child_env(16)
    assert "--xla_force_host_platform_device_count=16" in env["XLA_FLAGS"]
    assert env["JAX_PLATFORMS"] == "cpu" and env["MALLOC_ARENA_MAX"] == "2"


def test_admission_rounds_up_and_refuses_models_bigger_than_the_worker():
    limit = MemoryLimit("ckptconv-memory-gb-host", 4)
    assert slots_needed(1, limit) == 1
    assert slots_needed(int(2.2 * GIB), limit) == 3
    assert slots_needed(4 * GIB, limit) == 4
    with pytest.raises(TooBigForWorker, match=r"needs 5 GB of 'ckptconv-memory-gb-host', which has 4 GB"):
        slots_needed(4 * GIB + 1, limit)


def test_memory_limit_is_configured_per_host():
    assert configured_limit({"CKPTCONV_MEMORY_GB": "7", "CKPTCONV_MEMORY_LIMIT": "x"}) == MemoryLimit("x", 7)
    default = configured_limit({})
    assert default.name.startswith("ckptconv-memory-gb-") and default.gb >= 1
    assert configured_limit({"CKPTCONV_MEMORY_HEADROOM_GB": "0"}).gb == default.gb + 2 == ram_bytes() // GIB


def _leaf(name, shape, mesh, spec, chunk):
    return {"name": name, "shape": shape, "mesh_shape": mesh, "partition_spec": spec, "chunk_shape": chunk}


def test_sharding_check_counts_sharded_leaves_and_chunk_fit():
    leaves = [_leaf("emb", [512, 64], [16], ["x"], [32, 64]), _leaf("wo", [128, 2, 64], [16], ["x"], [8, 1, 64]),
              _leaf("out", [8, 2, 4, 64], [16], [], [8, 1, 4, 64])]
    assert sharding_check(leaves, 16) == "2 leaves sharded over 16 devices, 1 replicated; chunks within shards"
    bad = [_leaf("emb", [512, 64], [16], ["x"], [64, 64])]
    assert "chunks crossing shard boundaries: emb" in sharding_check(bad, 16)
    assert sharding_check([_leaf("emb", [512, 64], None, None, [512, 64])], 1) == \
        "1 leaves unsharded (1 device); chunks within shards"
    assert "(requested 8 devices!)" in sharding_check(leaves, 8)


REPORT = {"source": {"uri": "/src", "kind": "local"}, "devices": 4, "scan_layers": True, "dtype": "bfloat16",
          "family": "qwen3", "maxtext_decoder_block": "qwen3", "tensors": 24, "leaves": 13, "source_bytes": 2 * 2**20,
          "output_bytes": 2 * 2**20, "wall_seconds": 2.0, "peak_rss_bytes": 200 * 2**20, "skipped": False,
          "stage_seconds": {"commit": 0.1, "plan": 0.01, "read": 0.5, "transform": 0.2, "write": 1.0},
          "wait4_maxrss_bytes": 900 * 2**20, "attempts": 2, "child_seconds": 3.5,
          "admission": {"limit": "l", "limit_gb": 8, "held_gb": 1, "admitted_at": "a", "released_at": "b"}}


def test_stage_rows_in_pipeline_order_with_the_conversions_own_peak():
    rows = stage_rows(REPORT)
    assert [r["stage"] for r in rows] == ["plan", "read", "transform", "write", "commit", "total (wall)"]
    assert rows[1] == {"stage": "read", "seconds": 0.5, "bytes": 2 * 2**20, "mib_per_s": 4.0, "peak_rss_bytes": None}
    assert rows[-1]["peak_rss_bytes"] == 200 * 2**20 and rows[-1]["mib_per_s"] == 1.0  # VmHWM, not wait4's 900


def test_summary_markdown_and_links():
    job = Conversion("/src", "/dst", devices=4)
    text = summary_markdown(job, {"predicted_peak_rss_bytes": GIB}, REPORT, None, "13 leaves sharded over 4 devices")
    assert "| sharding | 13 leaves sharded over 4 devices |" in text and "| attempts | 2 |" in text
    assert "200 MiB (the conversion's own high-water mark, VmHWM)" in text and "predicted 1 GiB" in text
    assert "wait4 900 MiB (includes the worker at fork)" in text and "held 1 GB of `l`" in text
    assert zoo_row(job, REPORT, None, 2)["peak_rss_mib"] == 200
    assert output_link("gs://b/p/q") == "https://console.cloud.google.com/storage/browser/b/p/q"
    assert output_link("/x/y") == "file:///x/y"
    row = zoo_row(job, REPORT, None, 2)
    assert (row["status"], row["retries"], row["held_gb"], row["wall_seconds"]) == ("complete", 1, 1, 2.0)
    assert zoo_row(job, None, "BadInput: no", 1)["status"] == "failed"
    assert zoo_row(job, {**REPORT, "skipped": True}, None, 1)["wall_seconds"] == 3.5


def test_manifest_example_parses_and_filters_by_pool():
    zoo = load_manifest(str(ROOT / "deploy" / "zoo.yaml"))
    assert zoo.name == "nightly" and len(zoo.entries) == 5
    cpu, tpu = zoo.jobs("cpu-pool"), zoo.jobs("tpu-pool")
    assert len(cpu) + len(tpu) == 5 and len(zoo.jobs(None)) == 5
    assert all(job.source and job.destination for job in zoo.jobs(None))
    assert {job.devices for job in tpu} == {16, 64}
    assert [job.scan_layers for job in cpu] == [True, False, True]


def test_manifest_deployments_name_every_pool_and_retry_pool(tmp_path):
    zoo = load_manifest(str(ROOT / "deploy" / "zoo.yaml"))
    assert set(zoo.deployments) == {"cpu-pool", "tpu-pool", "highmem-pool"}
    retried = [entry for entry in zoo.entries if entry.retry_pool]
    assert [(e.job.name, e.pools) for e in retried] == [("mistral-7b-v0-3", ("cpu-pool", "highmem-pool"))]
    path = tmp_path / "zoo.yaml"
    path.write_text("deployments: {cpu-pool: convert-model/convert-model-cpu}\n"
                    "models:\n  - {name: a, source: s, destination: d, pool: cpu-pool, retry_pool: big}\n")
    with pytest.raises(ManifestError, match=r"models\[0\] \(a\): no deployment for pool\(s\) \['big'\]"):
        load_manifest(str(path))
    path.write_text("models:\n  - {name: a, source: s, destination: d, retry_pool: big}\n")
    with pytest.raises(ManifestError, match="retry_pool needs a top-level 'deployments' table"):
        load_manifest(str(path))


def test_kills_are_told_from_other_failures():
    assert killed("Flow run encountered an exception: ChildKilled: ckptconv convert x: killed by SIGKILL (exit -9)")
    assert not killed("Flow run encountered an exception: BadInput: exit 2: config.json: missing")
    assert not killed(None)


def test_manifest_errors_name_the_entry(tmp_path):
    path = tmp_path / "zoo.yaml"
    path.write_text("models:\n  - {name: a, source: s, destination: d, layers: 3}\n")
    with pytest.raises(ManifestError, match=r"models\[0\] \(a\): unknown field\(s\) \['layers'\]"):
        load_manifest(str(path))
    path.write_text("models:\n  - {name: a, source: s}\n")
    with pytest.raises(ManifestError, match=r"missing \['destination'\]"):
        load_manifest(str(path))
    path.write_text("models:\n  - {source: s, destination: x/m}\n  - {source: t, destination: y/m}\n")
    with pytest.raises(ManifestError, match="share the artifact key"):
        load_manifest(str(path))



def test_child_lines_are_scrubbed_of_the_token(tmp_path):
    """A line a library might build with the token in it never reaches a log or a state message."""
    from tasks.child import scrub, secrets

    env = {"HF_TOKEN": "hf_SECRETsecret123456\nsecond-line-part", "HF_HOME": str(tmp_path)}
    hidden = secrets(env)
    line = "Illegal header value b'Bearer hf_SECRETsecret123456' then second-line-part"
    assert scrub(line, hidden) == "Illegal header value b'Bearer [token]' then [token]"
    assert "x" not in secrets({"HF_TOKEN": "x"})  # too short to be a token: scrubbing it would mangle every line
