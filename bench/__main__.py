"""``python -m bench NAME [args]``: run one benchmark; ``python -m bench --list``: what each measures and where.

Each name maps to a module of bench/ with ``main(argv: list[str] | None) -> int`` (and, for a benchmark that is a
preset of another, the arguments put before the user's). Modules are imported only when their name runs, so a
benchmark whose module is missing, or needs what this venv lacks, says so without stopping the others.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Benchmark(NamedTuple):
    module: str  # bench.<module>
    measures: str  # one line
    page: str  # its results page under docs/bench/ ("-": prints its table)
    maxtext: bool = True  # needs MaxText's venv (bench/maxtext_env.sh)
    preset: tuple[str, ...] = ()  # arguments before the user's


GROUPS: dict[str, dict[str, Benchmark]] = {
    "Speed and memory (ckptconv against MaxText's converter, cp, itself)": {
        "speed": Benchmark("compare_maxtext", "0.6B and 8B conversion: wall, peak RSS, RSS over time; vs MaxText and cp "
                           "(`make bench`)", "RESULTS.md"),
        "export": Benchmark("export_vs_maxtext", "`ckptconv export` vs MaxText's to_huggingface: wall, peak RSS, "
                            "tensors compared", "EXPORT.md"),
        "scale": Benchmark("scale", "1 vs 2 cores, one conversion split into N partitions", "SCALE.md", maxtext=False),
        "hub-upload": Benchmark("hub_upload", "`export ... hf://` upload throughput against the fake hub",
                                "HUB.md", maxtext=False),
        "throughput": Benchmark("throughput", "conversion throughput (issue 38)", "-", maxtext=False),
    },
    "Memory at the releases' widths (measured, and planned at full size)": {
        "giants": Benchmark("widths", "DeepSeek-V3 / gpt-oss at their widths; DeepSeek-V3, Kimi-K2 planned",
                            "GIANTS.md", maxtext=False, preset=("giants",)),
        "hybrid-memory": Benchmark("widths", "Qwen3-Next / Qwen3.5 at their widths, and planned", "HYBRID-MEMORY.md",
                                   maxtext=False, preset=("hybrid",)),
        "keep-fp8": Benchmark("keep_fp8", "`--dtype float8_e4m3fn`: bytes, peak RSS vs plan; what MaxText's "
                              "--save_dtype writes", "KEEP-FP8.md"),
    },
    "Bit for bit against MaxText 0.2.5's own converters": {
        "families": Benchmark("compare_families", "every family, scanned and not, 1 and 16 devices, leaf by leaf "
                              "(`make bench-families`)", "FAMILIES.md"),
        "llama4": Benchmark("compare_llama4", "Llama 4 against MaxText's two Llama 4 scripts", "FAMILIES.md"),
        "deepseek-v4": Benchmark("compare_deepseek_v4", "DeepSeek-V4-Flash against to_maxtext; records "
                                 "tests/data/maxtext_leaves/", "GIANTS.md"),
        "kimi25": Benchmark("kimi25_vs_maxtext", "Kimi-K2.5 against MaxText's standalone Kimi scripts", "GIANTS.md"),
        "lora": Benchmark("compare_lora", "LoRA adapters, adapter and merged mode, and their time", "LORA.md"),
    },
    "MaxText's own forward pass and loaders on ckptconv's checkpoints": {
        "logits": Benchmark("maxtext_logits", "OLMo 3, Qwen3-VL/Omni text, Gemma 4: logits vs transformers'",
                            "LOGITS.md"),
        "hybrid": Benchmark("maxtext_hybrid", "Qwen3-Next / Qwen3.5: logits, ckptconv's vs MaxText's own conversion",
                            "HYBRID.md"),
        "llama4-logits": Benchmark("maxtext_llama4_logits", "Llama 4: logits vs transformers', training loader "
                                   "leaf by leaf", "-"),
        "llama4-vision": Benchmark("maxtext_llama4_vision", "Llama 4's vision encoder vs transformers'", "-"),
        "loaders": Benchmark("maxtext_loaders", "DeepSeek V2/V3/V3.2/V4, Kimi-K2 in both MaxText loaders",
                             "LOADERS.md"),
        "keep-fp8-deepseek": Benchmark("keep_fp8_deepseek", "DeepSeek-V3 / Kimi-K2 FP8 kept FP8, in both loaders",
                                       "KEEP-FP8-DEEPSEEK.md"),
        "vision": Benchmark("vision", "vision towers (`--multimodal`): leaf by leaf, forward, peak RSS", "VISION.md"),
        "qwen3-vl-image": Benchmark("qwen3_vl_image", "Qwen3-VL / Qwen3.5 / Omni on text around an image",
                                    "VISION.md"),
    },
    "Restoring a converted checkpoint": {
        "restore": Benchmark("restore", "restore cost, local and gs:// (requests, bytes), ckptconv's vs "
                             "MaxText's output; `--checkpoints NAME=DIR ...`: given ones", "RESTORE.md"),
        "tpu-restore": Benchmark("tpu_restore", "restore on the TPU host (issue 39)", "-", maxtext=False),
    },
}
BENCHMARKS: dict[str, Benchmark] = {name: b for group in GROUPS.values() for name, b in group.items()}


def listing() -> str:
    lines = []
    for title, group in GROUPS.items():
        lines.append(f"{title}:")
        for name, b in group.items():
            where = f"docs/bench/{b.page}" if b.page != "-" else "prints its table"
            venv = "" if b.maxtext else ", no MaxText venv"
            lines.append(f"  {name:<18} {b.measures} [{where}{venv}]")
    return "\n".join(lines)


def load(name: str):
    """The module of benchmark ``name``; SystemExit with a clear message if it is unknown or cannot be imported."""
    name = name.replace("_", "-")  # tpu_restore, hybrid_memory ... as the module names spell them
    if name not in BENCHMARKS:
        raise SystemExit(f"bench: no benchmark {name!r}; `python -m bench --list` lists them")
    module = f"bench.{BENCHMARKS[name].module}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name == module:
            raise SystemExit(f"bench: {name}: bench/{BENCHMARKS[name].module}.py is not there (yet)") from None
        raise SystemExit(f"bench: {name}: {module} needs {error.name!r}, which this Python lacks "
                         f"({sys.executable})") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__.splitlines()[0] + "\n\n" + listing())
        return 0
    name, rest = argv[0], argv[1:]
    module, name = load(name), name.replace("_", "-")
    sys.argv[0] = f"python -m bench {name}"  # what argparse's usage and --help name
    return module.main([*BENCHMARKS[name].preset, *rest])


if __name__ == "__main__":
    sys.exit(main())
