"""bench/threadprof.py, the profiler issue 38's figures came from: a sample that raises (an asyncio internal it reads
that a Python version renamed) is counted in the result and sampling goes on, rather than the sampler thread dying
on its first sample and leaving a profile that looks merely quiet."""

from __future__ import annotations

import threading
import time

from bench import threadprof


def test_a_sample_that_raises_is_reported_and_sampling_goes_on(monkeypatch):
    def broken(self) -> None:
        raise AttributeError("module 'asyncio.tasks' has no attribute '_all_tasks'")

    monkeypatch.setattr(threadprof.Sampler, "_sample_tasks", broken)
    done = threading.Event()
    busy = threading.Thread(target=lambda: done.wait(5), name="ckptconv-produce_0")
    busy.start()
    try:
        with threadprof.Sampler() as sampler:
            time.sleep(20 * threadprof.INTERVAL)
    finally:
        done.set()
        busy.join()
    result = sampler.result()
    (message, count), = result["sampler_errors"]
    assert "_all_tasks" in message and count >= 5, result["sampler_errors"]
    assert sum(n for _, n in result["frames"]["ckptconv-produce"]) >= 5  # every sample's frames, not just the first's
    assert result["timeline"] and "ckptconv-produce" in result["cpu_by_group_user_sys_threads"]


def test_the_memory_split_accounts_for_what_malloc_holds():
    """At its peak sample the split names what glibc handed out: a 64 MiB buffer kept alive during the samples shows in
    ``mapped`` (glibc maps a block that large on its own whatever its threshold: 32 MiB at most unless set, and this
    test leaves the process's malloc settings alone) and in the resident set; what malloc did not hand out is the rest."""
    import numpy as np

    held = np.ones(64 << 20, np.uint8)  # written: resident
    with threadprof.Sampler() as sampler:
        time.sleep(10 * threadprof.INTERVAL)
    peak = sampler.result()["memory"]["at_peak"]
    del held
    assert peak["rss"] >= 64 << 20, peak
    if "mapped" in peak:  # glibc with mallinfo2
        assert peak["mapped"] >= 64 << 20, peak
        assert peak["other"] + peak["mapped"] <= peak["rss"], peak
    assert threadprof.memory_split(1000, None) == {"rss": 1000}
