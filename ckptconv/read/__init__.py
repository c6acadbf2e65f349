"""Where bytes come from: sources (a local directory, ``gs://``, ``hf://``), safetensors headers and
tensors, ``config.json``, and checkpoints already written. ``open_source`` picks the reader by scheme,
importing the cloud clients only for a remote one."""

from __future__ import annotations

import importlib

from ckptconv.read.sources import LocalSource, Source

__all__ = ["open_source"]


def open_source(uri: str, *, hf_token_file: str | None = None) -> Source:
    """Open a source by URI: a local directory, ``gs://bucket/dir`` or ``hf://org/repo[@rev]``.

    ``hf_token_file`` names a file holding a hub token (else ``HF_TOKEN`` or a saved login).
    Another scheme (``s3://``) is refused by name, not taken for a local directory of that name.
    """
    from ckptconv import locations

    locations.check(uri, locations.SOURCE)
    for prefix, (module, class_name) in _SCHEMES.items():
        if uri.startswith(prefix):  # imported only when needed: it pulls in the cloud clients
            reader = importlib.import_module(f"ckptconv.read.{module}")
            return getattr(reader, class_name).open(uri, hf_token_file=hf_token_file)
    return LocalSource(uri)


# URI prefix -> (module of ckptconv.read, its source class), by name, so importing this module stays cheap.
_SCHEMES: dict[str, tuple[str, str]] = {"gs://": ("gcs", "GcsSource"), "hf://": ("hub", "HubSource")}
