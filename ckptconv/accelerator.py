"""Which devices a ckptconv process may open: the CPU for every file command, the host's accelerator for one.

On a TPU host only one program at a time may hold the chip, and opening it takes ~15 s. ``plan``, ``convert``,
``inspect``, ``verify`` and ``export`` only read and write files: JAX left to itself would initialise every
backend it finds (the TPU first) the moment Orbax asks for the process index, holding the chip a training job
needs, or failing when that job holds it. So the CLI pins JAX to the CPU before it loads (:func:`use_cpu_only`),
whatever ``JAX_PLATFORMS`` says: that variable is set for the training job beside us, not for a file copy.
``restore-check`` is the one command that opens the accelerator, on purpose.

A backend that cannot be opened is said as such (:class:`AcceleratorUnavailableError`), never as a damaged
checkpoint: :func:`open_backends` is where JAX's initialisation failure becomes that type.
"""

from __future__ import annotations

import os
import sys

from ckptconv.errors import CkptConvError

PLATFORMS_ENV = "JAX_PLATFORMS"
# Words in a backend's failure that mean another process holds the device (libtpu's lockfile, a busy chip).
HELD_SIGNS = ("lockfile", "already in use", "busy", "device or resource")


class AcceleratorUnavailableError(CkptConvError):
    """JAX could not open the host's accelerator (held by another program, or no driver): nothing is known
    about the checkpoint. Exit status 75 (EX_TEMPFAIL): try again when the accelerator is free."""

    exit_code = 75


def use_cpu_only() -> None:
    """Make JAX in this process use the CPU alone, before any backend starts.

    Before ``import jax`` the environment decides (``JAX_PLATFORMS=cpu``, inherited by children); after it,
    while no backend is initialised yet, JAX's config does. A process whose JAX already opened its backends
    (a library caller that chose them) is left as it is: its devices are its own business.
    """
    os.environ[PLATFORMS_ENV] = "cpu"
    if "jax" not in sys.modules:
        return
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def backends_opened() -> list[str]:
    """The platforms whose backends this process initialised (none if JAX is not loaded)."""
    if "jax" not in sys.modules:
        return []
    from jax._src import xla_bridge

    return sorted(xla_bridge._backends) if xla_bridge.backends_are_initialized() else []  # noqa: SLF001


def open_backends() -> list:
    """``jax.devices()``: the default backend's devices, every backend JAX chose initialised first. A backend
    that fails to start (the chip held by another program) is an :class:`AcceleratorUnavailableError`."""
    import jax

    try:
        return jax.devices()
    except RuntimeError as err:
        raise unavailable(err) from None


def unavailable(err: BaseException) -> AcceleratorUnavailableError:
    """The one line for a backend JAX could not start: held by another program if its words say so."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    held = any(sign in first.lower() for sign in HELD_SIGNS)
    why = ("the accelerator is held by another program (a training job, another check); run again when it is free"
           if held else "the accelerator could not be opened")
    return AcceleratorUnavailableError(f"{why}; the checkpoint was not read, nothing is known about it ({first})")
