"""The ``pdstate`` command line: every option of every subcommand is described (choices and default
shown), usage errors and configuration errors exit ``ExitCode.CONFIG``, the demo prints full room
ids, and importing the CLI loads no torch."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdstate import cli
from pdstate.devtools import demo
from pdstate.errors import ExitCode
from tests.support.bench import fake_bench_result


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_every_command_is_registered_in_the_cli():
    assert set(subparsers()) == {"demo", "check", "serve", "probe", "bench"}
    for name, p in subparsers().items():
        assert callable(p.get_default("func")), name


# ``check``'s arguments are added by ``service.preflight.configure_check``: its help texts come
# with that module (drop this mark once they are there).


@pytest.mark.parametrize("command", ["demo", "check", "serve", "probe", "bench"])
def test_every_option_has_help_choices_and_default(command):
    p = subparsers()[command]
    text = flat(p.format_help())
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and action.help.strip(), f"pdstate {command} {name}: no help text"
        for choice in action.choices or ():
            assert str(choice) in text, f"pdstate {command} {name}: choice {choice!r} not shown"
        if action.option_strings and not action.required:
            assert "default:" in flat(p._get_formatter()._get_help_string(action)), f"{command} {name}: no default"
    assert p.epilog and "exit status" in p.epilog


def test_top_level_help_lists_every_command_and_the_exit_codes():
    text = flat(cli.build_parser().format_help())
    for name in subparsers():
        assert name in text
    for code in ExitCode:
        assert f"{code.value} " in text


def test_preset_choices_are_the_presets():
    from pdstate.pools.presets import PRESETS

    assert set(cli.PRESET_NAMES) == set(PRESETS)


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--tokens", "1,x"],
        ["demo", "--concurrency", "0"],
        ["demo", "--engine", "tcp"],
        ["bench", "--engines", "shm,foo"],
        ["bench", "--modes", ""],
        ["nosuchcommand"],
    ],
)
def test_usage_errors_exit_config(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == ExitCode.CONFIG


def test_parsed_lists():
    args = cli.build_parser().parse_args(["bench", "--engines", "shm", "--modes", "paged,unified"])
    assert args.engines == ["shm"] and args.modes == ["paged", "unified"]
    assert cli.build_parser().parse_args(["bench"]).engines == list(cli.ENGINES)
    assert cli.build_parser().parse_args(["demo", "--tokens", "100,4096"]).tokens == [100, 4096]
    assert cli.build_parser().parse_args(["demo"]).tokens is None


def test_a_config_error_exits_config(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('role = "prefill"\n[nosuchsection]\nkey = 1\n')
    assert cli.main(["serve", "--config", str(bad)]) == ExitCode.CONFIG
    assert capsys.readouterr().err.startswith("pdstate: ")


def test_demo_prints_the_full_room_id():
    room = (1 << 63) - 1
    ev = {"room": room, "seq_len": 300, "bytes": 1_300_000, "seconds": 0.0042, "verified": True, "error": None}
    line = demo.progress_line(3, 24, ev)
    assert f"room {room} " in line and line.rstrip().endswith("ok")


def test_importing_the_cli_loads_no_torch():
    code = (
        "import sys; import pdstate.cli; "
        "heavy = [m for m in ('torch', 'numpy', 'zmq', 'fastapi', 'uvicorn') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_command_writes_its_files_and_ends_with_the_summary(tmp_path, monkeypatch, capsys):
    import json

    from pdstate.devtools import bench

    fake = fake_bench_result(
        paths={"paged:agent:agent_shm": {"2048": {"gbps": {"median": 2.0, "min": 1.0, "max": 3.0}}}},
        ratios={"shm_vs_ceiling": 0.8},
    )
    seen = {}

    def run_bench(quick, engines, modes, progress, agent=True, sglang=True):
        seen.update(quick=quick, engines=engines, modes=modes, agent=agent, sglang=sglang)
        return fake

    monkeypatch.setattr(bench, "run_bench", run_bench)
    monkeypatch.setattr("pdstate.worker.base.tune_interpreter", lambda: None)  # this process's switch interval
    assert cli.main(["bench", "--quick", "--engines", "shm", "--modes", "paged", "--out", str(tmp_path)]) == ExitCode.OK
    assert seen == {"quick": True, "engines": ["shm"], "modes": ["paged"], "agent": True, "sglang": True}
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("paged:agent:agent_shm") and "2.00" in line for line in lines)
    assert json.loads(lines[-1])["ratios"]["shm_vs_ceiling"] == 0.8
    assert json.loads((tmp_path / "bench.json").read_text()) == fake
    assert cli.main(["bench", "--json", "--no-agent", "--engines", "shm", "--out", str(tmp_path)]) == ExitCode.OK
    assert seen["agent"] is False
    assert cli.main(["bench", "--json", "--no-sglang", "--engines", "shm", "--out", str(tmp_path)]) == ExitCode.OK
    assert seen["sglang"] is False


def test_version_prints_the_package_version():
    import pdstate

    done = subprocess.run(
        [sys.executable, "-m", "pdstate.cli", "--version"], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == f"pdstate {pdstate.__version__}" == f"pdstate {cli.version()}"


@pytest.mark.parametrize("command", ["serve", "check"])
def test_serve_and_check_take_a_log_format(command):
    p = subparsers()[command]
    extra = ["--config", "x.toml"] if command == "serve" else []
    args = p.parse_args([*extra, "--log-format", "json", "--log-level", "info"])
    assert (args.log_format, args.log_level) == ("json", "info")
    assert p.parse_args(extra).log_format == "text"


def test_check_warns_once_about_a_stray_variable_in_json_and_still_checks():
    import json
    import os

    from tests.support.paths import REPO

    env = {**os.environ, "PDSTATE_ENGINE": "mooncake", "PDSTATE_AUTH_TOKEN": "x"}
    configs = [str(REPO / "services" / role / "config.toml") for role in ("prefill", "decode")]
    done = subprocess.run(
        [sys.executable, "-m", "pdstate.cli", "check", *configs, "--log-format", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == ExitCode.OK, done.stderr
    assert done.stdout.splitlines()[-1] == "compatible"
    warnings = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(w["level"], w["logger"]) for w in warnings] == [("warning", "pdstate.config")] * 2
    assert "PDSTATE_AUTH_TOKEN" in warnings[0]["msg"] and "did you mean PDSTATE_AUTH__TOKEN?" in warnings[0]["msg"]
    assert "PDSTATE_ENGINE" in warnings[1]["msg"] and "did you mean PDSTATE_TRANSFER__ENGINE?" in warnings[1]["msg"]


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback():
    """``pdstate check ... | head -0``: the pipe is closed before anything is written."""
    import os

    from tests.support.paths import REPO

    recipes = REPO / "tests/preflight/recipes"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdstate.cli",
                "check",
                "--sglang",
                f"@{recipes / 'sglang-ci-dsv4-prefill.sh'}",
                f"@{recipes / 'sglang-ci-dsv4-decode.sh'}",
                "--sglang-version",
                "0.5.19",
                "--verbose",
            ],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""
