"""The child's ``--progress jsonl`` lines, turned into run logs and a moving progress artifact."""

from __future__ import annotations

import json
import logging
import time

from prefect.artifacts import create_progress_artifact, update_progress_artifact

PREFIX = "CKPTCONV "
LOG_EVERY_SECONDS = 5.0
GIB = 1024**3


class ProgressReporter:
    """Feed it output lines (``on_line``); it logs them and moves ``<kind>-<slug>-progress``
    (``conversion`` or ``export``)."""

    def __init__(self, slug: str, logger: logging.Logger | logging.LoggerAdapter, kind: str = "conversion") -> None:
        self.key = f"{kind}-{slug}-progress"
        self.logger = logger
        self.events: dict[str, dict] = {}
        self._last_log = 0.0
        self._artifact = self._safely(create_progress_artifact, 0.0, key=self.key, description="starting")

    def on_line(self, line: str, pid: int) -> None:
        if not line.startswith(PREFIX):
            self.logger.info("[ckptconv %d] %s", pid, line)
            return
        try:
            event = json.loads(line[len(PREFIX):])
        except ValueError:
            self.logger.warning("[ckptconv %d] unparsable progress line: %s", pid, line)
            return
        kind = event.pop("event", "?")
        self.events[kind] = event
        if kind == "progress":
            self._progress(event)
        else:
            self.logger.info("[ckptconv %d] %s %s", pid, kind, json.dumps(event))

    def finish(self, description: str) -> None:
        """Set the artifact to 100 % with a final description."""
        self._update(100.0, description)

    def _progress(self, event: dict) -> None:
        percent = 100.0 * event["bytes"] / max(event["total_bytes"], 1)
        text = (f"{event['tensors']}/{event['total_tensors']} tensors, {event['bytes'] / GIB:.2f}/"
                f"{event['total_bytes'] / GIB:.2f} GiB, RSS {event['rss_bytes'] / GIB:.2f} GiB")
        self._update(percent, text)
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_SECONDS or percent >= 100.0:
            self._last_log = now
            self.logger.info("progress %.0f%%: %s", percent, text)

    def _update(self, percent: float, description: str) -> None:
        if self._artifact is not None:
            self._safely(update_progress_artifact, self._artifact, min(percent, 100.0), description=description)

    def _safely(self, call, *args, **kwargs):
        """Progress is best effort: an API hiccup must not fail the conversion it reports on."""
        try:
            return call(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - logged, conversion goes on
            self.logger.warning("progress artifact %s: %s", self.key, err)
            return None
