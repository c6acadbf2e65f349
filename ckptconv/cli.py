"""``ckptconv``: convert, export, inspect, verify and plan from the command line.

JAX is imported only inside the commands that need it, after ``--devices`` has been put into
``XLA_FLAGS``: the device count is fixed the moment JAX starts. Errors are mapped by type: a
:class:`~ckptconv.errors.CkptConvError` is one line and its own exit status (2: bad input, else 1);
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import time
from typing import Sequence

from ckptconv import __version__, accelerator, locations, settings
from ckptconv.errors import INCOMPLETE, TERMINATION, CkptConvError, Terminated
from ckptconv.units import parse_size
from ckptconv.write.codecs import CODECS

GIB = 1024**3
PARENT_PID_ENV = "CKPTCONV_PARENT_PID"
PR_SET_PDEATHSIG = 1
WRITERS = ("convert", "export")
ACCELERATOR_COMMANDS = ("restore-check",)  # every other command only reads and writes files: JAX on the CPU


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default. A flag (``--overwrite``, ``--no-compression``) and an
    option whose default is None say in their own help what happens without them: "(default: None)"
    beside ``--no-compression`` would mislead more than inform."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action, FLAG_ACTIONS):
            return action.help or ""
        return super()._get_help_string(action)


FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction)  # noqa: SLF001 - argparse's own flag types


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptconv", description=__doc__.splitlines()[0],
                                     formatter_class=_DefaultsHelp)
    parser.add_argument("--version", action="version", version=f"ckptconv {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    convert = commands.add_parser("convert", help="HF safetensors checkpoint -> MaxText Orbax checkpoint",
                                  formatter_class=_DefaultsHelp)
    convert.add_argument("source", help="HF checkpoint (config.json + *.safetensors): a directory, "
                         "gs://BUCKET/DIR or hf://ORG/REPO[@REVISION]")
    convert.add_argument("destination", help="output directory or gs://BUCKET/DIR; MaxText loads DST/0/items")
    _layout_flags(convert)
    convert.add_argument("--report", help="also write the JSON report here (always: DST/ckptconv-report.json)")
    convert.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at DST")
    _progress_flag(convert)
    codec = convert.add_mutually_exclusive_group()
    codec.add_argument("--compression", choices=tuple(CODECS), default=settings.COMPRESSION,
                       help="how stored chunks are compressed: zstd (Orbax's own, at level 1), lz4 (blosc lz4 over "
                            "bit planes: 3%% smaller on bf16 weights and faster to decode; holds about twice the data "
                            "file while writing in the source's order), none (raw bytes); default: lz4 where the data "
                            "files are by device, zstd otherwise")
    codec.add_argument("--no-compression", dest="compression", action="store_const", const="none",
                       help="same as --compression none")
    _data_file_flag(convert)
    split = convert.add_mutually_exclusive_group()
    split.add_argument("--partition", metavar="I/N",
                       help="write only partition I of N (0-based; run each on any worker sharing DST)")
    split.add_argument("--finalize", metavar="N", type=int,
                       help="join N finished partitions into the checkpoint and commit it once")
    _lora_flags(convert)
    convert.add_argument("--lora-layout", choices=("converter", "restore"), default="converter",
                         help="with --lora alone: 'converter' writes the tree under params/params as MaxText's "
                              "to_maxtext does; 'restore' at the root, where MaxText's lora.lora_restore_path reads it")
    _hf_token_flag(convert)

    export = commands.add_parser("export", help="MaxText Orbax checkpoint -> HF safetensors (streamed)",
                                 formatter_class=_DefaultsHelp)
    export.add_argument("checkpoint", help="MaxText checkpoint: its items directory (DST/0/items) or a convert DST")
    export.add_argument("destination", help="output directory, gs://BUCKET/DIR, or hf://ORG/REPO[@BRANCH] (staged "
                        f"under ${settings.HUB_STAGING_ENV} or {settings.HUB_STAGING}, uploaded, committed once)")
    export.add_argument("--like", required=True, help="the HF model it is (config.json, tokenizer files; "
                        "weights not needed): a directory, gs://BUCKET/DIR or hf://ORG/REPO[@REVISION]")
    export.add_argument("--dtype", choices=settings.OUTPUT_DTYPES, default=settings.DTYPE,
                        help="dtype of the exported tensors")
    export.add_argument("--shard-size", default=settings.SHARD_SIZE, help="largest safetensors file")
    export.add_argument("--lora-alpha", type=float, metavar="ALPHA",
                        help="a LoRA adapter checkpoint that does not record its alpha (one MaxText's converter "
                             "wrote): the alpha for adapter_config.json")
    export.add_argument("--report", help="also write the JSON report here (always: DST/ckptconv-report.json)")
    export.add_argument("--overwrite", action="store_true", help="replace an HF model already at DST")
    _workers_flags(export, "stored regions read and turned back into HF tensors at once (written in order)")
    _progress_flag(export)
    _hf_token_flag(export)

    inspect = commands.add_parser("inspect", help="one row per leaf: shape, dtype, sharding, chunks",
                                  formatter_class=_DefaultsHelp)
    inspect.add_argument("destination", help="a convert destination: directory or gs://BUCKET/DIR")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of the table")
    inspect.add_argument("--deep", action="store_true", help="also read every stored chunk (finds truncated files)")

    verify = commands.add_parser("verify", help="check every leaf equals the transformed source, bit for bit "
                                 "(without SRC: every stored chunk decodes and passes its checksum)",
                                 formatter_class=_DefaultsHelp)
    verify.add_argument("source", nargs="?", help="the HF checkpoint converted: a directory, gs://BUCKET/DIR or "
                        "hf://ORG/REPO[@REVISION]; without it, only the checkpoint's own integrity is checked "
                        "(every chunk decoded, its crc32c checked: finds bit rot, not a wrong conversion)")
    verify.add_argument("destination", help="the convert destination: directory or gs://BUCKET/DIR")
    verify.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    _workers_flags(verify, "with SRC: source read units read and transformed at once, and stored regions read and "
                   "decoded ahead")
    _progress_flag(verify)
    _hf_token_flag(verify)

    plan = commands.add_parser("plan", help="check a source and predict the conversion (no JAX, no writes)",
                               formatter_class=_DefaultsHelp)
    plan.add_argument("source", help="HF checkpoint: a directory, gs://BUCKET/DIR or hf://ORG/REPO[@REVISION]")
    _layout_flags(plan)
    plan.add_argument("--json", action="store_true", help="print JSON instead of one line per figure")
    _data_file_flag(plan)
    _lora_flags(plan)
    _hf_token_flag(plan)

    check = commands.add_parser("restore-check", help="restore a checkpoint onto this host's accelerators as a "
                                "training job does, and check every leaf on them bit for bit against the stored data",
                                formatter_class=_DefaultsHelp)
    check.add_argument("destination", help="a convert destination: directory or gs://BUCKET/DIR")
    check.add_argument("--source", help="also verify the stored data against the HF checkpoint it was converted "
                       "from first (as `verify SRC DST`): the chain from SRC to the chip in one command")
    check.add_argument("--cpu-devices", type=int, metavar="N", help="restore onto N simulated CPU devices instead "
                       "of the accelerator (a host without one; what CI runs); default: JAX's choice (JAX_PLATFORMS)")
    check.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    _hf_token_flag(check)
    return parser


def _lora_flags(command: argparse.ArgumentParser) -> None:
    """The adapter options ``convert`` and ``plan`` share (plan predicts what convert will do)."""
    command.add_argument("--lora", metavar="ADAPTER_DIR",
                         help="a PEFT LoRA adapter of SOURCE (adapter_config.json + adapter_model.safetensors): "
                              "write the adapter alone, in MaxText's LoRA layout")
    command.add_argument("--merge-lora", action="store_true",
                         help="with --lora: fold the adapter into the base (W + (alpha/r) B A) and write the whole "
                              "model")


def _layout_flags(command: argparse.ArgumentParser) -> None:
    """The layout options ``convert`` and ``plan`` share (plan predicts what convert will do)."""
    command.add_argument("--devices", type=int, default=settings.DEVICES,
                         help="simulated devices to shard across (1: unsharded)")
    command.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=settings.SCAN_LAYERS,
                         help="stack layers on axis 1 (MaxText scan_layers=true); default: scanned, except for a "
                         "model MaxText runs unscanned only (the report says which)")
    command.add_argument("--multimodal", action="store_true",
                         help="also convert the vision (and audio) encoders, as MaxText's use_multimodal=true "
                         "(default: the text decoder only; the encoders' tensors are reported, not written)")
    command.add_argument("--dtype", choices=settings.CONVERT_DTYPES, default=settings.DTYPE,
                         help="dtype of the checkpoint's weights (float8_e4m3fn: an FP8 release's weights kept "
                         "e4m3 with their scales, every other tensor in its own dtype, as MaxText's --save_dtype)")


def _data_file_flag(command: argparse.ArgumentParser) -> None:
    """What ``convert`` gathers into one OCDBT data file, and ``plan`` predicts it with."""
    command.add_argument("--data-file-size", default=settings.DATA_FILE_SIZE, metavar="SIZE",
                         help="tiles gathered into one OCDBT data file before its commit (uncompressed): a host "
                         "restoring its shard makes about one storage read per leaf and data file, and the "
                         "conversion holds up to about 1.8x this in RAM (plan predicts it); 0: every tile commits "
                         "alone (least RAM, most data files)")
    command.add_argument("--data-files-by-device", action=argparse.BooleanOptionalAction,
                         default=settings.DATA_FILES_BY_DEVICE,
                         help="regroup the tiles by device through local spill files (TMPDIR, plan's spill_disk_bytes) "
                         "so that each data file holds one device's chunks: a host restoring its shard reads its own "
                         "files only (about 16x fewer reads on 16 devices), for a few more seconds of conversion; "
                         "--no-data-files-by-device writes them in the source's order; default: by device when the "
                         "output fills more than one spill window (devices x --data-file-size: 1 GiB on 16 devices)")
    _workers_flags(command, "read units read and transformed at once (and, above 1, a data file gathered while the "
                   "last commits)")


def _workers_flags(command: argparse.ArgumentParser, what: str) -> None:
    """How many threads a run's work takes at once, and the memory that bounds them (convert, plan, verify, export)."""
    command.add_argument("--workers", type=int, default=settings.WORKERS, metavar="N",
                         help=f"{what}; default: one fewer than the cores this process may use (the writer takes one), "
                         "as many as fit --memory-budget")
    command.add_argument("--memory-budget", default=settings.MEMORY_BUDGET, metavar="SIZE",
                         help="the peak RSS the run may plan on (plan predicts it): fewer workers when more would not "
                         f"fit; default: {settings.BUDGET_SHARE_OF_AVAILABLE * 100:.0f}%% of the memory available now")


