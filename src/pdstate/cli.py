"""``pdstate`` command line: demo | check | serve | probe | bench, and ``--version``.

This module only builds the parsers and dispatches; each command's body lives with its layer
(``devtools.demo``, ``service.preflight``, ``service.server``, ``service.probe``,
``devtools.bench_report``). Every command returns an ``ExitCode``; a ``ConfigError`` from any of
them exits ``ExitCode.CONFIG``, as argparse's own usage errors do. Logging is set up here, once
(``pdstate.logs``: ``--log-level``, ``--log-format`` and, for serve, ``--native-logs``).
Importing this module loads no torch: the commands that need it import it when they run.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys

from pdstate import logs
from pdstate.devtools import demo
from pdstate.errors import ConfigError, ExitCode
from pdstate.service import preflight, probe, probe_ranks, server
from pdstate.transfer.engines.registry import engine_names

ENGINES = engine_names(in_process=False)  # the engine registry's names that work between processes
MODES = ("paged", "unified")
PRESET_NAMES = ("tiny", "dsv4-flash")  # pools.presets.PRESETS' names (a test keeps them equal)
LOG_LEVELS = logs.LEVELS

EPILOG = (
    "exit status (every command): 0 ok; 1 the command ran and the answer is no (a check found "
    "problems, a transfer failed, a worker is not ready); 2 bad arguments or configuration; 3 the "
    "worker's own target/draft pair fails setup_state_kv_args; 4 the peer refused the handshake"
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default (a flag's as "off"), unless its help already says it in
    words or the option is required."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default:" in text or action.required:
            return text
        if action.nargs == 0 and action.const is True and action.default is False:  # store_true
            return f"{text} (default: off)"
        return super()._get_help_string(action)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {n}")
    return n


def _lengths(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if any(n < 0 for n in out):
        raise argparse.ArgumentTypeError(f"a prompt length is negative: {text!r}")
    return out


def _subset(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        out = [t for t in text.split(",") if t]
        bad = [t for t in out if t not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {text!r}")
        return out

    return parse


def _add_demo(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="run prefill and decode agents and verify a batch of transfers",
        description="Spawn N prefill and M decode agent processes (--prefills, --decodes; one and one by default), "
        "handshake between every pair, run a batch of requests of mixed lengths through a router in this process "
        "that picks each request's pair, and verify every one; prints a line per request (with its pair and full "
        "room id) and a summary table with per-pair counts.",
        epilog="exit status: 0 every request verified and no page leaked; 1 a request failed or leaked, or the "
        "pair did not start; 2 bad arguments",
    )
    d.add_argument("--engine", choices=ENGINES, default="shm", help="transfer engine moving the bytes")
    d.add_argument("--mode", choices=MODES, default="paged", help="pool layout: paged SWA or unified KV")
    d.add_argument("--preset", choices=PRESET_NAMES, default="dsv4-flash", help="pool layout preset of both workers")
    d.add_argument("--requests", type=_positive, default=24, metavar="N", help="number of requests in the batch")
    d.add_argument(
        "--tokens",
        type=_lengths,
        default=None,
        metavar="N,N,...",
        help="comma-separated prompt lengths, cycled over the requests (default: those of "
        f"{','.join(map(str, demo.DEMO_LENGTHS))} that fit the pool)",
    )
    d.add_argument("--concurrency", type=_positive, default=4, metavar="N", help="requests in flight at once")
    d.add_argument("--no-draft", action="store_true", help="run without the NextN draft pool")
    d.add_argument(
        "--prefills",
        type=_positive,
        default=1,
        metavar="N",
        help="prefill processes: the demo runs an N x M cluster of agents and a router",
    )
    d.add_argument("--decodes", type=_positive, default=1, metavar="M", help="decode processes (see --prefills)")
    d.add_argument(
        "--router",
        choices=demo.ROUTERS,
        default="least-loaded",
        help="how the cluster's router picks each request's (prefill, decode) pair: choose from "
        f"{', '.join(demo.ROUTERS)}; --concurrency caps the requests in flight per process",
    )
    d.add_argument("--json", action="store_true", help="print only one JSON summary object")
    d.set_defaults(func=demo.cmd_demo)


def _add_check(sub) -> None:
    c = sub.add_parser(
        "check",
        help="offline preflight: build layout reports from config files and compare",
        description="Build each config file's pools and layout report in this process (no worker needed), "
        "run the local target/draft check on each and, with two files, the pair's compatibility check.",
        epilog=EPILOG,
    )
    preflight.configure_check(c)
    _add_logging(c)


def _add_serve(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="run one worker (prefill or decode) with its HTTP endpoint",
        description="Run one worker (pools, engine, ZeroMQ control) and its HTTP API until SIGTERM/SIGINT; prints "
        'one JSON line {"event": "listening", ...} when the HTTP socket listens.',
        epilog="exit status: 0 stopped by SIGTERM/SIGINT; 1 the worker could not start (engine, bind, HTTP "
        "port); 2 bad arguments or configuration; 3 the worker's own target/draft pair fails "
        "setup_state_kv_args (with checks.local = true)",
    )
    s.add_argument("--config", required=True, metavar="FILE", help="worker config (TOML)")
    s.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="section.key=value",
        help="override one config key, repeatable; wins over PDSTATE_* environment and the file (default: none)",
    )
    _add_logging(s, native=True)
    s.set_defaults(func=server.cmd_serve)


def _add_logging(parser: argparse.ArgumentParser, native: bool = False) -> None:
    parser.add_argument("--log-level", default="warning", choices=LOG_LEVELS, help="log level (and uvicorn's)")
    parser.add_argument(
        "--log-format",
        default="text",
        choices=logs.FORMATS,
        help="log lines on stderr: text, or one JSON object per line",
    )
    if native:
        parser.add_argument(
            "--native-logs",
            default="levelled",
            choices=logs.NATIVE_MODES,
            help="native engines' own log lines on stderr (Mooncake's glog): levelled re-logs each at its level "
            "under pdstate.native (so --log-level and --log-format apply); raw shows them as written",
        )


def _add_probe(sub) -> None:
    p = sub.add_parser(
        "probe",
        help="query running workers' /v1/compat and /readyz; with two, check the pair; SGLang ranks: the pair matrix",
        description="GET /readyz and /v1/compat of each worker and print a readable report; with two URLs, post "
        "the first one's compat document to the second's /v1/compat/check.",
        epilog="exit status: 0 every worker ready and, with two, the pair compatible; 1 a worker unreachable or not "
        "ready, or the pair incompatible; 2 bad arguments (not one or two URLs; URLs and rank endpoints both). "
        f"SGLang ranks' {probe_ranks.VERDICT}",
    )
    p.add_argument(
        "urls", nargs="*", metavar="URL", help="pdstate serve worker's base URL, e.g. http://127.0.0.1:8101; one or two"
    )
    r = p.add_argument_group(
        "SGLang ranks",
        "the endpoints of SGLang ranks running backend pdstate (http.port + rank): print the pair matrix of "
        "decode and prefill ranks (accepted, refused with the factor, ready to pair or mismatched before any "
        "request, unreachable); exit 0 when every rank answered and every decode rank has an accepted prefill "
        "or one ready to pair",
    )
    r.add_argument("--ranks", nargs="+", metavar="URL", help="rank endpoints, any roles, e.g. http://10.0.0.5:30100")
    r.add_argument("--prefill", metavar="URL", help="the prefill's rank 0 endpoint (its http.port)")
    r.add_argument("--prefill-ranks", type=int, default=1, metavar="N", help="prefill ranks: ports + 0 .. N-1")
    r.add_argument("--decode", metavar="URL", help="the decode's rank 0 endpoint (its http.port)")
    r.add_argument("--decode-ranks", type=int, default=1, metavar="N", help="decode ranks: ports + 0 .. N-1")
    p.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="file holding the bearer token (the rules of auth.token_file: a regular file of this user, mode 0600 "
        "or 0400, at most 4 KiB); else PDSTATE_AUTH__TOKEN_FILE or PDSTATE_AUTH__TOKEN. The token shows "
        "incarnations; it goes only to the URLs given, never through a redirect",
    )
    p.add_argument(
        "--token",
        default=None,
        help="bearer token on the command line: visible to every user of this host in /proc (a warning); "
        "prefer --token-file or PDSTATE_AUTH__TOKEN",
    )
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="seconds per HTTP call")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    p.set_defaults(func=_probe, usage_error=p.error)


def _probe(args) -> ExitCode:
    """Serve workers' URLs (``service.probe``), or SGLang rank endpoints (``service.probe_ranks``);
    a wrong number of URLs is a usage error (argparse's: usage and the reason on stderr, exit 2)."""
    if args.ranks or args.prefill or args.decode:
        if args.urls:
            args.usage_error("give worker URLs or rank endpoints (--ranks, --prefill, --decode), not both")
        return probe_ranks.cmd_probe_ranks(args)
    if not 1 <= len(args.urls) <= 2:
        args.usage_error(
            f"give one or two worker URLs (got {len(args.urls)}), or rank endpoints (--ranks, --prefill, --decode)"
        )
    return probe.cmd_probe(args)


def _add_bench(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="measure pdstate against the in-process ceiling and the raw engines",
        description="Measure the dsv4-flash layout at 2k, 8k, 32k and 128k tokens: pdstate end to end against "
        "an in-process copy and the raw native engines, plus planner and control costs.",
        epilog="exit status: 0 measured and written; 1 a measurement failed; 2 bad arguments",
    )
    b.add_argument("--json", action="store_true", help="print no progress; the last line is one JSON object")
    b.add_argument("--out", default="bench-out", metavar="DIR", help="directory for bench.json and bench.png")
    b.add_argument("--quick", action="store_true", help="5 runs per variant instead of 9 (2-5 minutes here)")
    b.add_argument(
        "--engines",
        type=_subset(ENGINES),
        default=",".join(ENGINES),
        metavar="E,E,...",
        help=f"comma-separated engines out of {','.join(ENGINES)}; one not installed is skipped",
    )
    b.add_argument(
        "--modes",
        type=_subset(MODES),
        default=",".join(MODES),
        metavar="M,M,...",
        help=f"comma-separated pool modes out of {','.join(MODES)} (the native engines run paged only)",
    )
    b.add_argument(
        "--agent",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the agent phase: the agent (digests off and on) beside today's shm path and the ceiling",
    )
    b.add_argument(
        "--sglang",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the sglang phase: SGLang 0.5.19's own Mooncake backend against backend pdstate, per request "
        "(with --quick about 12 minutes a release on a loaded 2-core host; skipped, saying why, "
        "without make sglang-env's environment or Mooncake)",
    )
    b.set_defaults(func=_cmd_bench)


def _cmd_bench(args) -> ExitCode:
    from pdstate.devtools import bench  # torch and the pools: loaded once the command is known

    return bench.cmd_bench(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdstate",
        description="pdstate: move a DeepSeek-V4 request's state from a prefill worker to a decode worker.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    # every command's parser formats its help the same way (defaults shown, text kept)
    sub = p.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        parser_class=functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter),
    )
    for add in (_add_demo, _add_check, _add_serve, _add_probe, _add_bench):
        add(sub)
    return p


def version() -> str:
    """The installed distribution's version (package metadata), else ``pdstate.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("pdstate")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from pdstate import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(getattr(args, "log_level", "warning"), getattr(args, "log_format", "text"))
    native = logs.NativeLogs(args.native_logs) if getattr(args, "native_logs", "raw") != "raw" else None
    if native is not None:
        native.start()
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at exit
        return rc
    except ConfigError as exc:
        print(f"pdstate: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    except BrokenPipeError:
        # The reader went away (`pdstate check ... | head`): no traceback, and no second
        # BrokenPipeError when the interpreter flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # the shell's status for a process ended by a closed pipe
    finally:
        if native is not None:
            native.close()


if __name__ == "__main__":
    raise SystemExit(main())
