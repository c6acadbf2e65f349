"""MaxText's own dequantisers, run on the CPU (bench only; MaxText's venv): the first step of its route.

    <maxtext-venv>/bin/python bench/maxtext_dequantize.py fp8|mxfp4 HF_DIR OUT_DIR

fp8: ``standalone_scripts/deepseek_dequantize.py``'s ``convert_model`` as is (it runs on the CPU).
mxfp4: ``standalone_scripts/dequantize_mxfp4.py``'s ``dequantize_mxfp4`` and the same loop its
``main`` runs (dequantise each ``*_blocks`` with its ``*_scales``, swap the last two axes, drop the
scales, cast the rest to bfloat16), with tensors on the CPU: its ``main`` loads them onto CUDA.
``config.json`` is copied beside the result.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main() -> None:
    kind, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    if kind == "fp8":
        from maxtext.checkpoint_conversion.standalone_scripts import deepseek_dequantize

        deepseek_dequantize.convert_model(str(src), str(out))
    else:
        import torch
        from maxtext.checkpoint_conversion.standalone_scripts.dequantize_mxfp4 import dequantize_mxfp4
        from safetensors.torch import load_file, save_file

        weight_map = {}
        for file in sorted(src.glob("*.safetensors")):
            tensors = load_file(str(file))
            result = {}
            for name, tensor in tensors.items():
                if name.endswith("_blocks"):
                    base = name.removesuffix("_blocks")
                    value = dequantize_mxfp4(tensor, tensors[base + "_scales"], torch.bfloat16)
                    result[base] = value.permute(0, 2, 1).contiguous()
                elif not name.endswith("_scales"):
                    result[name] = tensor.to(torch.bfloat16)
            save_file(result, str(out / file.name))
            weight_map.update({name: file.name for name in result})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(src / "config.json", out / "config.json")


if __name__ == "__main__":
    main()
