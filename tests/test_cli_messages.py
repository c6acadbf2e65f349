"""What the command line says: paths that are wrong say what is wrong, a reader that leaves early
ends the run quietly, progress without a terminal is whole lines, and ``--help`` shows defaults."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptconv import cli
from ckptconv.commands import synth
from tests.conftest import ROOT, run_cli

MODEL = synth.SynthModel(num_layers=2)


def one_line_error(code: int, err: str, expected: str) -> None:
    assert code == 2, err
    assert err.startswith("ckptconv: error: ") and err.count("\n") == 1, err
    assert expected in err and "Traceback" not in err, err


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A small checkpoint converted over 4 devices by the CLI, stderr captured (not a terminal)."""
    base = tmp_path_factory.mktemp("converted")
    src, dst = base / "src", base / "dst"
    synth.write_checkpoint(MODEL, str(src))
    result = run_cli("convert", str(src), str(dst), "--devices", "4")
    assert result.returncode == 0, result.stderr
    return src, dst, result


# --- 3. paths that are wrong say what is wrong --------------------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["inspect", "{tmp}/nowhere"], "{tmp}/nowhere: does not exist (no such directory"),
    (["inspect", "{tmp}/empty"], "{tmp}/empty: no checkpoint there"),
    (["inspect", "{tmp}/src"], "{tmp}/src: no checkpoint there"),  # an HF source, not a checkpoint
    (["inspect", "{tmp}/src/config.json"], "{tmp}/src/config.json: is a file, not a directory"),
    (["inspect", "s3://bucket/dir"], "s3:// is not a supported scheme for the checkpoint; supported: "
                                     "a local directory, gs://BUCKET/DIR"),
    (["plan", "{tmp}/src/config.json"], "{tmp}/src/config.json: is a file, not a directory; the source is a "
                                        "directory (holding config.json and *.safetensors)"),
    (["plan", "s3://bucket/dir"], "s3://bucket/dir: s3:// is not a supported scheme for the source; supported: "
                                  "a local directory, gs://BUCKET/DIR, hf://ORG/REPO[@REVISION]"),
    (["plan", "{tmp}/nowhere"], "{tmp}/nowhere: does not exist (no such directory; the source must exist)"),
    (["verify", "{tmp}/src", "{tmp}/nowhere"], "{tmp}/nowhere: does not exist"),
    (["verify", "s3://bucket/dir", "{tmp}/empty"], "s3:// is not a supported scheme for the source"),
    (["verify", "{tmp}/src", "{tmp}/src/config.json"], "is a file, not a directory"),
])
def test_wrong_paths_of_readers_say_what_is_wrong(tmp_path, capsys, args, expected):
    synth.write_checkpoint(MODEL, str(tmp_path / "src"))
    (tmp_path / "empty").mkdir()
    code = cli.main([arg.format(tmp=tmp_path) for arg in args])
    one_line_error(code, capsys.readouterr().err, expected.format(tmp=tmp_path))


