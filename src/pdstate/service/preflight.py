"""``pdstate check``: offline preflight of a prefill/decode pair, before anything is started.

- ``pdstate check PREFILL.toml DECODE.toml`` (or one file): build each worker's layout report
  from its pdstate config (``--set`` applies to both) and run the handshake's checks on the pair;
  each problem is printed with a ``fix:`` line naming the config key and the side
  (``pdstate.protocol.fixes``).
- ``pdstate check --sglang PREFILL DECODE``: each argument is one SGLang launch (a quoted string of
  arguments, ``@path``, or ``http://host:port`` of a running server); pdstate predicts what each
  SGLang server builds (a release of ``integrations.sglang.releases``, ``--sglang-version``),
  builds the same layout with its own pool model and runs the same checks. It prints "compatible",
  or every differing factor with both values, what goes wrong at run time if the pair is launched
  anyway, and the SGLang flag to change on which side. Arguments it does not model are listed.
  That modelling lives beside the SGLang backend, in ``pdstate.integrations.sglang.launch``
  (torch-free), imported only here and only for ``--sglang`` (the table of releases also for
  ``--sglang-version``'s help).

Exit status (``pdstate.errors.ExitCode``): 0 compatible, 1 problems found (``--strict``: also
a setting unknown to SGLang's own parser), 2 unreadable input or configuration.
"""

from __future__ import annotations

import argparse
import sys

from pdstate.errors import ConfigError, ExitCode


def preset_layouts() -> dict[str, list[int]]:
    """The presets' target layer layouts by name (what a ``compression_ratios`` factor reports)."""
    from pdstate.pools.presets import PRESETS

    return {
        f"preset {name!r}": list(s.compression_ratios[s.start_layer : s.start_layer + s.layer_num])
        for name, s in PRESETS.items()
    }


def _report_for(path, overrides=()):
    from pdstate.pools.presets import build_worker_pools
    from pdstate.pools.reporting import build_report
    from pdstate.settings.config import load_config

    cfg = load_config(path, overrides)
    pools = build_worker_pools(cfg.pool_settings())
    try:
        report, _ = build_report(pools.target, pools.draft)
    finally:
        pools.close()
    return cfg, report


def check_configs(paths: list[str], overrides: list[str]) -> int:
    from pdstate.protocol.compat import compat_errors
    from pdstate.protocol.fixes import fix_line, summarize

    loaded = [_report_for(p, overrides) for p in paths]
    problems = []
    for path, (cfg, report) in zip(paths, loaded):
        print(f"{path}: role={cfg.role} preset={cfg.preset} fingerprint={report.fingerprint}")
        if not report.local_check.ok:
            problems.append((path, report.local_check.error.type, report.local_check.error.message))
    if len(loaded) == 2:
        (c1, r1), (c2, r2) = loaded
        if c1.transfer.engine != c2.transfer.engine:
            prefill, decode = (c1, c2) if c1.role == "prefill" else (c2, c1)
            problems.append(
                (
                    "pair",
                    "EngineError",
                    f"transfer engine mismatch: prefill server uses {prefill.transfer.engine!r}, "
                    f"but decode server uses {decode.transfer.engine!r}",
                )
            )
        if c1.role == c2.role:
            problems.append(
                ("pair", "RoleMismatch", f"both workers are {c1.role} workers: a prefill pairs with a decode")
            )
        for e in compat_errors(r1, r2, c1.role):
            if not any(e.message == m for _, _, m in problems):
                problems.append(("pair", e.type, e.message))
    if not problems:
        print("compatible" if len(loaded) == 2 else "ok")
        return ExitCode.OK
    layouts = preset_layouts()
    for where, typ, msg in problems:
        print(f"{where}: {typ}: {summarize(typ, msg, layouts)}", file=sys.stderr)
        fix = fix_line(typ, msg, layouts)
        if fix:
            print(f"  {fix}", file=sys.stderr)
    return ExitCode.FAILED