def _run_options(args: argparse.Namespace) -> settings.RunOptions:
    """The run's options, built once from these flags and this host (ckptconv.host.run_options); a command without
    the data file flags (verify, export) takes their defaults."""
    from ckptconv import host

    budget = None if args.memory_budget is None else parse_size(args.memory_budget, "--memory-budget")
    data_file_size = getattr(args, "data_file_size", settings.DATA_FILE_SIZE)
    return host.run_options(data_file_bytes=parse_size(data_file_size, "--data-file-size", zero=True),
                            data_files_by_device=getattr(args, "data_files_by_device", settings.DATA_FILES_BY_DEVICE),
                            workers=args.workers, budget_bytes=budget)


def _progress_flag(command: argparse.ArgumentParser) -> None:
    command.add_argument("--progress", choices=("bar", "jsonl", "none"), default=settings.PROGRESS,
                         help="on stderr: a bar with ETA on a terminal, else a whole line every few seconds; "
                         "jsonl: CKPTCONV {...} lines for a program")


def _hf_token_flag(command: argparse.ArgumentParser) -> None:
    command.add_argument("--hf-token-file", metavar="PATH",
                         help="file holding a Hugging Face token for hf:// sources and destinations (default: "
                         "HF_TOKEN or a saved login)")


def _on_stop_signal(signum, frame) -> None:
    """Only note the request: the producer stops the run before its next tile (within a tile's time).

    Raising here instead would land at an arbitrary bytecode: inside ``import jax`` it aborts the
    process, inside a garbage-collection callback it is swallowed. A second signal (a read that
    hangs until its deadline, an impatient Ctrl-C) leaves at once: nothing is committed mid-run, so
    the destination stays visibly incomplete either way.
    """
    if TERMINATION.signum is not None:
        sys.stderr.write(f"ckptconv: {'interrupted' if signum == signal.SIGINT else 'terminated'} again; leaving now\n")
        os._exit(128 + signum)
    TERMINATION.request(signum)


