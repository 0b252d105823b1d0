"""Recipe files as operators keep them: both SGLang launches of a disaggregated deployment in one YAML.

The shape srt-slurm and Dynamo recipes use::

    model: {path: ...}
    backend:
      prefill_environment: {VAR: value, ...}
      decode_environment: {VAR: value, ...}
      sglang_config:
        prefill: {flag-name: value, ...}
        decode: {flag-name: value, ...}

(the whole mapping may sit under ``base:`` beside named overrides, which are not applied). Each
side's mapping becomes SGLang arguments the way those launchers write them: ``true`` is the bare
flag, ``false`` and null are left out, a list is the flag and its items, a mapping is JSON. The
model is ``model.path`` unless the side names its own ``model-path``; ``model.path`` (srt-slurm's model
alias, such as ``deepseek-v4-pro``) still names the model when the side's path (``/model/``) does not.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdstate.errors import SGLangArgsError
from pdstate.integrations.sglang.launch.command import Launch, load_yaml, read_text


def _flags(mapping: dict) -> list[str]:
    argv: list[str] = []
    for key, value in mapping.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def read_recipe(path: str) -> tuple[Launch, Launch]:
    """The prefill's and the decode's ``Launch`` from one recipe file."""
    p = Path(path)
    text = read_text(p, f"--recipe {path}")
    try:
        doc = load_yaml(text, f"--recipe {path}")
    except SGLangArgsError:
        raise
    except Exception as exc:  # yaml's errors
        raise SGLangArgsError(f"--recipe {path}: not YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise SGLangArgsError(f"--recipe {path}: expected a mapping")
    notes = []
    if "backend" not in doc and isinstance(doc.get("base"), dict):
        others = [k for k in doc if k != "base"]
        if others:
            notes.append(f"recipe overrides not applied: {', '.join(map(str, others))}")
        doc = doc["base"]
    backend = doc.get("backend") or {}
    config = backend.get("sglang_config") if isinstance(backend, dict) else None
    if (
        not isinstance(config, dict)
        or not isinstance(config.get("prefill"), dict)
        or not isinstance(config.get("decode"), dict)
    ):
        raise SGLangArgsError(f"--recipe {path}: no backend.sglang_config.prefill and .decode mappings")
    model = (doc.get("model") or {}).get("path") if isinstance(doc.get("model"), dict) else None
    launches = []
    for role in ("prefill", "decode"):
        side = dict(config[role])
        if model and not any(k in side for k in ("model-path", "model_path", "model")):
            side = {"model-path": model, **side}
        env = backend.get(f"{role}_environment") or {}
        launch = Launch(
            env={str(k): str(v) for k, v in env.items()},
            argv=_flags(side),
            entry=f"recipe {p.name} (backend.sglang_config.{role})",
            notes=list(notes),
            base_dir=p.parent,
            model_names=[str(model)] if model else [],
        )
        launches.append(launch)
    return launches[0], launches[1]


def predict_recipe(path: str, model_configs: tuple, releases: tuple):
    """Both sides of a recipe, predicted (``prediction.predict_launch``)."""
    from pdstate.integrations.sglang.launch.prediction import default_release, predict_launch

    sides = []
    for role, launch, cfg, rel in zip(("prefill", "decode"), read_recipe(path), model_configs, releases):
        release, why = (rel, "--sglang-version") if rel else default_release()
        sides.append(predict_launch(role, f"recipe {path}", launch, cfg, release, why))
    return tuple(sides)
