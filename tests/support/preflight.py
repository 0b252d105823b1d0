"""For ``pdstate check``'s tests: a DeepSeek-V4 ``config.json`` (Flash's own fields, changed as asked),
and the command run in this process (``run_check``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdstate.integrations.sglang.launch.model import builtin_flash_config
from pdstate.service import preflight


def model_config(tmp_path: Path, name: str = "model.json", *, nextn: bool = True, **changes) -> str:
    """The path of ``tmp_path / name``, written with DeepSeek-V4-Flash's built-in config fields
    (``launch.model.builtin_flash_config``) updated by ``changes``; ``nextn=False`` leaves out
    ``num_nextn_predict_layers`` (a stand-in config that names no NextN layer)."""
    cfg = builtin_flash_config()
    if not nextn:
        del cfg["num_nextn_predict_layers"]
    cfg.update(changes)
    path = Path(tmp_path) / name
    path.write_text(json.dumps(cfg))
    return str(path)


def run_check(argv: list[str], capsys) -> tuple[int, str, str]:
    """``pdstate check ARGV`` in this process: its exit status, stdout and stderr."""
    p = argparse.ArgumentParser()
    preflight.configure_check(p)
    args = p.parse_args(argv)
    rc = args.func(args)
    out = capsys.readouterr()
    return int(rc), out.out, out.err
