"""What a failure of the storage libraries below us means, as one of our own errors.

The OS says why a write failed in ``errno``; tensorstore and Orbax, which write the checkpoint,
wrap that cause in their own exceptions and keep only its words (``[OS error 28: No space left
on device]``, a ``PERMISSION_DENIED`` status from GCS), and gcsfs names a refused object only in
its upload URL. So the translation looks at the type first (an ``OSError`` anywhere in the chain of
causes, by its errno) and reads text only for those libraries' own status words. It happens here,
around the commands that call those libraries, so that the CLI maps by type alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import urllib.parse
from typing import Iterator

from ckptconv.errors import TERMINATION, CkptConvError, StorageError, Terminated

# errno -> what the one line says.
ERRNO_CONDITIONS: dict[int, str] = {
    errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.EROFS: "read-only file system",
}
# The words tensorstore, Orbax and gcsfs keep of a cause they wrap: the strerror texts of ERRNO_CONDITIONS,
# and what GCS answers (403: no permission; 429: out of quota). ``{work}``: "write" or "read".
LIBRARY_CONDITIONS: dict[str, str] = {
    **{os.strerror(code): said for code, said in ERRNO_CONDITIONS.items()},
    "PERMISSION_DENIED": "permission denied (the bucket refused the {work})",
    "RESOURCE_EXHAUSTED": "out of quota (the bucket refused the {work})",
    "Forbidden: ": "permission denied (the bucket refused the {work})",  # gcsfs's words for a 403
}
# Where those libraries name the file or object they failed on.
FAILED_PATH = (r'(?:Failed writing|Error writing|local file|opening): "([^"]+)"', r"Error writing (gs://[^:\s]+)",
               r"'(/[^']+)'")
GCS_UPLOAD_URL = r"/b/([^/?\s]+)/o\?name=([^&\s]+)"  # gcsfs names the object only in its upload URL
# tensorstore names a key of an OCDBT database apart from the database (opening an array: its zarr.json)
OCDBT_KEY = r'Error writing "([^"]+)" in OCDBT database at (\S+?): '


def _causes(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ if err.__cause__ is not None else (None if err.__suppress_context__ else err.__context__)


def as_storage_error(err: BaseException, consequence: str = "", work: str = "write") -> StorageError | None:
    """``err`` as a :class:`StorageError` (``PATH: condition`` + ``consequence``) if the storage refused
    the work (``work``: a "write" or a "read"), else None (the error is something else, and stays what it is)."""
    for cause in _causes(err):
        if isinstance(cause, OSError) and cause.errno in ERRNO_CONDITIONS:
            where = cause.filename or _named_path(str(cause)) or "the destination"
            return StorageError(f"{where}: {ERRNO_CONDITIONS[cause.errno]}{consequence}")
    text = str(err)
    condition = next((said for words, said in LIBRARY_CONDITIONS.items() if words in text), None)
    if condition is None:
        return None
    return StorageError(f"{_named_path(text) or 'the destination'}: {condition.format(work=work)}{consequence}")


def _named_path(text: str) -> str | None:
    key = re.search(OCDBT_KEY, text)
    if key:
        return key.group(2).rstrip("/") + "/" + key.group(1)
    found = next((m for m in (re.search(pattern, text) for pattern in FAILED_PATH) if m), None)
    if found:
        return found.group(1)
    upload = re.search(GCS_UPLOAD_URL, text)
    return f"gs://{upload.group(1)}/{urllib.parse.unquote(upload.group(2))}" if upload else None


@contextlib.contextmanager
def translated(consequence: str = "", work: str = "write") -> Iterator[None]:
    """Run the body; a storage refusal leaves it as a :class:`StorageError`, and our own stop request
    that a library wrapped on its way out leaves as :class:`Terminated` again."""
    try:
        yield
    except CkptConvError:
        raise
    except Exception as err:  # noqa: BLE001 - tensorstore/Orbax/gcsfs raise their own types; most stay as they are
        if TERMINATION.signum is not None:
            raise Terminated() from err
        storage = as_storage_error(err, consequence, work)
        if storage is None:
            raise
        raise storage from err