def _die_with_parent() -> None:
    """When started by a Prefect task (``CKPTCONV_PARENT_PID``), get SIGTERM if that parent dies:
    a cancelled or killed flow run must not leave a conversion writing on its own (Linux only)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # it died before prctl took effect
        raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `ckptconv --help | head -1`, or an error line to a reader that left
        return _reader_gone()


def _reader_gone() -> int:
    """Whoever read our output has gone (`ckptconv inspect DST | head -1`): leave quietly, as Unix
    tools do (a shell reports them as ended by SIGPIPE: 141). What is still buffered goes to
    /dev/null, so the interpreter's last flush finds no broken pipe to complain about."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a stream already closed or replaced: nothing to protect
            pass
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command not in ACCELERATOR_COMMANDS:  # before JAX loads: never open (or wait for) the host's TPU
        accelerator.use_cpu_only()
    if args.command in WRITERS:  # read-only commands have nothing to leave in order: a signal ends them at once
        signal.signal(signal.SIGTERM, _on_stop_signal)
        signal.signal(signal.SIGINT, _on_stop_signal)
    # Orbax logs a failed write with its traceback from its own threads; the CLI reports it in one line
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    _log_plainly()
    try:
        _die_with_parent()
        for name, role in LOCATIONS[args.command]:
            if getattr(args, name) is not None:  # an optional one left out (verify's SRC)
                locations.check(getattr(args, name), role)
        if args.command in WRITERS:
            _bound_tensorstore_requests()
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # here, where a reader that left is caught, not at interpreter exit
        return code
    except CkptConvError as err:  # each type carries its exit status; its text is already one line
        print(f"ckptconv: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("ckptconv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_gone()
    except Terminated:
        return _stopped(TERMINATION.signum or signal.SIGTERM, INCOMPLETE if args.command in WRITERS else "")


def _log_plainly() -> None:
    """Our log lines (waits, retries, notices) on stderr as they are written, whatever logging
    setup a library makes on import (absl configures the root logger's format)."""
    log = logging.getLogger("ckptconv")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _bound_tensorstore_requests() -> None:
    """A gs:// request that goes silent is abandoned (and retried by tensorstore) after the remote
    request timeout, as ours are: libcurl's low-speed limit, read when tensorstore first connects."""
    from ckptconv.read.waits import Deadlines

    seconds = max(1, round(Deadlines.from_env().request_seconds))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(seconds))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")


