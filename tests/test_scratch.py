"""tests/scratch.py: discarded paths leave the test's directory at once and the disk only after the lag."""

from tests.scratch import LateRemoval


def _file(path, size):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return path


def test_a_discarded_path_is_removed_once_the_lag_has_followed_it(tmp_path):
    removal = LateRemoval(tmp_path / "discarded", lag=100)
    first = _file(tmp_path / "a" / "data", 60).parent  # a directory of 60 bytes
    removal.discard(first)
    assert not first.exists() and removal.queued == 60  # moved aside, not yet removed
    removal.discard(_file(tmp_path / "b", 50))
    assert sorted(p.name for p in removal.root.iterdir()) == ["0-a", "1-b"]  # 50 bytes followed a: under the lag
    removal.discard(_file(tmp_path / "c", 50))
    assert sorted(p.name for p in removal.root.iterdir()) == ["1-b", "2-c"]  # 100 followed a: removed
    assert removal.queued == 100
    removal.flush()
    assert list(removal.root.iterdir()) == [] and removal.queued == 0


def test_without_a_lag_a_discarded_path_is_removed_at_once(tmp_path):
    removal = LateRemoval(tmp_path / "discarded", lag=0)
    removal.discard(_file(tmp_path / "a", 10))
    assert list(removal.root.iterdir()) == []
