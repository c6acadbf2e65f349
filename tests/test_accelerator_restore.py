"""``restore-check`` on CPU devices, as CI runs it: the code a TPU host runs, with JAX's CPU devices standing for chips.

A checkpoint restores onto another device count than it was written for (16 onto 4, 1 onto 8), every shard is
compared with the stored data, and a leaf that differs is one line naming it: a shard on the wrong device (found
by the comparison itself), and a byte flipped in the stored data (OCDBT keeps a digest of what it stores: the
restore fails on it, and the check names the leaf).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ckptconv.commands import synth
from tests.conftest import run_cli

LEAF = "params/params/decoder/layers/mlp/wo/kernel"


def _convert(src: Path, dst: Path, *flags: str) -> Path:
    done = run_cli("convert", str(src), str(dst), "--progress", "none", *flags)
    assert done.returncode == 0, done.stderr
    return dst


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("restore")
    synth.write_checkpoint(synth.SynthModel(), str(base / "src"))
    return base


def _check(dst: Path, *flags: str) -> tuple[int, dict, str]:
    done = run_cli("restore-check", str(dst), "--json", *flags)
    return done.returncode, (json.loads(done.stdout) if done.stdout.strip() else {}), done.stderr


@pytest.mark.parametrize(("written", "host"), [(16, 4), (1, 8), (4, 1)])
def test_restores_onto_the_hosts_device_count_and_every_leaf_matches(model, written, host):
    dst = _convert(model / "src", model / f"d{written}", "--devices", str(written))
    code, report, stderr = _check(dst, "--cpu-devices", str(host))
    assert code == 0, stderr
    assert report["ok"] and report["platform"] == "cpu" and report["devices"] == host
    assert report["leaves_checked"] == report["leaves"] == 14  # 13 weights and MaxText's step
    # replicated leaves are checked on every device; the int64 step is an int32 on devices (JAX without x64)
    assert report["bytes_checked"] >= report["bytes"] - 4 > 0
    assert report["restore_seconds"] > 0 and report["gib_per_s"] > 0 and report["peak_rss_bytes"] > 0
    if host > 1:  # sharded over the host's devices, stored layout or (1-device layout) MaxText's rule: not replicated
        assert report["restored_bytes_per_device"] < report["bytes"] / 2
    else:
        assert report["restored_bytes_per_device"] == report["bytes"] - 4  # the step: int32 on devices


def _flip_stored_byte(dst: Path, leaf: str) -> None:
    """Flip one byte of ``leaf``'s raw bytes where they lie in a data file (uncompressed chunks hold them verbatim)."""
    from ckptconv.read.stored import open_items_leaf

    items = (dst / "0" / "items").as_posix()
    values = open_items_leaf(items, tuple(leaf.split("/")))[0:2].read().result()
    needle = values.tobytes()[:64]
    files = [f for f in (dst / "0" / "items").rglob("*") if f.is_file() and f.parent.name == "d"]
    hits = [(f, f.read_bytes().find(needle)) for f in files if needle in f.read_bytes()]
    assert len(hits) == 1, hits
    file, at = hits[0]
    data = bytearray(file.read_bytes())
    data[at + 10] ^= 0x5A
    file.write_bytes(bytes(data))


