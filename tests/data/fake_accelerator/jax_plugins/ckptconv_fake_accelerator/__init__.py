"""A PJRT plugin standing for a TPU that another program holds (tests/test_accelerator.py).

JAX imports every module of the ``jax_plugins`` namespace it finds on ``sys.path`` and calls its
``initialize()``; that registers a backend, which JAX opens the first time it starts its backends,
unless ``JAX_PLATFORMS`` names others. Opening it records the process in ``$CKPTCONV_FAKE_ACCELERATOR_LOG`` and
fails as libtpu does when another process holds the chip, so a test sees both whether a command tried
to open the accelerator and what it says when it cannot.
"""

import os

ENV = "CKPTCONV_FAKE_ACCELERATOR_LOG"
# libtpu's own words when another process holds the chip (seen on a TPU v5e host, issue 39)
HELD = "ABORTED: Internal error when accessing libtpu multi-process lockfile. Run \"$ sudo lsof -w /dev/vfio/0\""


def initialize() -> None:
    from jax._src import xla_bridge

    xla_bridge.register_backend_factory("fakeaccelerator", _open, priority=500, fail_quietly=False)


def _open():
    log = os.environ.get(ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
    raise RuntimeError(HELD)
