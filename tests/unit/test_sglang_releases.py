"""The table of SGLang releases (``pdstate.integrations.sglang.releases``).

Its rows agree with the files each release needs (its argument table, its environment in the lock
and the Makefile), and a release added as one row is seen end to end without SGLang: a fake
release (0.5.23's traits under a made-up version, with its own argument table) is a
``--sglang-version`` of ``pdstate check --sglang``, which reads launches with its parser and
predicts their layout; the backend's plugin accepts it as a tested release; the CLI's help, the
errors and the drivers name it."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdstate import cli
from pdstate.integrations.sglang import plugin, releases
from pdstate.integrations.sglang.launch import argtable
from pdstate.integrations.sglang.launch.prediction import default_release, predict
from tests.support.paths import REPO

FAKE = "0.5.99"
SPEC = "--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
MODEL = "--model-path deepseek-ai/DeepSeek-V4-Flash --trust-remote-code --tp 8"
PREFILL = f"{MODEL} --disaggregation-mode prefill {SPEC}"
DECODE = f"{MODEL} --disaggregation-mode decode --dp 8 --enable-dp-attention {SPEC}"


@pytest.fixture
def fake_release(tmp_path, monkeypatch) -> releases.SGLangRelease:
    """A row for ``FAKE``: 0.5.23's traits, with its own argument table (0.5.23's, relabelled)."""
    base = releases.row("0.5.23")
    table = json.loads(base.args_path.read_text())
    table["release"] = FAKE
    path = tmp_path / f"args-{FAKE}.json"
    path.write_text(json.dumps(table))
    row = dataclasses.replace(base, version=FAKE, args_file=str(path))
    monkeypatch.setattr(releases, "RELEASES", (*releases.RELEASES, row))
    yield row
    for cached in (argtable.table, argtable.parser, argtable.store_true_dests):
        cached.cache_clear()


def pdstate(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return int(rc), out.out + out.err


# --- the table and the files beside it -----------------------------------------------------------


def test_the_rows_are_oldest_first_and_their_pools_are_pdstates():
    from pdstate.pools.dsv4 import UPSTREAM_RELEASES

    versions = releases.versions()
    assert versions == ("0.5.19", "0.5.23")
    assert [releases.version_tuple(v) for v in versions] == sorted({releases.version_tuple(v) for v in versions})
    assert all(r.pools in UPSTREAM_RELEASES for r in releases.RELEASES)
    assert releases.newest().version == "0.5.23"
    assert releases.spelled() == "0.5.19 and 0.5.23"


def test_each_release_has_its_argument_table():
    for r in releases.RELEASES:
        assert r.args_path == REPO / "src/pdstate/integrations/sglang/launch" / f"args-{r.version}.json"
        assert json.loads(r.args_path.read_text())["release"] == r.version


def test_each_release_has_its_environment():
    """One row is the lock's own sglang line; ``make sglang-env`` builds every row's environment."""
    lock = (REPO / "tools/sglang-env.txt").read_text()
    assert re.findall(r"^sglang==(\S+)$", lock, re.M) == [releases.in_lock().version]
    assert [r.version for r in releases.RELEASES if r.in_lock] == [releases.in_lock().version]
    makefile = (REPO / "Makefile").read_text()
    built = re.findall(r"^\t-bash tools/sglang_env\.sh \$\(PY\) \$\(VENV\)/(\S+)(?: (\S+))?$", makefile, re.M)
    assert built == [(r.env_dir, r.env_version or "") for r in releases.RELEASES]
    assert [r.env_dir for r in releases.RELEASES] == ["sglang-env", "sglang-env-0.5.23"]


def test_the_table_imports_without_torch_or_sglang():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['sglang'] = None; "
        "import pdstate.integrations.sglang.releases as r; assert r.versions()"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_running_sglang_follows_its_release_or_the_one_before():
    assert releases.nearest("0.5.23").version == "0.5.23"
    assert releases.nearest("0.5.23.post1").version == "0.5.23"
    assert releases.nearest("0.5.21").version == "0.5.19"
    assert releases.nearest("0.5.18").version == "0.5.19"
    assert releases.nearest("0.6.0").version == "0.5.23"


def test_an_unknown_release_is_refused_naming_the_table():
    with pytest.raises(Exception, match=r"^SGLang 0\.5\.20: pdstate models SGLang 0\.5\.19 and 0\.5\.23$"):
        releases.row("0.5.20")
    assert releases.pool_rules("0.5.20") == "0.5.20"  # left for the pool model to refuse in its words


# --- a new release as one row, end to end ----------------------------------------------------------


def test_check_accepts_a_launch_on_the_new_release(fake_release, capsys):
    rc, out = pdstate(capsys, "check", "--sglang", PREFILL, DECODE, "--sglang-version", FAKE)
    assert rc == 0, out
    assert out.splitlines()[-1] == "compatible"
    assert f"SGLang {FAKE} (--sglang-version)" in out


def test_check_predicts_the_new_releases_layout_with_its_pool_rules(fake_release, capsys):
    new = predict("decode", DECODE, release=FAKE)
    old = predict("decode", DECODE, release="0.5.23")
    assert (new.release, new.release_source) == (FAKE, "--sglang-version")
    assert new.pool_settings().upstream == "0.5.23"  # its row's pools
    assert new.pool_settings() == old.pool_settings()
    # a mismatch is refused as on 0.5.23, word for word
    nospec = f"{MODEL} --disaggregation-mode decode"
    rc_new, out_new = pdstate(capsys, "check", "--sglang", PREFILL, nospec, "--sglang-version", FAKE)
    rc_old, out_old = pdstate(capsys, "check", "--sglang", PREFILL, nospec, "--sglang-version", "0.5.23")
    assert rc_new == rc_old == 1
    assert out_new.replace(FAKE, "0.5.23") == out_old


def test_the_new_releases_parser_reads_its_own_table(fake_release):
    assert argtable.table(FAKE)["release"] == FAKE
    assert argtable.parse(["--tp", "8"], FAKE).values == {"tp_size": 8}


def test_check_defaults_to_the_new_release_when_it_is_installed(fake_release, monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda name: FAKE if name == "sglang" else "0")
    assert default_release() == (FAKE, "the installed SGLang")


def test_the_cli_and_its_errors_name_the_new_release(fake_release, capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert f"runs, 0.5.19 or 0.5.23 or {FAKE} (once: both sides;" in helptext
    rc, out = pdstate(capsys, "check", "--sglang", PREFILL, DECODE, "--sglang-version", "0.5.20")
    assert rc == 2
    assert out.strip() == f"pdstate check: --sglang-version 0.5.20: pdstate models SGLang 0.5.19, 0.5.23 and {FAKE}"


def test_the_backends_release_check_accepts_the_new_release(fake_release, monkeypatch, caplog):
    installs = []
    monkeypatch.setattr(plugin, "install", lambda: installs.append(True))
    monkeypatch.setattr(plugin, "sglang_release", lambda: FAKE)
    with caplog.at_level(logging.WARNING, logger="pdstate.integrations.sglang"):
        plugin.load()
    assert installs == [True] and caplog.records == []
    monkeypatch.setattr(plugin, "sglang_release", lambda: "0.5.98")
    with caplog.at_level(logging.WARNING, logger="pdstate.integrations.sglang"):
        plugin.load()
    assert [r.getMessage() for r in caplog.records] == [
        "pdstate: SGLang 0.5.98 is not a release pdstate is tested with (0.5.19, 0.5.23, 0.5.99); "
        "registering backend pdstate anyway"
    ]


def test_the_drivers_know_the_new_releases_environment_and_table(fake_release, monkeypatch):
    from pdstate.devtools import sglang_args
    from pdstate.devtools.sglang_pair import pair

    monkeypatch.delenv("PDSTATE_SGLANG_ENV", raising=False)
    assert pair.env_dir(FAKE) == Path(sys.prefix) / f"sglang-env-{FAKE}"
    assert sglang_args.data_path(FAKE) == fake_release.args_path
    assert releases.nearest(f"{FAKE}.post1") is fake_release


def test_a_release_refusing_what_a_later_one_allows_names_that_release(fake_release, capsys):
    """A decode radix cache with EAGLE: 0.5.19's row allows no algorithm, and its refusal names the
    first release whose row allows EAGLE; the new release allows it, as 0.5.23 does."""
    radix = DECODE.replace("--dp 8 --enable-dp-attention", "--disaggregation-decode-enable-radix-cache")
    rc, out = pdstate(capsys, "check", "--sglang", PREFILL, radix, "--sglang-version", "0.5.19")
    assert rc == 1
    assert (
        "- the decode: SGLang would not start: ValueError: --disaggregation-decode-enable-radix-cache is "
        "incompatible with speculative decoding (--speculative-algorithm EAGLE; SGLang 0.5.19 allows EAGLE and "
        "DSPARK from 0.5.23)\n"
    ) in out
    rc, out = pdstate(capsys, "check", "--sglang", PREFILL, radix, "--sglang-version", FAKE)
    assert rc == 0, out