def check_sglang(
    prefill: str | None,
    decode: str | None,
    model_configs: list[str],
    strict: bool,
    timeout_s: float,
    releases: list[str] | None = None,
    recipe: str | None = None,
    verbose: bool = False,
    width: int | None = None,
) -> int:
    from pdstate.integrations.sglang import releases as sglang_releases
    from pdstate.integrations.sglang.launch.comparison import compare, render, wrap
    from pdstate.integrations.sglang.launch.prediction import predict

    if len(model_configs) > 2:
        raise ConfigError("--model-config: give it once (both sides) or twice (prefill, then decode)")
    releases = releases or []
    if len(releases) > 2:
        raise ConfigError("--sglang-version: give it once (both sides) or twice (prefill, then decode)")
    for r in releases:
        if sglang_releases.find(r) is None:
            raise ConfigError(f"--sglang-version {r}: pdstate models SGLang {sglang_releases.spelled()}")
    p_cfg = model_configs[0] if model_configs else None
    d_cfg = model_configs[-1] if model_configs else None
    p_rel = releases[0] if releases else None
    d_rel = releases[-1] if releases else None
    if recipe is not None:
        from pdstate.integrations.sglang.launch.recipe import predict_recipe

        sides = predict_recipe(recipe, (p_cfg, d_cfg), (p_rel, d_rel))
    else:
        sides = (
            predict("prefill", prefill, p_cfg, timeout_s, release=p_rel),
            predict("decode", decode, d_cfg, timeout_s, release=d_rel),
        )
    from pdstate.integrations.sglang.launch.model import FLASH, PRO, builtin_flash_config, builtin_pro_config

    builtin = {name: cfg() for name, cfg in ((FLASH, builtin_flash_config), (PRO, builtin_pro_config))}
    layouts = {name: c["compress_ratios"][: c["num_hidden_layers"]] for name, c in builtin.items()}
    layouts.update(preset_layouts())
    text, ok = render(compare(*sides), strict=strict, layouts=layouts, verbose=verbose)
    print(wrap(text, width))
    return ExitCode.OK if ok else ExitCode.FAILED


def _width(given: int | None) -> int | None:
    """The columns to fold the report to: ``--width``, else the terminal's when printing to one."""
    if given is not None:
        return given if given > 0 else None
    if sys.stdout.isatty():
        import shutil

        return shutil.get_terminal_size().columns
    return None


def cmd_check(args) -> int:
    try:
        recipe = getattr(args, "recipe", None)
        if args.sglang or recipe:
            if args.configs:
                raise ConfigError("give either config files or --sglang PREFILL DECODE / --recipe FILE, not both")
            if args.sglang and recipe:
                raise ConfigError("give either --sglang PREFILL DECODE or --recipe FILE, not both")
            prefill, decode = args.sglang or (None, None)
            return check_sglang(
                prefill,
                decode,
                args.model_config,
                args.strict,
                args.timeout,
                getattr(args, "sglang_release", None),
                recipe=recipe,
                verbose=getattr(args, "verbose", False),
                width=_width(getattr(args, "width", None)),
            )
        if not args.configs:
            raise ConfigError("nothing to check: give one or two config files, or --sglang PREFILL DECODE")
        if len(args.configs) > 2:
            raise ConfigError(f"give one or two config files, not {len(args.configs)}")
        return check_configs(args.configs, args.set)
    except ConfigError as exc:
        print(f"pdstate check: {exc}", file=sys.stderr)
        return ExitCode.CONFIG


def configure_check(c: argparse.ArgumentParser) -> None:
    from pdstate.integrations.sglang import releases

    """The ``check`` subcommand's arguments (``c`` is its argparse parser, made by ``cli``)."""
    c.description = (
        "Offline preflight of a prefill/decode pair: two pdstate config files, or two SGLang launches "
        "(--sglang). Exit 0 compatible, 1 problems found, 2 unreadable input."
    )
    c.add_argument("configs", nargs="*", metavar="CONFIG", help="pdstate worker config files (prefill, decode)")
    c.add_argument(
        "--set", action="append", default=[], metavar="section.key=value", help="override a config key on both"
    )
    c.add_argument(
        "--sglang",
        nargs=2,
        metavar=("PREFILL", "DECODE"),
        help="two SGLang launches, each a quoted argument string (VAR=value tokens first), @file or "
        "http://host:port of a running server (a lone --flag=value needs a leading space)",
    )
    c.add_argument(
        "--model-config",
        action="append",
        default=[],
        metavar="PATH",
        help="the model's config.json for --sglang (once: both sides; twice: prefill, decode); "
        "DeepSeek-V4-Flash and -Pro are built in",
    )
    c.add_argument(
        "--recipe",
        metavar="FILE",
        help="a recipe YAML holding both launches (backend.sglang_config.prefill/decode with "
        "prefill_environment/decode_environment, as srt-slurm and Dynamo recipes keep them)",
    )
    c.add_argument(
        "--sglang-version",
        "--sglang-release",
        dest="sglang_release",
        action="append",
        default=[],
        metavar="VERSION",
        help=f"the SGLang release each --sglang side runs, {' or '.join(releases.versions())} (once: both sides; "
        "twice: prefill, decode); a running server says its own; default the installed SGLang's, else the newest",
    )
    c.add_argument(
        "--strict", action="store_true", help="--sglang: fail when a setting is unknown to SGLang's own parser"
    )
    c.add_argument("--verbose", action="store_true", help="--sglang: list the settings that do not affect the layout")
    c.add_argument(
        "--width",
        type=int,
        metavar="COLUMNS",
        help="--sglang: fold the report to COLUMNS (default: the terminal's width on a terminal, else no folding; 0: none)",
    )
    c.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP request (http:// launches)")
    c.set_defaults(func=cmd_check)
