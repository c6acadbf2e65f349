"""ckptconv: stream Hugging Face checkpoints into sharded MaxText Orbax checkpoints.

Importing this package is cheap: JAX and Orbax are imported only by the modules that
write or read checkpoints, inside the conversion process, after the device count is set.
"""

__version__ = "0.2.0"
