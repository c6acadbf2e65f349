"""Absurd configs are refused at once: the plan's cost follows the headers, not the config.

A config claiming 10^9 layers, 10^9 experts or a 10^7 hidden size, numbers beyond float range,
NaN/Infinity, or nesting thousands deep gets one line (exit 2) in well under a second and a
few MB, never a traceback. Run with ``-s`` to see the timings.
"""

from __future__ import annotations

import json
import re
import resource
import time

import pytest

from ckptconv.commands import synth
from ckptconv.errors import BadInputError
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli

BIG = "1" + "0" * 400
MODELS = {
    "qwen3": synth.SynthModel(num_layers=2),
    "qwen3_moe": synth.SynthModel(model_type="qwen3_moe", num_layers=2, num_experts=4, moe_intermediate_size=32),
    "gemma3": synth.SynthModel(model_type="gemma3_text", num_layers=2, head_dim=16),
}
# (model, field, raw JSON value, what the one-line message says)
CASES = {
    "1e9 layers": ("qwen3", "num_hidden_layers", "1000000000", "claims 1000000000 layers"),
    "1e7 hidden": ("qwen3", "hidden_size", "10000000", "config.json implies"),
    "1e7 vocab": ("qwen3", "vocab_size", "10000000", "config.json implies"),
    "2^63 heads": ("qwen3", "num_attention_heads", str(2**63), "must be an integer >= 1 (and < 2**63)"),
    "1e400 layers": ("qwen3", "num_hidden_layers", BIG, "number out of range"),
    "5000-digit hidden": ("qwen3", "hidden_size", "9" * 5000, "number out of range"),
    "1e400 rope_theta": ("qwen3", "rope_theta", "1e400", "number out of range"),
    "NaN eps": ("qwen3", "rms_norm_eps", "NaN", "NaN is not a JSON number"),
    "Infinity theta": ("qwen3", "rope_theta", "Infinity", "Infinity is not a JSON number"),
    "-Infinity eps": ("qwen3", "rms_norm_eps", "-Infinity", "-Infinity is not a JSON number"),
    "nested 200": ("qwen3", "rope_scaling", '{"a":' * 200 + "null" + "}" * 200, "nested deeper than 127"),
    "nested 100000": ("qwen3", "rope_scaling", "[" * 100_000 + "]" * 100_000, "nested deeper than 127"),
    "1e9 experts": ("qwen3_moe", "num_experts", "1000000000", "implies 6000000020 tensors"),
    "1e9 layers, MoE": ("qwen3_moe", "num_hidden_layers", "1000000000", "claims 1000000000 layers"),
    "1e9 layers with layer_types": ("gemma3", "num_hidden_layers", "1000000000",
                                    "layer_types"),  # 2 entries given below: compared, not expanded
}
TIMINGS: dict[str, float] = {}


def with_field(text: str, field: str, raw: str) -> str:
    """``config.json`` text with ``field`` set to the raw JSON ``raw`` (added if absent)."""
    config = json.loads(text)
    config[field] = "@@RAW@@"
    if config.get("model_type") == "gemma3_text":
        config["layer_types"] = ["sliding_attention", "sliding_attention"]
    return json.dumps(config).replace('"@@RAW@@"', raw)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", CASES)
def test_absurd_config_is_refused_fast_in_one_line(synth_dir, case):
    model, field, raw, message = CASES[case]
    src = synth_dir(MODELS[model])
    config = (src / "config.json").read_text()
    (src / "config.json").write_text(with_field(config, field, raw))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(BadInputError) as caught:
        make_plan(LocalSource(str(src)), devices=1)
    TIMINGS[case] = seconds = time.perf_counter() - start
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    text = str(caught.value)
    print(f"\n  {case:30s} refused in {seconds * 1000:6.1f} ms: {text[:110]}")
    assert message in text and "\n" not in text and len(text) < 400, text
    assert seconds < 0.5 and grown_mib < 64, (seconds, grown_mib)


def test_absurd_config_via_cli_and_strict_json_output(synth_dir):
    src = synth_dir(MODELS["qwen3"])
    good = run_cli("plan", str(src), "--devices", "1", "--json", timeout=120)
    assert good.returncode == 0, good.stderr
    json.loads(good.stdout, parse_constant=lambda name: pytest.fail(f"{name} in the plan's JSON"))
    config = (src / "config.json").read_text()
    (src / "config.json").write_text(with_field(config, "num_hidden_layers", "1000000000"))
    start = time.perf_counter()
    result = run_cli("plan", str(src), "--json", timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert re.search(r"config.json: claims 1000000000 layers, but the safetensors headers hold only \d+ tensors",
                     result.stderr)
    assert time.perf_counter() - start < 30  # the process's start-up included, on a loaded machine
