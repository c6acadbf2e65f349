"""Make a tiny random checkpoint with transformers' own model class (bench only; MaxText's venv has transformers).

    <maxtext-venv>/bin/python bench/hf_tiny.py CONFIG_JSON OUT_DIR [--seed N]

``CONFIG_JSON`` is a ``config.json`` (e.g. one ``ckptconv.commands.synth`` writes, in the hub's form);
transformers builds the model from it (``AutoConfig.for_model``, ``AutoModelForCausalLM.from_config``),
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
    if args.cls:
        model = getattr(transformers, args.cls)(config).to(torch.float32).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for tensor in list(model.parameters()):
            noise = torch.randn(tensor.shape) * (0.05 if tensor.ndim > 1 else 0.1)
            tensor.copy_((tensor + noise if tensor.ndim == 1 else noise).to(torch.bfloat16).to(torch.float32))
        tokens = [t % config.get_text_config().vocab_size for t in TOKENS]
        logits = model(torch.tensor([tokens])).logits[0].numpy()
    out = Path(args.out)
    model.to(torch.bfloat16).save_pretrained(str(out))
    np.save(out / "hf_logits.npy", logits)
    np.save(out / "hf_tokens.npy", np.asarray(tokens, np.int32))
    print(json.dumps({"class": type(model).__name__, "tensors": len(model.state_dict()),
                      "max_abs_logit": float(np.abs(logits).max())}))


if __name__ == "__main__":
    main()
