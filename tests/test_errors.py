"""Errors carry their own exit status and one line; the CLI maps by type, and the storage libraries'
failures become typed errors where they are called (``ckptconv.storage_failures``)."""

from __future__ import annotations

import errno
import inspect
import os

import pytest

from ckptconv import cli, errors, storage_failures
from ckptconv.errors import BadInputError, CkptConvError, StorageError


def _types() -> list[type[CkptConvError]]:
    return [t for _, t in inspect.getmembers(errors, inspect.isclass) if issubclass(t, CkptConvError)]


def test_every_error_type_says_why_and_carries_its_exit_status():
    assert len(_types()) >= 8
    for error in _types():
        assert error.__doc__ and len(error.__doc__) > 30, error
        assert error.exit_code == (2 if issubclass(error, BadInputError) else 1), error


def test_an_os_error_is_translated_by_its_errno_and_names_its_file():
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/0/items/d/abc")
    found = storage_failures.as_storage_error(full, "; incomplete")
    assert isinstance(found, StorageError)
    assert str(found) == "/ckpt/0/items/d/abc: no space left on device; incomplete"
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/out")
    assert str(storage_failures.as_storage_error(denied)) == "/out: permission denied"


def test_a_cause_wrapped_by_a_library_is_found_down_the_chain():
    try:
        try:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/ro/x")
        except OSError as err:
            raise ValueError("Orbax: save failed") from err
    except ValueError as wrapped:
        assert str(storage_failures.as_storage_error(wrapped)) == "/ro/x: read-only file system"


def test_tensorstore_and_gcs_words_are_read_only_for_their_status():
    said = ValueError('FAILED_PRECONDITION: Error writing local file: "/d/0/items/ocdbt.process_0/d/1" '
                      f"[OS error {errno.ENOSPC}: {os.strerror(errno.ENOSPC)}]")
    assert str(storage_failures.as_storage_error(said)) == "/d/0/items/ocdbt.process_0/d/1: no space left on device"
    quota = ValueError("RESOURCE_EXHAUSTED: Error writing gs://zoo/m/0/items/d/x: HTTP 429")
    assert str(storage_failures.as_storage_error(quota)) == "gs://zoo/m/0/items/d/x: out of quota (the bucket refused the write)"
    upload = OSError("Forbidden: https://storage/upload/storage/v1/b/zoo/o?name=m%2Fmodel.safetensors&uploadType=x")
    assert str(storage_failures.as_storage_error(upload)).startswith("gs://zoo/m/model.safetensors: permission denied")


def test_anything_else_is_not_taken_for_a_storage_failure():
    assert storage_failures.as_storage_error(ValueError("shape mismatch")) is None
    assert storage_failures.as_storage_error(OSError(errno.EIO, "Input/output error", "/x")) is None
    try:  # a handled permission error is not the cause of what was raised with `from None`
        try:
            raise PermissionError(errno.EACCES, "Permission denied", "/x")
        except PermissionError:
            raise KeyError("unrelated") from None
    except KeyError as err:
        assert storage_failures.as_storage_error(err) is None


def test_translated_passes_our_errors_and_bugs_through_unchanged():
    with pytest.raises(BadInputError, match="as it was"):
        with storage_failures.translated("; x"):
            raise BadInputError("as it was")
    with pytest.raises(ZeroDivisionError):
        with storage_failures.translated("; x"):
            1 / 0
    with pytest.raises(StorageError, match="^/f: disk quota exceeded; x$"):
        with storage_failures.translated("; x"):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/f")


class _Refused(CkptConvError):
    """A new error type, as a later feature would add one, with an exit status of its own."""

    exit_code = 7


def test_the_cli_maps_by_type_alone(monkeypatch, capsys, tmp_path):
    """A type the CLI has never heard of still gets its one line and its own status; a bug keeps its traceback."""
    def refuse(args):
        raise _Refused("gs://b/m: refused, for a reason of its own")

    # the CLI's table of commands, for the synchronous cli.main() calls below only (undone when the test ends)
    monkeypatch.setitem(cli.COMMANDS, "inspect", refuse)
    assert cli.main(["inspect", str(tmp_path)]) == 7
    assert capsys.readouterr().err == "ckptconv: error: gs://b/m: refused, for a reason of its own\n"

    def bug(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setitem(cli.COMMANDS, "inspect", bug)
    with pytest.raises(ZeroDivisionError):
        cli.main(["inspect", str(tmp_path)])


def test_a_conversion_that_fails_in_its_plan_leaves_no_sampler_thread(tmp_path):
    """The RSS sampler starts before the plan; a plan that refuses the source still stops it (a library caller's
    process, or a test worker, would otherwise keep a thread sampling for the rest of its life)."""
    import threading

    from ckptconv.commands.convert import ConvertRequest, convert
    from ckptconv.errors import BadInputError

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text('{"model_type": "no-such-family"}')
    before = {t.ident for t in threading.enumerate() if t.name == "ckptconv-rss"}
    with pytest.raises(BadInputError):
        convert(ConvertRequest(str(tmp_path / "src"), str(tmp_path / "dst")))
    left = [t for t in threading.enumerate() if t.name == "ckptconv-rss" and t.ident not in before]
    assert not left, left
