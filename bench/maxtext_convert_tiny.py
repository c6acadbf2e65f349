"""Run MaxText 0.2.5's own ``to_maxtext`` on a tiny checkpoint of a real family (bench only; MaxText's venv).

    <maxtext-venv>/bin/python bench/maxtext_convert_tiny.py MODEL_NAME HF_DIR OUT_DIR [MAXTEXT_OVERRIDES...] -- [to_maxtext flags]

MaxText's converter takes the HF architecture from a built-in table keyed by ``model_name``
(``HF_MODEL_CONFIGS``), so a 2-layer model of a family it supports fails there. This runner puts
the checkpoint's own ``config.json`` into that table for ``MODEL_NAME``, passes the sizes as
MaxText overrides (``override_model_config=True``), and then runs ``to_maxtext`` exactly as its
``__main__`` does. Nothing else of MaxText is changed.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    model_name, hf_dir, out_dir, *rest = sys.argv[1:]
    overrides, flags = (rest[: rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    import maxtext
    import transformers
    from maxtext.checkpoint_conversion.utils import hf_model_configs

    hf_model_configs.HF_MODEL_CONFIGS[model_name] = transformers.AutoConfig.from_pretrained(hf_dir)
    if model_name.startswith(("deepseek3", "kimi-k2")):
        _router_bias_in_its_collection(model_name)
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    sys.argv = ["to_maxtext", base, f"model_name={model_name}", f"hf_model_path={hf_dir}",
                f"base_output_directory={out_dir}", "hardware=cpu", "skip_jax_distributed_system=True",
                "override_model_config=True", f"run_name=tiny-{model_name}", *overrides, *flags]
    runpy.run_module("maxtext.checkpoint_conversion.to_maxtext", run_name="__main__", alter_sys=True)


def _router_bias_in_its_collection(model_name: str) -> None:
    """MaxText 0.2.5's DeepSeek mapping names the router bias ``params-...-gate-bias``, but its
    deepseek3 / kimi-k2 model keeps that bias in the ``MoEBiasVar`` collection, so ``to_maxtext``
    refuses every DeepSeek-V3 ("maxtext_state_dict must be a subset of flattened param_map").
    Rename that one mapping key; its values, hooks and stacking stay MaxText's own."""
    from maxtext.checkpoint_conversion.utils import param_mapping

    mapping, hooks = param_mapping.PARAM_MAPPING[model_name], param_mapping.HOOK_FNS[model_name]

    def rename(table: dict) -> dict:
        return {("MoEBiasVar-" + key[len("params-"):] if isinstance(key, str) and key.endswith("MoeBlock_0-gate-bias")
                 else key): value for key, value in table.items()}

    param_mapping.PARAM_MAPPING[model_name] = lambda *a, **k: rename(mapping(*a, **k))
    param_mapping.HOOK_FNS[model_name] = lambda *a, **k: rename(hooks(*a, **k))


if __name__ == "__main__":
    main()
