"""Prefect flows: ``convert-model`` (one checkpoint) and ``convert-zoo`` (a manifest of them).

Flows only wire the tasks in ``tasks/``; nothing here imports JAX or Orbax.
"""