def _stopped(signum: int, consequence: str) -> int:
    """One line for a run a signal stopped; the shell's status for it (128 + signal number)."""
    what = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    print(f"ckptconv: {what}{consequence}", file=sys.stderr)
    return 128 + signum


def run() -> None:
    """The console entry point: ``main``, then exit with its status.

    After a failure, tensorstore/Orbax threads may still call into a closed asyncio loop while the
    interpreter tears down, printing tracebacks after our one-line error: leave without teardown.

    glibc's allocator is tuned first, before JAX, XLA, tensorstore or OpenBLAS start a thread
    (:func:`ckptconv.monitor.tune_malloc`: its arena cap holds only for arenas not yet made).
    """
    from ckptconv.monitor import tune_malloc

    tune_malloc()
    code = main()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def _convert(args: argparse.Namespace) -> int:
    from ckptconv.commands.convert import ConvertRequest, convert

    report = convert(ConvertRequest(
        source=args.source, destination=args.destination, devices=args.devices, scan_layers=args.scan_layers,
        dtype=args.dtype, report=args.report, overwrite=args.overwrite, progress=args.progress,
        compression=args.compression, hf_token_file=args.hf_token_file, partition=args.partition,
        finalize=args.finalize, lora=args.lora, merge_lora=args.merge_lora, lora_layout=args.lora_layout,
        multimodal=args.multimodal, options=_run_options(args),
    ))
    if args.partition:
        state = "already written; nothing to do" if report.get("skipped") else (
            f"{report['leaves']} leaves, {report['output_bytes'] / GIB:.2f} GiB in {report['wall_seconds']:.1f}s; "
            f"peak RSS {report['peak_rss_bytes'] / GIB:.2f} GiB")
        print(f"{args.destination}: partition {args.partition}: {state}")
        return 0
    if report.get("skipped"):
        print(f"{args.destination}: already converted from this source with these options; nothing to do")
        return 0
    print(_done_line("converted", args.destination, report))
    return 0


