"""The converted weights give the HF model's logits: a RoPE, scaling or layout mistake fails here.

HF side: ``transformers`` loads the synthetic checkpoint (float32, CPU). MaxText side: the
checkpoint is restored with Orbax and run through ``tests/maxtext_forward.py``.
"""

import numpy as np
import pytest

from ckptconv import synth
from tests import maxtext_forward
from tests.conftest import run_cli
from tests.test_convert import LLAMA31_ROPE, restore

CASES = [
    ("qwen3", True, True, {}),
    ("qwen2", False, False, {}),
    ("llama", False, True, {"rope_scaling": LLAMA31_ROPE}),  # Llama 3.1+: interleaved RoPE, scaled q
    ("llama", True, True, {}),  # Llama 2/3.0: half-split RoPE, scaled q, tied (like Llama 3.2 1B)
    ("mistral", False, True, {}),
]


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


@pytest.mark.parametrize("model_type, tied, scan, extra", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_logits_match_hf(tmp_path, synth_dir, model_type, tied, scan, extra):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = synth.SynthModel(model_type=model_type, tie_word_embeddings=tied, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, hidden_size=64, config_overrides=extra)
    src, dst = synth_dir(model), tmp_path / "dst"
    flags = ["--devices", "4", "--dtype", "float32", "--scan-layers" if scan else "--no-scan-layers"]
    assert run_cli("convert", str(src), str(dst), "--progress", "none", *flags).returncode == 0

    tokens = np.random.default_rng(3).integers(0, model.vocab_size, size=12)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    hf_model.eval()
    with torch.no_grad():
        expected = hf_model(torch.tensor(tokens[None])).logits[0].numpy()

    params = unflatten(restore(dst))["params"]["params"]
    config = model.config()
    got = maxtext_forward.forward(
        params, tokens, family=model_type, num_layers=model.num_layers, eps=config["rms_norm_eps"],
        theta=config["rope_theta"], rope_scaling=config.get("rope_scaling"),
        interleaved=model_type == "llama" and bool(extra), scan=scan)
    assert np.abs(expected).max() > 1e-3  # a real signal, not zeros
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)
