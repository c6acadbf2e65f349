"""Simulated CPU devices for the commands that run JAX: set before JAX starts, checked after.

XLA reads ``--xla_force_host_platform_device_count`` once, when JAX creates its backend, so a
process that restores onto N CPU devices (``restore-check --cpu-devices N``) must set it before
importing JAX; a caller that already started JAX with too few devices gets a clear error. A
conversion needs no JAX at all (its writer lays out the shards itself, ckptconv.write.orbax), so
any number of devices converts in any process.
"""

from __future__ import annotations

import os
import re
import sys

from ckptconv.errors import RuntimeSetupError

_FLAG = "--xla_force_host_platform_device_count"


def device_env(devices: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) with XLA_FLAGS and JAX_PLATFORMS for ``devices`` CPU devices."""
    env = dict(os.environ if base is None else base)
    flags = re.sub(rf"{_FLAG}=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} {_FLAG}={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def configure(devices: int) -> None:
    """Make ``devices`` CPU devices available to JAX in this process (before it starts, if we can)."""
    if "jax" not in sys.modules:
        os.environ.update(device_env(devices))
        return
    import jax

    if devices > 1 and jax.device_count() != devices:
        raise RuntimeSetupError(
            f"JAX already started with {jax.device_count()} device(s), {devices} needed; "
            "run the conversion in a fresh process (python -m ckptconv convert ...)"
        )