def _done_line(verb: str, target: str, report: dict) -> str:
    """The one line a finished convert or export prints: size, family, wall, peak RSS, stages."""
    stages = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in report["stage_seconds"].items())
    return (f"{verb} {report['tensors']} tensors ({report['output_bytes'] / GIB:.2f} GiB, {report['family']}) "
            f"to {target} in {report['wall_seconds']:.1f}s; peak RSS {report['peak_rss_bytes'] / GIB:.2f} GiB; "
            f"CPU {report['cpu_seconds']:.1f}s; {stages}")


def _export(args: argparse.Namespace) -> int:
    from ckptconv.commands.export import ExportRequest, export

    report = export(ExportRequest(
        checkpoint=args.checkpoint, destination=args.destination, like=args.like, dtype=args.dtype,
        shard_size=args.shard_size, report=args.report, overwrite=args.overwrite, progress=args.progress,
        hf_token_file=args.hf_token_file, lora_alpha=args.lora_alpha, options=_run_options(args),
    ))
    hub = report.get("hub")
    if report.get("skipped"):
        where = f" (commit {hub['commit']})" if hub else ""
        print(f"{args.destination}: already exported from this checkpoint with these options{where}; nothing to do")
        return 0
    print(_done_line("exported", args.destination, report))
    if hub:
        rate = f" at {hub['upload_mib_per_s']} MiB/s" if hub["upload_mib_per_s"] else ""
        print(f"  committed {hub['commit']} on {hub['branch']} ({hub['files']} files, {hub['bytes'] / 2**20:.1f} MiB "
              f"hashed and uploaded in {hub['upload_seconds']:.1f}s{rate})")
    for note in report["not_exported"]:
        print(f"  note: {note['what']}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from ckptconv.commands.inspection import inspect_checkpoint, render_table
    from ckptconv.read.stored import read_back

    ahead, budget = _reads_ahead(args) if args.deep else (1, None)
    result = read_back(args.destination, lambda: inspect_checkpoint(args.destination, deep=args.deep, ahead=ahead,
                                                                    budget_bytes=budget))
    print(json.dumps(result, indent=2, allow_nan=False) if args.json else render_table(result))
    return 0 if result["complete"] else 1


def _verify(args: argparse.Namespace) -> int:
    if args.source is None:  # before the planner's imports, which only a comparison with SRC needs
        return _verify_integrity(args)
    from ckptconv.commands.verification import verify
    from ckptconv.read.stored import read_back

    options = _run_options(args)
    result = read_back(args.destination, lambda: verify(args.source, args.destination,
                                                       hf_token_file=args.hf_token_file,
                                                       progress=args.progress, options=options))
    return _print_checked(result, args.json)


def _print_checked(result, as_json: bool) -> int:
    """A check's result (``verify SRC DST``, ``restore-check``): JSON, or its first mismatches and its summary line;
    exit status 0 when every leaf matched, 1 otherwise."""
    if as_json:
        print(json.dumps(result.to_json(), indent=2, allow_nan=False))
    else:
        for mismatch in result.mismatches[:20]:
            print(f"  {mismatch}")
        print(result.summary())
    return 0 if result.ok else 1


def _reads_ahead(args: argparse.Namespace) -> tuple[int, int | None]:
    """(stored chunks a deep check (``inspect --deep``, ``verify DST``) may read and decode at once, the memory budget
    they must fit in): ``--workers`` where the command takes it, else as many as convert's default workers (one fewer
    than the cores); ``--memory-budget`` where it takes it, else convert's default share of the available memory.
    :func:`ckptconv.commands.inspection.chunks_in_flight` takes fewer where the checkpoint's chunks are large."""
    from ckptconv import host
    from ckptconv.plan.estimate import default_workers

    budget = getattr(args, "memory_budget", None)
    options = host.run_options(budget_bytes=None if budget is None else parse_size(budget, "--memory-budget"))
    return getattr(args, "workers", None) or default_workers(options.host_cores), options.budget_bytes


def _verify_integrity(args: argparse.Namespace) -> int:
    """``verify DST``: with no source to compare against, decode every stored chunk (each carries a crc32c)."""
    from ckptconv.commands.inspection import inspect_checkpoint
    from ckptconv.read.stored import read_back

    started = time.monotonic()
    ahead, budget = _reads_ahead(args)
    result = read_back(args.destination, lambda: inspect_checkpoint(args.destination, deep=True, ahead=ahead,
                                                                    budget_bytes=budget))
    ok = result["complete"]
    summary = (f"verify: {'OK' if ok else 'FAILED'}: {len(result['leaves'])} leaves, every stored chunk "
               f"{'decoded and matched its checksum' if ok else 'read'} in {time.monotonic() - started:.1f} s "
               "(no SRC given: the values were not compared with a source)")
    if args.json:
        print(json.dumps({"ok": ok, "destination": result["destination"], "leaves": len(result["leaves"]),
                          "mismatches": result["problems"], "compared_with_source": False}, indent=2, allow_nan=False))
    else:
        for problem in result["problems"][:20]:
            print(f"  {problem}")
        print(summary)
    return 0 if ok else 1


def _plan(args: argparse.Namespace) -> int:
    from ckptconv.commands.convert import ConvertRequest, plan_for, run_options
    from ckptconv.plan.estimate import plan_summary
    from ckptconv.read import open_source

    request = ConvertRequest(source=args.source, destination="", devices=args.devices, scan_layers=args.scan_layers,
                             dtype=args.dtype, hf_token_file=args.hf_token_file, lora=args.lora,
                             merge_lora=args.merge_lora, multimodal=args.multimodal, options=_run_options(args))
    plan, _ = plan_for(request, open_source(args.source, hf_token_file=args.hf_token_file))
    summary = plan_summary(plan, run_options(plan, request))
    if args.json:
        print(json.dumps(summary, indent=2, allow_nan=False))
    else:
        for key, value in summary.items():
            print(f"{key:>24}: {value}")
    return 0


def _restore_check(args: argparse.Namespace) -> int:
    from ckptconv import storage_failures
    from ckptconv.plan.devices import configure

    if args.cpu_devices:
        configure(args.cpu_devices)
    from ckptconv.commands.restore_check import restore_check

    with storage_failures.translated():
        result = restore_check(args.destination, source=args.source, hf_token_file=args.hf_token_file)
    return _print_checked(result, args.json)


COMMANDS = {"convert": _convert, "export": _export, "inspect": _inspect, "verify": _verify, "plan": _plan,
            "restore-check": _restore_check}
# Each command's path arguments and what they must be, checked before the command opens any of them.
LOCATIONS: dict[str, tuple[tuple[str, locations.Role], ...]] = {
    "convert": (("source", locations.SOURCE), ("destination", locations.OUTPUT), ("lora", locations.SOURCE)),
    "export": (("checkpoint", locations.CHECKPOINT), ("destination", locations.EXPORT_OUTPUT),
               ("like", locations.SOURCE)),
    "inspect": (("destination", locations.CHECKPOINT),),
    "verify": (("source", locations.SOURCE), ("destination", locations.CHECKPOINT)),
    "plan": (("source", locations.SOURCE), ("lora", locations.SOURCE)),
    "restore-check": (("destination", locations.CHECKPOINT), ("source", locations.SOURCE)),
}
