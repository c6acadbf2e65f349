"""The verbs (``convert``, ``export``, ``inspect``, ``verify``, and the synthetic models the demo and
tests make): each composes the stages below it (read, plan, families, write) and adds nothing of its own
but the order in which they run."""
