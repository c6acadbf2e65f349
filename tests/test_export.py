"""``export``: HF -> MaxText -> HF gives back the source, bit for bit, for every family, scanned or not.

The conversions run in this process (fast); the CLI runs where its exit status or a fresh
process's memory figure is what is tested. Exported files are read with the reference
safetensors reader, and ``transformers`` loads one exported directory.

Through a bfloat16 MaxText checkpoint every step is exact except Gemma's ``1 + w`` norms: the
sum is rounded to bfloat16 in the checkpoint (MaxText's converter does the same), so those
norms come back within one bfloat16 step; through a float32 checkpoint Gemma is exact too.
The models are every family's own round-trip examples (``Family.synthetic.round_trip``), so a family
added to the registry is round-tripped here without touching this file.
"""

import glob
import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from ckptconv.commands import synth
from ckptconv.families import olmo3
from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.commands.export import PENDING, ExportRequest, export
from ckptconv.errors import BadInputError, DestinationExistsError
from ckptconv.families import FAMILIES
from tests.conftest import run_cli
from tests.test_families import unscanned_only

MiB = 2**20
MOE = {"num_experts": 4, "moe_intermediate_size": 32}
# Every family's round-trip examples (Family.synthetic.round_trip), by name: a new family brings its own.
EXAMPLES = {example.name: (family, example) for family in FAMILIES for example in family.synthetic.round_trip}
MODELS = {name: synth.for_example(family, example) for name, (family, example) in EXAMPLES.items()}
ROUNDED = {name: example.rounded for name, (_, example) in EXAMPLES.items() if example.rounded}


@pytest.fixture(autouse=True, scope="module")
def jax_with_16_devices():
    """Start JAX with conftest's 16 devices before an in-process conversion with ``devices=1`` would
    set XLA_FLAGS to 1 for the rest of the session."""
    import jax

    assert jax.device_count() == 16


def hf_tensors(directory) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def round_trip(tmp_path, model: synth.SynthModel, scan: bool, dtype: str = "bfloat16", devices: int = 1,
               multimodal: bool = False, **options) -> tuple:
    src, mt, hf = tmp_path / "src", tmp_path / "maxtext", tmp_path / "hf"
    synth.write_checkpoint(model, str(src))
    convert(ConvertRequest(str(src), str(mt), devices=devices, scan_layers=scan, dtype=dtype, progress="none",
                           multimodal=multimodal))
    report = export(ExportRequest(str(mt), str(hf), like=str(src), progress="none", **options))
    return src, mt, hf, report


def assert_same(source: dict, exported: dict, close: tuple[str, ...] = ()) -> None:
    """Bit for bit, except the names in ``close`` (within one bfloat16 step)."""
    assert sorted(exported) == sorted(source)
    for name, want in source.items():
        got = exported[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        if name.endswith(close) and close:
            step = np.abs(want.astype(np.float32)) * 2.0**-7
            assert (np.abs(got.astype(np.float32) - want.astype(np.float32)) <= step).all(), name
        else:
            assert got.tobytes() == want.tobytes(), name


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "noscan"])
@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_identical(tmp_path, name, scan):
    model, example = MODELS[name], EXAMPLES[name][1]
    layout = {"devices": example.devices, "multimodal": example.multimodal}
    if scan and unscanned_only(model, example.multimodal):  # MaxText runs it unscanned only: refused scanned
        with pytest.raises(BadInputError, match="unscanned only"):
            round_trip(tmp_path, model, scan, **layout)
        assert not (tmp_path / "maxtext").exists()
        return
    src, mt, hf, report = round_trip(tmp_path, model, scan, **layout)
    assert_same(load_file(str(src / "model.safetensors")), hf_tensors(hf), ROUNDED.get(name, ()))
    assert report["scan_layers"] is scan and report["status"] == "complete"
    written = json.loads((mt / "ckptconv-report.json").read_text())
    assert written["multimodal"] is example.multimodal
    assert written["not_converted"] == [] or not example.multimodal  # with --multimodal every tensor is converted
    assert json.loads((hf / "config.json").read_text()) == model.config()
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf_tensors(hf))
    assert not (hf / PENDING).exists()


