"""``verify SRC DST`` with several workers (issue 38: it used one core where convert uses them all): the same result,
mismatch for mismatch and in the same order, as one worker; the workers chosen under the memory budget as convert
chooses them; damage found the same way."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from ckptconv.commands import synth
from tests.conftest import run_cli

# A leaf of several read units (the embedding: 24 MiB in 16 MiB units) among a dozen jobs.
MODEL = synth.SynthModel(vocab_size=12288, hidden_size=1024, num_layers=3, num_heads=8, num_kv_heads=4, head_dim=64,
                         intermediate_size=2048, tie_word_embeddings=False)
DAMAGED = ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.layers.2.self_attn.q_proj.weight",
           "lm_head.weight")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("verify_workers")
    synth.write_checkpoint(MODEL, str(base / "src"))
    done = run_cli("convert", str(base / "src"), str(base / "dst"), "--devices", "4", "--progress", "none")
    assert done.returncode == 0, done.stderr
    return base


def _flip_bytes(directory, names) -> None:
    """One byte flipped in the second half of each tensor ``names`` names, in place (the header untouched)."""
    for file in directory.glob("*.safetensors"):
        data = bytearray(file.read_bytes())
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
        for name in names:
            if name in header:
                begin, end = header[name]["data_offsets"]
                data[8 + length + (begin + 3 * end) // 4] ^= 0x40
        file.write_bytes(bytes(data))


def _verify(src, dst, workers: int) -> tuple[int, dict]:
    done = run_cli("verify", str(src), str(dst), "--json", "--progress", "none", "--workers", str(workers))
    result = json.loads(done.stdout)
    assert result.pop("workers") == workers, result
    assert 0 < result["peak_rss_bytes"] <= result["predicted_peak_rss_bytes"], result  # convert's prediction bounds it
    for varying in ("seconds", "workers_why", "peak_rss_bytes", "predicted_peak_rss_bytes"):
        result.pop(varying)
    return done.returncode, result


def test_several_workers_verify_as_one(converted):
    one, four = _verify(converted / "src", converted / "dst", 1), _verify(converted / "src", converted / "dst", 4)
    assert one == four and one[0] == 0 and one[1]["bytes"] > 48 * 2**20, one


def test_several_workers_find_the_same_mismatches_in_the_same_order(converted, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(converted / "src", changed)
    _flip_bytes(changed, DAMAGED)
    results = {workers: _verify(changed, converted / "dst", workers) for workers in (1, 2, 4)}
    assert results[1] == results[2] == results[4], results
    code, result = results[1]
    assert code == 1 and len(result["mismatches"]) == len(DAMAGED), result["mismatches"]
    assert all("differs (first byte" in line for line in result["mismatches"])


def test_a_damaged_data_file_is_found_with_several_workers(converted, tmp_path):
    dst = tmp_path / "dst"
    shutil.copytree(converted / "dst", dst)
    biggest = max((dst / "0" / "items").glob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    for workers in ("1", "4"):
        done = run_cli("verify", str(converted / "src"), str(dst), "--workers", workers, "--progress", "none")
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert done.stderr.startswith("ckptconv: error: ") and done.stderr.count("\n") == 1, done.stderr


def test_the_workers_are_chosen_under_the_memory_budget(converted):
    """As convert: the most whose predicted peak fits the budget, one at least, and the result says why."""
    done = run_cli("verify", str(converted / "src"), str(converted / "dst"), "--json", "--progress", "none",
                   "--workers", "4", "--memory-budget", "1MiB")
    result = json.loads(done.stdout)
    assert done.returncode == 0 and result["workers"] == 1 and "over --memory-budget" in result["workers_why"], result


def test_mismatches_are_listed_job_by_job_in_the_plan_s_order(tmp_path):
    """Leaves stored with another shape and leaves whose bytes differ are listed in the plan's order, whichever check
    found them (the shapes before any tile is read, the bytes after), as one job at a time listed them: here the
    final norm's bytes (job 1) between the embedding's and the output head's shapes (jobs 0 and 2); 1 and 3 workers."""
    from ckptconv.plan.conversion import make_plan
    from ckptconv.read import open_source

    untied = dict(tie_word_embeddings=False, num_layers=2)
    synth.write_checkpoint(synth.SynthModel(**untied), str(tmp_path / "a"))
    done = run_cli("convert", str(tmp_path / "a"), str(tmp_path / "dst"), "--devices", "4", "--progress", "none")
    assert done.returncode == 0, done.stderr
    synth.write_checkpoint(synth.SynthModel(vocab_size=640, **untied), str(tmp_path / "b"))  # a wider vocabulary
    _flip_bytes(tmp_path / "b", ("model.norm.weight",))
    lists = {workers: _verify(tmp_path / "b", tmp_path / "dst", workers)[1]["mismatches"] for workers in (1, 3)}
    assert lists[1] == lists[3], lists
    order = {leaf.name: n for n, leaf in enumerate(make_plan(open_source(str(tmp_path / "b")), devices=1).leaves)}
    where = [order[line.split(": ", 1)[0]] for line in lists[1]]
    assert where == sorted(where), lists[1]
    kinds = ["shape" if ": stored " in line else "bytes" for line in lists[1]]
    assert kinds[0] == "shape" and "shape" in kinds[kinds.index("bytes"):], lists[1]  # not every shape line first
