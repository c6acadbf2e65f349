"""The announced, bounded waits of ``ckptconv.read.waits``: one board thread says what is outstanding and
gives up on a watched operation that stops making progress (and only then)."""

import contextlib
import logging
import time

from ckptconv.read import waits


@contextlib.contextmanager
def lines():
    """What the ``ckptconv`` logger says meanwhile (the CLI stops it from propagating to the root)."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("ckptconv")
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)


def test_a_watched_operation_is_given_up_only_without_progress_and_announced_meanwhile():
    given_up: list[str] = []
    deadlines = waits.Deadlines(total_seconds=2.0, announce_seconds=0.3)
    with lines() as said, waits.watched("writes to gs://b/x at http://e", deadlines, give_up=given_up.append) as tick:
        steady_until = time.monotonic() + 2 * deadlines.total_seconds
        while time.monotonic() < steady_until:  # steady progress for twice the deadline, never idle for it:
            tick()  # a tick every 20 ms, 100 times inside the deadline, so a busy machine's late wake-ups
            time.sleep(0.02)  # (tenths of a second at load 6 on 2 cores) cannot look like a stall
        assert given_up == []
        deadline = time.monotonic() + 60
        while not given_up:
            assert time.monotonic() < deadline, "never gave up"
            time.sleep(0.05)
    assert len(given_up) == 1 and given_up[0].startswith("giving up on writes to gs://b/x at http://e: no progress")
    assert any(line.startswith("ckptconv: still waiting for writes to gs://b/x at http://e (")
               and line.endswith("s without progress)") for line in said)


def test_an_announced_wait_says_so_until_it_ends():
    with lines() as said:
        with waits.announced("the listing of gs://b/m", waits.Deadlines(announce_seconds=0.25)):
            deadline = time.monotonic() + 60  # two lines, however late a busy machine wakes the board thread
            while len(said) < 2:
                assert time.monotonic() < deadline, said
                time.sleep(0.05)
        ended = len(said)
        time.sleep(0.5)  # two announce periods and more: a line now would be one too many
    assert ended >= 2 and len(said) == ended  # announced while it waited, silent after
    assert all(line.startswith("ckptconv: still waiting for the listing of gs://b/m (") and line.endswith("s so far)")
               for line in said)
