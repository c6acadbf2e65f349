"""The chunk codec a conversion chooses (``--compression``): what each stores, that every reader decodes it,
and that the choice is reported. MaxText reads the chain from each leaf's ``zarr.json``, as Orbax does
(tests/test_trust3.py restores the default's chunks with Orbax)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.read.stored import open_database
from ckptconv.write import codecs
from tests.conftest import run_cli

ORBAX_CHAIN = {"name": "sharding_indexed", "configuration": {
    "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": 3}}],
    "index_codecs": [{"name": "bytes"}, {"name": "crc32c"}]}}


@pytest.mark.parametrize("dtype, width", [(ml_dtypes.bfloat16, 2), (np.float32, 4), (ml_dtypes.float8_e4m3fn, 1),
                                          (np.int32, 4)])
def test_lz4_shuffles_bit_planes_of_the_dtype_width(dtype, width):
    chain = codecs.with_codec([ORBAX_CHAIN], "lz4", np.dtype(dtype))[0]["configuration"]
    assert chain["codecs"][1] == {"name": "blosc", "configuration": {
        "cname": "lz4", "clevel": codecs.BLOSC_LEVEL, "shuffle": "bitshuffle", "typesize": width}}
    assert chain["index_codecs"] == ORBAX_CHAIN["configuration"]["index_codecs"]  # the shard index untouched


def test_zstd_keeps_orbax_codec_at_our_level_and_none_leaves_the_chain_alone():
    zstd = codecs.with_codec(ORBAX_CHAIN, "zstd", np.dtype(np.float32))
    assert zstd["configuration"]["codecs"][1] == {"name": "zstd", "configuration": {"level": codecs.ZSTD_LEVEL}}
    assert codecs.with_codec(ORBAX_CHAIN, "none", np.dtype(np.float32)) is ORBAX_CHAIN
    assert not codecs.compresses("none") and codecs.compresses("lz4") and codecs.DEFAULT in codecs.CODECS


def _chains(items) -> dict[str, tuple[str, list[dict]]]:
    """Every weight's (stored data type, chunk codecs inside the shard), by leaf name (MaxText's ``step``,
    written by Orbax's own handler, keeps Orbax's chain)."""
    db = open_database(str(items))
    names = [key.decode() for key in db.list().result() if key.endswith(b"/zarr.json") and key.startswith(b"params.")]
    metadata = {name[:-len("/zarr.json")]: json.loads(bytes(db.read(name).result().value)) for name in names}
    return {name: (meta["data_type"], meta["codecs"][0]["configuration"]["codecs"]) for name, meta in metadata.items()}


@pytest.mark.parametrize("flags, inner", [
    ([], "zstd"), (["--compression", "lz4"], "blosc"), (["--compression", "zstd"], "zstd"),
    (["--compression", "none"], None), (["--no-compression"], None),
    (["--data-files-by-device"], "blosc"), (["--data-files-by-device", "--compression", "zstd"], "zstd")])
def test_each_codec_is_stored_reported_and_verified(synth_dir, tmp_path, flags, inner):
    """Unasked, the codec follows the layout: zstd in the source's order (this small model's, at the default data
    file size), lz4 by device; asked, it is what was asked."""
    src, ckpt = synth_dir(synth.SynthModel(model_type="qwen3", num_layers=2)), tmp_path / "ckpt"
    done = run_cli("convert", str(src), str(ckpt), "--devices", "4", "--progress", "none", *flags)
    assert done.returncode == 0, done.stderr
    report = json.loads((ckpt / "ckptconv-report.json").read_text())
    assert report["compression"] == {"blosc": "lz4", "zstd": "zstd", None: "none"}[inner]
    chains = _chains(ckpt / "0" / "items")
    assert len(chains) > 5
    for name, (data_type, chain) in chains.items():
        names = [codec["name"] for codec in chain]
        assert names == ["bytes"] + ([inner] if inner else []) + ["crc32c"], name
        if inner == "blosc":  # bit planes of the stored width
            assert chain[1]["configuration"]["typesize"] == np.dtype(getattr(ml_dtypes, data_type, data_type)).itemsize
    if inner == "blosc":
        assert {data_type for data_type, _ in chains.values()} == {"bfloat16"}
    checked = run_cli("verify", str(src), str(ckpt), "--progress", "none")
    assert checked.returncode == 0 and "verify: OK" in checked.stdout, checked.stdout + checked.stderr


def test_an_unknown_codec_is_refused_before_anything_is_written(synth_dir, tmp_path):
    src, ckpt = synth_dir(), tmp_path / "ckpt"
    refused = run_cli("convert", str(src), str(ckpt), "--compression", "gzip")
    assert refused.returncode == 2 and "--compression" in refused.stderr and "lz4" in refused.stderr
    assert not ckpt.exists()


def test_a_rerun_with_another_compressing_codec_skips_and_raw_bytes_are_refused(synth_dir, tmp_path):
    """The values do not depend on the codec: a checkpoint written with lz4 is complete for a rerun under the
    default (zstd for this small model), as a nightly zoo reruns whatever codec a default names; raw bytes are another request, refused
    without --overwrite as before."""
    src, ckpt = synth_dir(), tmp_path / "ckpt"
    assert run_cli("convert", str(src), str(ckpt), "--devices", "4", "--progress", "none",
                   "--compression", "lz4").returncode == 0
    again = run_cli("convert", str(src), str(ckpt), "--devices", "4", "--progress", "none",
                    "--report", str(tmp_path / "again.json"))
    assert again.returncode == 0, again.stderr
    report = json.loads((tmp_path / "again.json").read_text())
    assert report["skipped"] and report["compression"] == "lz4"
    raw = run_cli("convert", str(src), str(ckpt), "--devices", "4", "--progress", "none", "--no-compression")
    assert raw.returncode != 0 and "--overwrite" in raw.stderr


def test_the_library_refuses_an_unknown_codec_as_bad_input(synth_dir, tmp_path):
    from ckptconv.commands.convert import ConvertRequest, convert
    from ckptconv.errors import BadInputError

    with pytest.raises(BadInputError, match="compression 'gzip': expected one of lz4, zstd, none"):
        convert(ConvertRequest(str(synth_dir()), str(tmp_path / "ckpt"), devices=1, compression="gzip"))
    assert not (tmp_path / "ckpt").exists()
