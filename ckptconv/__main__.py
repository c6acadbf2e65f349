"""``python -m ckptconv``: the CLI, in a fresh process (how Prefect tasks run conversions)."""

from ckptconv.cli import run

run()
