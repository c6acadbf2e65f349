"""Make a tiny random checkpoint with transformers' own model class (bench only; MaxText's venv has transformers).

    <maxtext-venv>/bin/python bench/hf_tiny.py CONFIG_JSON OUT_DIR [--seed N]

``CONFIG_JSON`` is a ``config.json`` (e.g. one ``ckptconv.commands.synth`` writes, in the hub's form);
transformers builds the model from it (``AutoConfig.for_model``, ``AutoModelForCausalLM.from_config``, or for a
multimodal wrapper AutoModelForCausalLM does not build, Qwen3-VL's and Qwen3-Omni's, the class its ``architectures``
names, vision and audio towers included; Qwen3-Omni's logits are its thinker's),
its random weights rounded to bfloat16 (so a bfloat16 file holds them exactly and a float32
reference agrees with any bf16 or f32 conversion), and ``save_pretrained`` writes what transformers
writes: its own ``config.json`` and tensor names. Beside them, ``hf_logits.npy``: the model's float32
logits on ``TOKENS`` (``hf_tokens.npy``), the reference for MaxText's forward pass.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOKENS = [3, 17, 101, 42, 7, 200, 9, 64, 5, 33, 250, 11]


# transformers 5 holds these fused experts as (experts, 2 * mlp, emb) / (experts, emb, mlp) and save_pretrained
# writes that; the releases (and MaxText's converter) have (experts, emb, 2 * mlp) / (experts, mlp, emb)
HUB_EXPERTS_TRANSPOSED = {"qwen3_vl_moe": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
# transformers 5.25 saves Gemma 4's global layer sizes as ``per_layer_config``; the releases' config.json (and
# ckptconv's reader) spell them ``global_head_dim`` / ``num_global_key_value_heads``: the input config is kept
HUB_CONFIG_KEPT = ("gemma4",)
# model types AutoModelForCausalLM would build without their multimodal wrapper: the class architectures names
WRAPPED = ("gemma4",)


def hub_expert_layout(out: Path) -> None:
    """Rewrite the saved files with the fused experts in the releases' layout (their last two axes swapped)."""
    from safetensors.torch import load_file, save_file

    model_type = json.loads((out / "config.json").read_text())["model_type"]
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        for name in tensors:
            if name.endswith(HUB_EXPERTS_TRANSPOSED[model_type]):
                tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, str(path), metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--class", dest="cls", help="the transformers model class (default: AutoModelForCausalLM's "
                        "choice), e.g. Llama4ForConditionalGeneration for the hub's multimodal wrapper")
    args = parser.parse_args()
    import numpy as np
    import torch
    import transformers

    fields = json.loads(Path(args.config).read_text())
    config = transformers.AutoConfig.for_model(**fields)
    torch.manual_seed(args.seed)
    if args.cls or fields["model_type"] in WRAPPED:
        args.cls = args.cls or fields["architectures"][0]
        model = getattr(transformers, args.cls)(config).to(torch.float32).eval()
    else:
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        except ValueError:  # a multimodal wrapper (Qwen3-VL, Qwen3-Omni): its own class, from config.json's architectures
            model = getattr(transformers, fields["architectures"][0])._from_config(config, dtype=torch.float32).eval()
    text = config.get_text_config()
    with torch.no_grad():
        for tensor in list(model.parameters()):
            noise = torch.randn(tensor.shape) * (0.05 if tensor.ndim > 1 else 0.1)
            tensor.copy_((tensor + noise if tensor.ndim == 1 else noise).to(torch.bfloat16).to(torch.float32))
        for name, buffer in model.named_buffers():  # Gemma 4's per-layer output scale: not 1, so a lost one shows
            if name.endswith("layer_scalar"):
                buffer.copy_((buffer + torch.rand(buffer.shape) * 0.5).to(torch.bfloat16).to(torch.float32))
            if name.endswith(("std_scale", "std_bias")):  # Gemma 4's tower standardisation: not (1, 0), likewise
                buffer.copy_((buffer + torch.randn(buffer.shape) * 0.1).to(torch.bfloat16).to(torch.float32))
        tokens = [t % text.vocab_size for t in TOKENS]
        logits = getattr(model, "thinker", model)(torch.tensor([tokens])).logits[0].numpy()  # Omni: the thinker's
    out = Path(args.out)
    model.to(torch.bfloat16).save_pretrained(str(out))
    if fields["model_type"] in HUB_EXPERTS_TRANSPOSED:
        hub_expert_layout(out)
    if fields["model_type"] in HUB_CONFIG_KEPT:
        (out / "config.json").write_text(json.dumps(fields, indent=2))
    np.save(out / "hf_logits.npy", logits)
    np.save(out / "hf_tokens.npy", np.asarray(tokens, np.int32))
    print(json.dumps({"class": type(model).__name__, "tensors": len(model.state_dict()),
                      "max_abs_logit": float(np.abs(logits).max())}))


if __name__ == "__main__":
    main()
