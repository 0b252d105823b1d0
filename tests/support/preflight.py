"""A DeepSeek-V4 ``config.json`` for ``pdstate check``'s tests: Flash's own fields, changed as asked."""

from __future__ import annotations

import json
from pathlib import Path

from pdstate.integrations.sglang.launch.model import builtin_flash_config


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
