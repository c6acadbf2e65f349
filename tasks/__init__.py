"""Prefect tasks around the ``ckptconv`` CLI: each runs the CLI in a fresh child process.

Nothing here imports JAX or Orbax (not even indirectly): the device count of a conversion is
fixed when its JAX starts, so every conversion, plan, verify and inspect gets its own process.
"""

from tasks.checks import inspect_checkpoint, sharding_check, verify_checkpoint
from tasks.convert import convert_checkpoint
from tasks.export import export_checkpoint
from tasks.job import Conversion, Export
from tasks.plan import plan_conversion
from tasks.restore import restore_check

__all__ = ["Conversion", "Export", "convert_checkpoint", "export_checkpoint", "inspect_checkpoint", "plan_conversion", "restore_check", "sharding_check",
           "verify_checkpoint"]
