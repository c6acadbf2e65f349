"""What a run will do, decided from headers and ``config.json`` alone before any tensor is read: the
leaves and their jobs (``conversion``, ``export``), the devices, the partitions, and the memory estimate."""