def test_a_byte_flipped_in_the_stored_data_is_one_line_naming_the_leaf(model):
    """OCDBT keeps a digest of what it stores: the restore fails on the flipped byte, and the check names the leaf
    (reading the chunks one at a time), exits 1, and prints no traceback."""
    dst = _convert(model / "src", model / "flipped", "--devices", "4", "--compression", "none")
    _flip_stored_byte(dst, LEAF)
    code, report, stderr = _check(dst, "--cpu-devices", "2")
    assert code == 1, stderr
    assert not report["ok"] and len(report["mismatches"]) == 1, report["mismatches"]
    assert report["mismatches"][0].startswith(f"{LEAF}: chunk [0, 0, 0] does not decode")
    for _ in range(4):  # the reads Orbax left in flight ended printing tracebacks in about 1 run of 16
        done = run_cli("restore-check", str(dst), "--cpu-devices", "2")
        assert done.returncode == 1 and "restore-check: FAILED (1 mismatches)" in done.stdout, done.stdout + done.stderr
        assert done.stdout.count(LEAF) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_only_orbax_s_abandoned_reads_go_unprinted(monkeypatch):
    """What restore() quiets while Orbax's restore runs, and after it failed: a read coroutine of Orbax's collected
    with its failure, and "Event loop is closed" from a read that ended after Orbax closed its loop; anything else
    unraisable still reaches the hook that was there, and a restore that did not fail leaves that hook as it was."""
    import gc
    import sys

    from ckptconv.commands import restore_check

    seen = []
    recorder = seen.append
    monkeypatch.setattr(sys, "unraisablehook", recorder)  # this synchronous test's own, undone by monkeypatch

    class Raises:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    class Pending:
        def __await__(self):
            yield

    async def read(failure: str):
        try:
            await Pending()
        except GeneratorExit:  # closed while suspended, as Orbax's are when collected: raises what it read
            raise Exception(failure) from None

    undo = restore_check._quiet_abandoned_reads()
    Raises(RuntimeError("Event loop is closed"))
    orbax_s, other = read("Encountered error while reading array index"), read("another coroutine's")
    orbax_s.__qualname__ = restore_check.ORBAX_READ_COROUTINE
    for suspended in (orbax_s, other):
        suspended.send(None)
    del orbax_s, other, suspended
    Raises(ValueError("someone else's"))
    Raises(RuntimeError("another RuntimeError"))
    gc.collect()
    assert [str(u.exc_value) for u in seen] == ["another coroutine's", "someone else's", "another RuntimeError"]
    undo()
    assert sys.unraisablehook is recorder
    Raises(RuntimeError("Event loop is closed"))
    assert str(seen[-1].exc_value) == "Event loop is closed"


def test_a_shard_on_the_wrong_device_is_named(model):
    """The comparison itself: a restored leaf whose shards sit on each other's devices (in this process: the tests'
    16 CPU devices) is one mismatch naming the leaf and the device."""
    import jax

    from ckptconv.commands.restore_check import RestoreCheck, compare, host_target, restore
    from ckptconv.read.stored import read_metadata

    dst = _convert(model / "src", model / "d16", "--devices", "16") if not (model / "d16").exists() else model / "d16"
    stored, _ = read_metadata(str(dst))
    devices = jax.devices()[:4]
    result = RestoreCheck(destination=str(dst))
    restored = restore(str(dst), stored, host_target(stored, devices, []), result)
    path = tuple(LEAF.split("/"))
    good = restored[path]
    host = np.asarray(good)
    rolled = np.roll(host, host.shape[0] // 4, axis=0)  # device i now holds device i-1's rows
    restored[path] = jax.device_put(rolled, good.sharding)
    compare(str(dst), stored, restored, result)
    assert result.leaves_checked == len(stored) - 1
    assert len(result.mismatches) == 1 and result.mismatches[0].startswith(f"{LEAF}: on device {devices[0].id}")


def _new_live_arrays(before: set[int]) -> list:
    import jax

    return [a for a in jax.live_arrays() if id(a) not in before]


def test_a_check_that_raises_part_way_leaves_nothing_on_the_devices(model, monkeypatch):
    """A library caller whose check stops part-way (here the second shard's comparison raises, as a stored chunk that
    cannot be read or an interrupt would) gets the error and its devices back: no restored leaf stays alive."""
    import gc

    import jax

    from ckptconv.commands import restore_check as module

    dst = _convert(model / "src", model / "d16", "--devices", "16") if not (model / "d16").exists() else model / "d16"
    real, calls = module._compare_shard, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("the stored data went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_compare_shard", failing)
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    with pytest.raises(OSError, match="went away") as caught:
        module.restore_check(str(dst))
    assert len(calls) == 2  # it raised part-way: one shard compared, the rest of the model on the devices
    # while the caller still holds the error (handles it, logs it, retries): its traceback holds restore_check's frame
    assert caught.value and _new_live_arrays(before) == []

