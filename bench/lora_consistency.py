"""Which adapter layout agrees with MaxText's own merged mode? (bench only; ckptconv's venv.)

    .venv/bin/python bench/lora_consistency.py BASE_CKPT MERGED_CKPT SCALING ADAPTER_CKPT [ADAPTER_CKPT...]

For every kernel an adapter checkpoint has LoRA leaves for, ``W + SCALING * (kernel_lora_a @ kernel_lora_b)`` (per
layer, float32, reshaped to the kernel's shape) is compared with the merged checkpoint's kernel. MaxText's model
adds ``x @ lora_a @ lora_b * alpha/r`` to ``x @ kernel`` at run time (qwix), so an adapter checkpoint is right for
a MaxText model exactly when this sum is the merged kernel (up to bfloat16 rounding). Prints, per adapter and
kernel, the largest difference in units of the largest |delta| (about 0.01 for bfloat16 rounding; about 1 when a
factor is missing). Unscanned checkpoints (``layers_{i}``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_convert import restore  # noqa: E402


def main() -> None:
    base_dir, merged_dir, scaling, *adapters = sys.argv[1:]
    base, merged = restore(Path(base_dir).resolve()), restore(Path(merged_dir).resolve())
    for adapter_dir in adapters:
        leaves = restore(Path(adapter_dir).resolve())
        result = {}
        for name in sorted(n for n in leaves if n.endswith("kernel_lora_a/value")):
            kernel = name.removesuffix("_lora_a/value")
            a = leaves[name].astype(np.float32)
            b = leaves[kernel + "_lora_b/value"].astype(np.float32)
            w = base[kernel].astype(np.float32)
            delta = (a @ b * np.float32(scaling)).reshape(w.shape)
            error = np.abs(w + delta - merged[kernel].astype(np.float32)).max()
            result[kernel.removeprefix("params/params/decoder/")] = round(float(error / np.abs(delta).max()), 4)
        print(json.dumps({"adapter": adapter_dir, "max |W + s A B - merged| / max |s A B|": result}))


if __name__ == "__main__":
    main()
