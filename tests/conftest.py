"""Shared fixtures. Each test module that needs a service registers its fixture module here.

JAX reads its device count once per process: the tests that import JAX in-process get 16
simulated CPU devices (set here, before anything imports JAX); conversions with other
device counts run the CLI in a fresh process, as production does.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests import scratch

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MALLOC_ARENA_MAX", "2")
# Bytecode is cached (``__pycache__``, ignored by git) even where the environment says not to (our Docker images and
# this sandbox set PYTHONDONTWRITEBYTECODE=1): the suite starts hundreds of Python processes (the CLI, Prefect
# workers and flow runs), and each compiled ckptconv, flows and tasks from source again, as did each xdist worker
# (and pytest's assertion rewriting of every test module). Measured on 2 cores, CPU-s of the module's tests:
# tests/test_trust3.py 48.2 -> 32.8, tests/test_lora.py 71.9 -> 56.7. A conversion's peak RSS is the same either
# way (68 MB for the synthetic Qwen3, compiled or cached), so the memory phase is unaffected.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

ROOT = Path(__file__).resolve().parent.parent

pytest_plugins: list[str] = ["tests.gcs_server", "tests.hub_server", "tests.prefect_fixtures"]


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``python -m ckptconv ARGS`` in a fresh process (its own JAX, its own device count)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("XLA_FLAGS", None)  # the CLI sets it from --devices, as in production
    return subprocess.run([sys.executable, "-m", "ckptconv", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


@pytest.fixture
def synth_dir(tmp_path):
    """Factory: write a synthetic checkpoint and return its directory."""
    from ckptconv.commands import synth

    def make(model=None, name: str = "src", **kwargs) -> Path:
        directory = tmp_path / name
        synth.write_checkpoint(model or synth.SynthModel(), str(directory), **kwargs)
        return directory

    return make


@pytest.fixture(scope="session")
def shared_synth(tmp_path_factory):
    """Context manager factory like ``synth_dir``, for a source only read by ``users`` tests: one directory per model
    and options for the whole session, shared by the xdist workers (made once, under a lock) and removed when its
    last user is done, so that the memory phase's gigabytes do not pile up on the disk until the session ends (one
    test's ``tmp_path`` is removed when it passes). test_memory's cases with more workers convert the very sources
    of their peak cases (Llama-3-70B's widths: 5 GB, 20-25 s of the memory phase to write again)."""
    import contextlib
    import fcntl
    import hashlib
    import shutil

    from ckptconv.commands import synth

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # a worker's is popen-gwN in the session's

    @contextlib.contextmanager
    def locked(key: str):
        with open(root / f"shared-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker making or removing it: wait for it
            yield

    @contextlib.contextmanager
    def make(model, name: str = "src", *, users: int, **kwargs):
        key = hashlib.sha256(repr((name, model, sorted(kwargs.items()))).encode()).hexdigest()[:16]
        directory = root / f"shared-{key}" / name  # named ``name``, as synth_dir's: test_memory records it
        done = root / f"shared-{key}.done"  # one line per user that has finished with it
        with locked(key):
            directory.parent.mkdir(exist_ok=True)
            if not (directory / ".complete").exists():
                shutil.rmtree(directory, ignore_errors=True)  # a run cut short left part of it
                synth.write_checkpoint(model, str(directory), **kwargs)
                (directory / ".complete").touch()
        try:
            yield directory
        finally:
            with locked(key):
                with open(done, "a") as finished:
                    finished.write("done\n")
                if len(done.read_text().splitlines()) >= users:
                    scratch.discard(directory.parent)

    return make


@pytest.fixture(scope="session", autouse=True)
def scratch_removal(tmp_path_factory):
    """What tests hand to ``tests.scratch.discard`` is removed late, in this worker's own directory, and the rest at
    the end of the session (tests/scratch.py says why)."""
    scratch.configure(tmp_path_factory.getbasetemp() / "discarded",
                      workers=int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    yield
    scratch.flush()


# The longest modules first, in the order of their measured seconds (`--durations`, a whole `make test` on 2 cores,
# tests/test_prefect_e2e.py 416 s down to tests/test_llama4.py 80 s, loaded): `make test` hands whole modules to its
# workers in collection order, longest first, so that what is left for the end is short modules that fill the gaps
# (a simulation of the scheduler on those times: a 3% longer phase with only the first eight listed). The modules
# of PREFECT_SERVER_MODULES go together, where the first of them stands. test_memory leads its own phase.
LONGEST_FIRST = ("test_prefect_e2e", "test_memory", "test_lora", "test_logits", "test_resume", "test_export",
                 "test_convert_moe_gemma", "test_prefect_flows", "test_prefect_export", "test_zoo_waits",
                 "test_accelerator_prefect", "test_qwen3_next", "test_gcs_refusals", "test_convert", "test_keep_fp8",
                 "test_trust3", "test_families", "test_hub_export", "test_destination_safety", "test_router_bias",
                 "test_quantized", "test_partition", "test_int4", "test_llama4")


# Modules whose cases are long, independent conversions in their own processes (no module fixture to share):
# each case is a scope of its own, so `make test` spreads them over its workers instead of queueing them all
# on one. Not test_memory: its cases measure peak RSS and stay one after another on one worker. Three of them
# at once (several GB of synthetic model each, written and read side by side) raised a peak far above the same
# case alone (Qwen2.5-1.5B widths: 437 MiB against 314 MiB), past the prediction the test holds them to.
SPREAD_MODULES = ("tests/test_convert_moe_gemma.py",)

# The modules that use the session's Prefect test server (the ``prefect_server`` fixture): one scope, so one worker
# starts that server (15-25 s of a core each time) instead of every worker that happens to take one of them.
PREFECT_SERVER_MODULES = ("tests/test_prefect_flows.py", "tests/test_prefect_export.py", "tests/test_zoo_waits.py",
                          "tests/test_accelerator_prefect.py")


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope``, except that each case of ``SPREAD_MODULES`` is its own scope and the modules of
    ``PREFECT_SERVER_MODULES`` are one."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SpreadScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module in SPREAD_MODULES:
                return nodeid
            if module in PREFECT_SERVER_MODULES:
                return "prefect_server"
            return super()._split_scope(nodeid)

    return SpreadScheduling(config, log)


# The memory phase (`make test`'s second, tests marked ``memory``, three at a time with xdist's load scheduling) runs
# its tests longest first, so that its last ones are short: each worker holds a test and the next, and an OLMo 3
# block (2 min) handed out last would run alone at the end. Seconds of each in a clean clone's memory phase on
# 2 cores (6 Dec, before synth's FP8 pools and shared_synth: the FP8 cases and the ones with more workers are given
# as that less the synthesis they no longer do, measured alone); a test not listed runs first (it may be long).
MEMORY_SECONDS = {
    "test_peak_rss_is_bounded_and_predicted[olmo3-32b-block]": 139,
    "test_peak_rss_is_bounded_and_predicted[qwen3.5-397b-period]": 133,
    "test_kept_peak_is_predicted": 118,
    "test_peak_rss_is_bounded_and_predicted[llama-70b-widths]": 87,
    "test_peak_rss_is_bounded_and_predicted[llama4-scout-widths]": 81,
    "test_peak_rss_is_bounded_and_predicted[llama4-maverick-fp8-widths]": 79,
    "test_kept_deepseek_peak_is_predicted": 73,
    "test_peak_rss_is_bounded_and_predicted[deepseek-v4-flash]": 66,
    "test_peak_rss_is_bounded_and_predicted[kimi-k2.6-int4]": 60,
    "test_peak_rss_is_bounded_and_predicted[qwen3-next-80b-period]": 55,
    "test_peak_rss_is_bounded_and_predicted[deepseek-v3.2-fp8]": 50,
    "test_peak_rss_is_bounded_and_predicted[deepseek-v2-lite]": 46,
    "test_more_workers_stay_predicted[llama-70b-widths]": 39,
    "test_peak_rss_is_bounded_and_predicted[gemma4-e4b-widths]": 32,
    "test_peak_rss_is_bounded_and_predicted[fp8-experts]": 30,
    "test_peak_rss_is_bounded_and_predicted[qwen3_vl_moe-experts]": 29,
    "test_peak_rss_is_bounded_and_predicted[qwen3_omni_moe-experts]": 27,
    "test_peak_rss_is_bounded_and_predicted[gpt-oss-20b-widths]": 26,
    "test_peak_rss_is_bounded_and_predicted[experts]": 25,
    "test_peak_rss_is_bounded_and_predicted[gemma4-26b-a4b-widths]": 23,
    "test_peak_rss_is_bounded_and_predicted[int4-experts]": 21,
    "test_peak_rss_is_bounded_and_predicted[gemma3-4b-widths]": 19,
    "test_peak_rss_is_bounded_and_predicted[gemma2-2b-widths]": 18,
    "test_peak_rss_is_bounded_and_predicted[mistral-7b-widths]": 16,
    "test_peak_rss_is_bounded_and_predicted[mixtral-8x7b-widths]": 15,
    "test_more_workers_stay_predicted[mistral-7b-widths]": 14,
    "test_peak_rss_is_bounded_and_predicted[qwen3_vl-layers]": 13,
    "test_peak_rss_is_bounded_and_predicted[layers]": 12,
    "test_merge_streams_the_base": 10,
    "test_more_workers_stay_predicted[layers]": 5,
    "test_peak_rss_is_bounded_and_predicted[qwen2.5-1.5b-widths]": 5,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> tuple:
        if item.get_closest_marker("memory") is not None:
            return 0, -MEMORY_SECONDS.get(item.name, float("inf"))
        return 1, rank.get(item.path.stem, len(rank))

    items.sort(key=order)  # stable: the rest keep their order


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and of its children that have been waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_START] = _cpu_seconds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Each test's CPU seconds (setup to teardown, with the CLI processes it ran) as the JUnit property
    ``cpu_seconds``: on a shared or oversubscribed machine wall time says little about a test's cost, CPU time
    does (the figure the suite's schedule and its cuts are measured by). A server a module fixture started counts
    where it is reaped."""
    if call.when == "teardown" and _CPU_START in item.stash:
        item.user_properties.append(("cpu_seconds", f"{_cpu_seconds() - item.stash[_CPU_START]:.1f}"))
    return (yield)


_CPU_START = pytest.StashKey[float]()


def pytest_terminal_summary(terminalreporter) -> None:
    """The fault-injection figures: scenarios injected, survived (the run completed or failed in one
    line and its rerun completed, and the result verified), and data lost (any other outcome)."""
    reports = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
               if r.when == "call" and "fault" in r.keywords]
    if reports:
        survived = sum(r.passed for r in reports)
        terminalreporter.write_line(f"fault injection: {len(reports)} scenarios injected, {survived} survived, "
                                    f"{len(reports) - survived} with data lost or a run left broken")