@pytest.mark.parametrize("args, expected", [
    (["convert", "{tmp}/src", "s3://bucket/dir"], "s3:// is not a supported scheme for the destination; "
                                                  "supported: a local directory, gs://BUCKET/DIR"),
    (["convert", "{tmp}/src", "{tmp}/afile"], "{tmp}/afile: is a file, not a directory"),
    (["convert", "{tmp}/src/config.json", "{tmp}/dst"], "is a file, not a directory; the source"),
    (["export", "s3://bucket/dir", "{tmp}/dst", "--like", "{tmp}/src"], "not a supported scheme for the checkpoint"),
    (["export", "{tmp}/nowhere", "{tmp}/dst", "--like", "{tmp}/src"], "{tmp}/nowhere: does not exist"),
    (["export", "{tmp}/src", "{tmp}/dst", "--like", "s3://bucket/dir"], "not a supported scheme for the source"),
    (["export", "{tmp}/src", "s3://bucket/dir", "--like", "{tmp}/src"], "not a supported scheme for the destination"),
])
def test_wrong_paths_of_writers_are_refused_before_any_work(tmp_path, args, expected):
    """convert and export in a fresh process (they install signal handlers): one line, exit 2, nothing written."""
    synth.write_checkpoint(MODEL, str(tmp_path / "src"))
    (tmp_path / "afile").write_text("keep me\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_cli(*[arg.format(tmp=tmp_path) for arg in args], "--progress", "none")
    one_line_error(result.returncode, result.stderr, expected.format(tmp=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not (ROOT / "s3:").exists()
    assert (tmp_path / "afile").read_text() == "keep me\n"


# --- 4. a reader that leaves early --------------------------------------------------------------

def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """The CLI with stdout a real pipe whose reader has already gone (`ckptconv ... | head -1` once head left)."""
    read, write = os.pipe()
    os.close(read)
    try:
        env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
        return subprocess.run([sys.executable, "-m", "ckptconv", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT, timeout=300)
    finally:
        os.close(write)


def test_every_command_leaves_quietly_when_its_reader_has_gone(converted, tmp_path):
    src, dst, _ = converted
    exported = tmp_path / "exported"
    for args in (["--help"], ["inspect", "--help"]):  # argparse itself ignores a failed write of its help
        result = run_into_closed_pipe(*args)
        assert result.stderr == "" and result.returncode in (0, 141), (args, result.returncode, result.stderr)
    for args in (["plan", str(src)], ["plan", str(src), "--json"],
                 ["inspect", str(dst)], ["inspect", str(dst), "--json"], ["verify", str(src), str(dst), "--json",
                                                                          "--progress", "none"],
                 ["convert", str(src), str(dst), "--devices", "4", "--progress", "none"],  # a rerun: its one line
                 ["export", str(dst), str(exported), "--like", str(src), "--progress", "none"]):
        result = run_into_closed_pipe(*args)
        assert result.stderr == "" and result.returncode == 141, (args, result.returncode, result.stderr)
    assert json.loads((dst / "ckptconv-report.json").read_text())["status"] == "complete"
    assert json.loads((exported / "ckptconv-report.json").read_text())["status"] == "complete"  # done, then quiet


# --- 5. progress without a terminal is whole lines ----------------------------------------------

def test_convert_progress_without_a_terminal_is_whole_lines(converted):
    _, _, result = converted
    assert "\r" not in result.stderr
    lines = result.stderr.splitlines()
    assert any(line.startswith("convert: 100% ") and "24/24 tensors" in line and "ETA" in line for line in lines)


@pytest.mark.parametrize("as_json", [False, True])
def test_verify_shows_progress_and_keeps_json_clean(converted, as_json):
    src, dst, _ = converted
    result = run_cli("verify", str(src), str(dst), *(["--json"] if as_json else []))
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    lines = result.stderr.splitlines()
    assert any(line.startswith("verify: 100% ") and "24/24 tensors" in line for line in lines), result.stderr
    if as_json:
        assert json.loads(result.stdout)["ok"] is True
    else:
        assert result.stdout.startswith("verify: OK")
    quiet = run_cli("verify", str(src), str(dst), "--progress", "none")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_progress_lines_come_periodically_without_a_terminal():
    """One line per LINE_SECONDS of advancing and one at the end (the clock is the Progress object's own:
    patching ``time.monotonic`` would hand the test's clock to every thread of the worker process)."""
    import io

    from ckptconv import progress

    clock = iter(float(t) for t in range(0, 1000, 4))
    stream = io.StringIO()
    shown = progress.Progress(10, 10 * 2**20, "bar", stream=stream, desc="verify", clock=lambda: next(clock))
    for _ in range(10):
        shown.advance(1, 2**20)
    shown.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0].startswith("verify:  30% 3.00/10.00 MiB, 3/10 tensors")  # 12 s in, at the third advance
    assert lines[-1].startswith("verify: 100% 10.00/10.00 MiB, 10/10 tensors")
    assert len(lines) == 4  # advances 4 s apart (a line takes a reading too) against 10 s: every third, then the end


# --- 6. --help shows every default --------------------------------------------------------------

def test_help_shows_every_default(capsys):
    parser = cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    checked = 0
    for name, command in commands.items():
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
        for action in command._actions:
            if action.default in (None, argparse.SUPPRESS) or not action.option_strings:
                continue
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                continue  # a flag: its default is "not given"
            assert f"(default: {action.default})" in text, (name, action.option_strings, text)
            checked += 1
    assert checked >= 10


# --- 1. a sharding warning is true --------------------------------------------------------------

def plan_leaves(source: Path, devices: int) -> list[dict]:
    """The leaves inspect --json would show for a conversion of ``source`` (Orbax's recorded sharding)."""
    from ckptconv.families.sharding import MESH_AXIS, partition_spec
    from ckptconv.plan.conversion import make_plan
    from ckptconv.read import open_source
    from ckptconv.read.stored import StoredLeaf

    plan = make_plan(open_source(str(source)), devices=devices)
    return [StoredLeaf(leaf.path, leaf.shape, "bfloat16", (devices,) if devices > 1 else None,
                       (MESH_AXIS,) if devices > 1 else None,
                       partition_spec(leaf.shape, devices) if devices > 1 else None, leaf.chunk_shape).to_json()
            for leaf in plan.leaves]


@pytest.mark.parametrize("devices", [16, 8, 1])
def test_a_real_qwen3_plan_gets_no_sharding_warning(tmp_path, devices):
    """Qwen3-0.6B's shapes (header-only files): 28 layers in chunks of 8 along an unsharded axis is fine."""
    from tasks.checks import sharding_check

    synth.write_checkpoint(synth.QWEN3_0_6B, str(tmp_path), header_only=True)
    leaves = plan_leaves(tmp_path, devices)
    key = next(leaf for leaf in leaves if leaf["name"].endswith("self_attention/key/kernel"))
    assert key["shape"][1] % key["chunk_shape"][1]  # the case the old check took for a crossing
    assert sharding_check(leaves, devices).endswith("; chunks within shards"), sharding_check(leaves, devices)


def test_a_converted_checkpoint_gets_no_sharding_warning(converted):
    from tasks.checks import sharding_check

    _, dst, _ = converted
    result = run_cli("inspect", str(dst), "--json")
    text = sharding_check(json.loads(result.stdout)["leaves"], 4)
    assert text == "13 leaves sharded over 4 devices, 1 replicated; chunks within shards"  # the step: a scalar


def test_a_chunk_spanning_two_shards_gets_the_warning():
    from tasks.checks import sharding_check

    def leaf(name, shape, spec, chunk, mesh=(16,), names=("checkpoint_sharding_axis",)):
        return {"name": name, "shape": list(shape), "mesh_shape": list(mesh), "axis_names": list(names),
                "partition_spec": list(spec), "chunk_shape": list(chunk)}

    fine = [leaf("wi", (1024, 28, 3072), ("checkpoint_sharding_axis",), (64, 8, 1000)),  # unsharded dims: any chunk
            leaf("kv", (28, 1024), (None, "checkpoint_sharding_axis"), (5, 32))]
    assert sharding_check(fine, 16).endswith("chunks within shards")
    crossing = [leaf("wi", (1024, 28, 3072), ("checkpoint_sharding_axis",), (128, 28, 3072)),  # 2 shards a chunk
                leaf("kv", (28, 1024), (None, "checkpoint_sharding_axis"), (28, 48)),  # boundaries off the grid
                leaf("mesh2", (64, 64), (("data", "model"),), (16, 64), mesh=(2, 4), names=("data", "model"))]
    text = sharding_check(fine + crossing, 16)
    assert "3 leaves have chunks crossing shard boundaries" in text, text
    assert "wi (dim 0: chunks of 128 in shards of 64)" in text and "kv (dim 1: chunks of 48 in shards of 64)" in text
    assert "mesh2 (dim 0: chunks of 16 in shards of 8)" in text


def test_multimodal_is_refused_where_no_encoder_is_converted(tmp_path, synth_dir):
    """``--multimodal`` asks for the encoders: a family whose rules convert the text decoder only says so
    (one line, exit 2, nothing written) instead of quietly writing the decoder alone; ``plan`` says the same."""
    source, dst = synth_dir(MODEL), tmp_path / "dst"
    for command in (("convert", str(source), str(dst), "--progress", "none"), ("plan", str(source))):
        result = run_cli(*command, "--multimodal")
        one_line_error(result.returncode, result.stderr, "--multimodal converts the encoders MaxText converts")
        assert "convert the text decoder only" in result.stderr
    assert not dst.exists()


def test_report_records_whether_the_encoders_were_asked_for(converted):
    _, dst, _ = converted
    report = json.loads((dst / "ckptconv-report.json").read_text())
    assert report["multimodal"] is False and report["model"]["values"]["multimodal"] is False


def test_plan_predicts_what_the_report_records(converted):
    """Prefect admission reserves ``plan``'s prediction; the memory tests read the report's: the same figure."""
    src, dst, _ = converted
    report = json.loads((dst / "ckptconv-report.json").read_text())
    planned = run_cli("plan", str(src), "--devices", "4", "--json")
    assert json.loads(planned.stdout)["predicted_peak_rss_bytes"] == report["predicted_peak_rss_bytes"]
    assert json.loads(planned.stdout)["predicted_peak_terms"] == report["predicted_peak_terms"]


def test_restore_figures_of_a_relative_path_are_those_of_the_absolute_one(converted, monkeypatch):
    """The library takes a checkpoint by a relative path as the CLI does: a local path made a ``file://`` URL as it
    was (``file://dst/0/items``) named a host, not a directory."""
    from ckptconv.commands.convert import restore_figures

    _, dst, _ = converted
    timed = ("device_read_seconds",)
    absolute = {k: v for k, v in restore_figures(str(dst)).items() if k not in timed}
    # the working directory is the process's: changed only for the synchronous call below (its reads end with it),
    # and the threads that outlive tests in this worker (the fake hub's, the GCS gate's) use absolute paths
    monkeypatch.chdir(dst.parent)
    relative = {k: v for k, v in restore_figures(dst.name).items() if k not in timed}
    assert "error" not in relative and "read_error" not in relative, relative
    assert relative == absolute and relative["device_reads"] >= 2