@pytest.mark.parametrize("name", ROUNDED)
def test_rounded_round_trip_through_float32_is_bit_identical(tmp_path, name):
    src, _, hf, _ = round_trip(tmp_path, MODELS[name], scan=True, dtype="float32",
                               multimodal=EXAMPLES[name][1].multimodal)
    assert_same(load_file(str(src / "model.safetensors")), hf_tensors(hf))


def test_tied_embeddings_export_no_head_and_transformers_gives_the_source_logits(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = synth.SynthModel(model_type="qwen3", num_layers=3)
    src, mt, hf = tmp_path / "src", tmp_path / "maxtext", tmp_path / "hf"
    synth.write_checkpoint(model, str(src))
    convert(ConvertRequest(str(src), str(mt), devices=1, progress="none"))
    (src / "tokenizer_config.json").write_text('{"model_max_length": 4096}\n')
    result = run_cli("export", str(mt / "0" / "items"), str(hf), "--like", str(src), "--progress", "none")
    assert result.returncode == 0, result.stderr
    assert "exported" in result.stdout and (hf / "tokenizer_config.json").read_text() == '{"model_max_length": 4096}\n'
    assert "lm_head.weight" not in hf_tensors(hf)
    tokens = torch.tensor([[1, 7, 42, 300, 511, 2]])
    logits = []
    for directory in (src, hf):
        loaded = AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(loaded(tokens).logits.numpy())
    np.testing.assert_array_equal(logits[1], logits[0])


def test_shape_mismatch_with_like_exits_2_and_writes_nothing(tmp_path):
    src, mt, hf = tmp_path / "src", tmp_path / "maxtext", tmp_path / "hf"
    synth.write_checkpoint(synth.SynthModel(), str(src))
    convert(ConvertRequest(str(src), str(mt), devices=1, progress="none"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(synth.SynthModel(intermediate_size=96).config()))
    result = run_cli("export", str(mt), str(hf), "--like", str(other), "--progress", "none")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "mlp/wi_0/kernel" in result.stderr and "[64, 2, 96]" in result.stderr
    assert not hf.exists()
    with pytest.raises(BadInputError, match="missing leaf 'params/params/decoder/logits_dense/kernel'"):
        (other / "config.json").write_text(json.dumps(synth.SynthModel("llama", tie_word_embeddings=False).config()))
        export(ExportRequest(str(mt), str(hf), like=str(other), progress="none"))
    assert not hf.exists()


def crash_after_two_files(monkeypatch) -> list[str]:
    """The export fails (a full disk) when it would close its third file; returns the names closed."""
    from ckptconv.write import safetensors as safetensors_writer

    real_close, closed = safetensors_writer.StreamedFile.close, []

    def close_twice(self):
        if len(closed) == 2:
            raise OSError("disk full (simulated)")
        real_close(self)
        closed.append(self.layout.name)

    # class-level, and owned: the callers undo it right after their one export(), which closes its files on
    # the calling thread (the export starts no thread that could outlive it)
    monkeypatch.setattr(safetensors_writer.StreamedFile, "close", close_twice)
    return closed


def test_shards_index_rerun_resume_and_foreign_destination(tmp_path, monkeypatch):
    model = synth.SynthModel(num_layers=4)
    src, mt, hf, report = round_trip(tmp_path, model, scan=True, shard_size="40KB")
    files = report["files"]
    assert len(files) > 3 and sorted(os.listdir(hf)) == sorted(
        [*files, "config.json", "model.safetensors.index.json", "ckptconv-report.json"])
    weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    for file in files:  # data up to the limit, plus the header; a larger tensor (the embedding) alone
        together = [name for name, f in weight_map.items() if f == file]
        assert len(together) == 1 or os.path.getsize(hf / file) < 40_000 + 4096, file
    assert export(ExportRequest(str(mt), str(hf), like=str(src), progress="none", shard_size="40KB"))["skipped"]
    with pytest.raises(DestinationExistsError, match="other options"):
        export(ExportRequest(str(mt), str(hf), like=str(src), progress="none"))
    replaced = export(ExportRequest(str(mt), str(hf), like=str(src), progress="none", overwrite=True))
    assert sorted(os.listdir(hf)) == sorted(
        [*replaced["files"], "config.json", "model.safetensors.index.json", "ckptconv-report.json"])

    # A crash after two files: the rerun keeps them (same inode) and writes the rest.
    crashed = tmp_path / "crashed"
    closed = crash_after_two_files(monkeypatch)
    with pytest.raises(OSError):
        export(ExportRequest(str(mt), str(crashed), like=str(src), progress="none", shard_size="40KB"))
    monkeypatch.undo()
    assert json.loads((crashed / "ckptconv-report.json").read_text())["status"] == "writing"
    kept = {name: os.stat(crashed / PENDING / name).st_ino for name in closed}
    again = export(ExportRequest(str(mt), str(crashed), like=str(src), progress="none", shard_size="40KB"))
    assert again["status"] == "complete" and {name: os.stat(crashed / name).st_ino for name in closed} == kept
    assert_same(load_file(str(src / "model.safetensors")), hf_tensors(crashed))

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DestinationExistsError):
        export(ExportRequest(str(mt), str(foreign), like=str(src), progress="none"))


def test_overwrite_keeps_the_old_export_complete_until_the_new_one_is_whole(tmp_path, monkeypatch):
    """--overwrite writes the new files beside the old export: a crash before the commit leaves the old
    one complete and loadable (its report still says so), and the rerun resumes the new files."""
    src, mt, hf, old = round_trip(tmp_path, synth.SynthModel(num_layers=4), scan=True, shard_size="40KB")
    closed = crash_after_two_files(monkeypatch)
    with pytest.raises(OSError):
        export(ExportRequest(str(mt), str(hf), like=str(src), progress="none", shard_size="60KB", overwrite=True))
    monkeypatch.undo()
    report = json.loads((hf / "ckptconv-report.json").read_text())
    assert report["status"] == "complete" and report["fingerprint"] == old["fingerprint"]
    assert sorted(name for name in os.listdir(hf) if name.endswith(".safetensors")) == sorted(old["files"])
    assert_same(load_file(str(src / "model.safetensors")), hf_tensors(hf))
    kept = {name: os.stat(hf / PENDING / name).st_ino for name in closed}

    new = export(ExportRequest(str(mt), str(hf), like=str(src), progress="none", shard_size="60KB", overwrite=True))
    assert new["status"] == "complete" and new["files"] != old["files"]
    assert {name: os.stat(hf / name).st_ino for name in closed} == kept  # resumed, not rewritten
    assert sorted(os.listdir(hf)) == sorted([*new["files"], "config.json", "model.safetensors.index.json",
                                             "ckptconv-report.json"])
    assert_same(load_file(str(src / "model.safetensors")), hf_tensors(hf))


def test_a_destination_another_run_holds_is_refused_and_left_as_it_was(tmp_path):
    """The export takes the destination's lock as convert does (a file the filesystem arbitrates)."""
    from ckptconv.errors import CkptConvError
    from ckptconv.write import lock

    src, mt, hf, old = round_trip(tmp_path, synth.SynthModel(), scan=True)
    before = {name: (hf / name).read_bytes() for name in os.listdir(hf)}
    with lock.hold(str(hf)):  # a live holder on this host
        with pytest.raises(CkptConvError, match="ckptconv.lock: another conversion .* is writing this destination"):
            export(ExportRequest(str(mt), str(hf), like=str(src), progress="none", dtype="float32", overwrite=True))
        assert {name: (hf / name).read_bytes() for name in os.listdir(hf) if name != lock.LOCK_NAME} == before
    assert export(ExportRequest(str(mt), str(hf), like=str(src), progress="none", dtype="float32",
                                overwrite=True))["status"] == "complete"
    assert lock.LOCK_NAME not in os.listdir(hf)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32"])
def test_fp8_release_exports_dequantised_bfloat16(tmp_path, model_type):
    """An FP8 release (DeepSeek-V3; V3.2 with its FP8 indexer) exports as bfloat16: every tensor bit for bit the
    source dequantised as MaxText's deepseek_dequantize does (weight x its block scale, rounded to bfloat16)."""
    from ckptconv.commands.verification import verify
    from tests.test_quantized import dequantized

    model = synth.SynthModel(model_type=model_type, num_layers=2, vocab_size=256, hidden_size=128,
                             intermediate_size=256, quantization="fp8", **MOE)
    src, mt, hf, report = round_trip(tmp_path, model, scan=True)
    assert_same(dequantized(src), hf_tensors(hf))
    config = json.loads((hf / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert any("exported dequantised" in note["what"] for note in report["not_exported"])
    tensors = hf_tensors(hf)
    assert {t.dtype for t in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert not any(name.endswith("_scale_inv") for name in tensors)
    result = verify(str(hf), str(mt))  # the checkpoint is exactly what the exported model converts to
    assert result.ok, result.mismatches[:3]


@pytest.mark.slow
def test_export_peak_rss_does_not_grow_with_layers(tmp_path):
    def model(layers):
        return synth.SynthModel(vocab_size=8192, hidden_size=1024, num_layers=layers, num_heads=8, num_kv_heads=4,
                                head_dim=128, intermediate_size=4096)

    peaks = {}
    for layers in (3, 12):
        src, mt = tmp_path / f"src{layers}", tmp_path / f"mt{layers}"
        synth.write_checkpoint(model(layers), str(src), fast=True)
        convert(ConvertRequest(str(src), str(mt), devices=16, progress="none", compression="none"))
        for workers in (1, 3):  # with several (issue 38): still flat in the layers, and under its prediction
            hf = tmp_path / f"hf{layers}-{workers}"
            result = run_cli("export", str(mt), str(hf), "--like", str(src), "--progress", "none", "--shard-size",
                             "200MB", "--workers", str(workers))
            assert result.returncode == 0, result.stderr
            report = json.loads((hf / "ckptconv-report.json").read_text())
            peaks[layers, workers] = report["peak_rss_bytes"]
            print(f"export of {layers} layers ({report['output_bytes'] / MiB:.0f} MiB), {workers} workers: peak "
                  f"{peaks[layers, workers] / MiB:.0f} of {report['predicted_peak_rss_bytes'] / MiB:.0f} MiB "
                  f"predicted, {report['wall_seconds']:.1f} s")
            assert report["output_bytes"] > (layers * 30 * MiB)
            assert report["workers"] == workers and report["peak_rss_bytes"] <= report["predicted_peak_rss_bytes"]
    for workers in (1, 3):
        assert peaks[12, workers] <= peaks[3, workers] + 64 * MiB, {k: v / MiB for k, v in peaks.items()}


def test_olmo3_saved_by_transformers_round_trips_bit_identical(tmp_path):
    """An OLMo 3 made by transformers' own Olmo3ForCausalLM and save_pretrained (its transformers-5 config.json:
    ``rope_parameters`` per layer type, YaRN on the full layers) converts and exports back bit for bit."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Olmo3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                      max_position_embeddings=65536, rope_theta=500000.0,
                                      rope_scaling=dict(olmo3.YARN))
    src, mt, hf = tmp_path / "src", tmp_path / "maxtext", tmp_path / "hf"
    transformers.Olmo3ForCausalLM(config).to(torch.bfloat16).save_pretrained(str(src))
    assert "full_attention" in json.loads((src / "config.json").read_text())["rope_parameters"]
    for scan in (True, False):
        convert(ConvertRequest(str(src), str(mt), devices=16 if scan else 1, scan_layers=scan, progress="none",
                               overwrite=True))
        export(ExportRequest(str(mt), str(hf), like=str(src), progress="none", overwrite=True))
        assert_same(load_file(str(src / "model.safetensors")), hf_tensors(hf))


def _files(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())
            if path.suffix in (".safetensors", ".json") and path.name != "ckptconv-report.json"}


@pytest.mark.parametrize("name", ["qwen3", "qwen3_next", "deepseek_v3", "gemma4-26b-a4b-tiny"])
def test_several_workers_export_the_same_files(tmp_path, name):
    """Reads turned back into HF tensors by 4 workers at once (issue 38), written in the plan's order: the same
    files, byte for byte, as one worker's (Qwen3-Next: fused rows written back as their parts, one read each)."""
    from ckptconv import host

    model, example = MODELS[name], EXAMPLES[name][1]
    scan = not unscanned_only(model, example.multimodal)
    src, mt, one, report = round_trip(tmp_path, model, scan, devices=example.devices, multimodal=example.multimodal,
                                      shard_size="20KB", options=host.run_options(workers=1))
    four = export(ExportRequest(str(mt), str(tmp_path / "four"), like=str(src), progress="none", shard_size="20KB",
                                options=host.run_options(workers=4)))
    assert (report["workers"], four["workers"]) == (1, 4), four["workers_why"]
    assert len([f for f in _files(one) if f.endswith(".safetensors")]) > 1  # several files, in order
    assert _files(one) == _files(tmp_path / "four")


def test_several_workers_export_stacked_experts_as_one(tmp_path):
    """Qwen3.5's FP8 release kept e4m3: its fused experts go back one expert a read; 1 and 3 workers, the same files."""
    pytest.importorskip("torch")
    from tests import hub_checkpoints

    src, dst = tmp_path / "hf", tmp_path / "dst"
    hub_checkpoints.make_fp8(str(src), hub_checkpoints.qwen3_5_moe_fp8_config(num_hidden_layers=4))
    done = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", "--dtype", "float8_e4m3fn")
    assert done.returncode == 0, done.stderr
    for workers in ("1", "3"):
        done = run_cli("export", str(dst), str(tmp_path / workers), "--like", str(src), "--progress", "none",
                       "--workers", workers)
        assert done.returncode == 0, done.stderr
    assert _files(tmp_path / "1") == _files(tmp_path / "3")


def test_a_sandboxed_export_counts_the_heap_it_keeps(tmp_path):
    """On a kernel without VmHWM (gVisor) export sets glibc's 64 MiB mmap threshold as convert does (``tune_malloc``):
    the freed read buffers its heap keeps resident are in the prediction, as convert's estimate counts them."""
    from ckptconv import settings
    from ckptconv.plan import estimate
    from ckptconv.plan.export import make_export_plan, predicted_peak_bytes
    from ckptconv.read import open_source
    from ckptconv.read.stored import read_metadata

    synth.write_checkpoint(synth.SynthModel(), str(tmp_path / "src"))
    done = run_cli("convert", str(tmp_path / "src"), str(tmp_path / "mt"), "--progress", "none")
    assert done.returncode == 0, done.stderr
    plan = make_export_plan(open_source(str(tmp_path / "src")), read_metadata(str(tmp_path / "mt"))[0])
    for workers in (1, 3):
        reads = predicted_peak_bytes(plan, settings.RunOptions(workers=workers)) - estimate.BASELINE_BYTES
        sandboxed = predicted_peak_bytes(plan, settings.RunOptions(workers=workers, sandboxed=True))
        assert reads > 0 and sandboxed - estimate.BASELINE_SANDBOX_BYTES == reads + int(
            reads * estimate.SANDBOX_HEAP_SHARE), (workers, reads, sandboxed)
