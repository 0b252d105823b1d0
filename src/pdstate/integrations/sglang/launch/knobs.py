"""The SGLang settings ("knobs") that shape a DSV4 server's transferred state, the layout factors
each one moves, how each side shows it, and the flag to change on which side when the two differ.
``comparison`` groups a pair's differing factors under these (``knobs()``).

A setting that moves several factors (speculative decoding: the rings, the draft, the components)
is a knob written here. A layout factor that one launch setting of its own sets (its registry entry
names the ServerArgs field, ``launch``, and the flag, ``flag``: ``pdstate.protocol.factors``) is a
knob made from its entry, with the entry's fix in SGLang's words."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdstate.integrations.sglang.launch.side import SGLangSide
from pdstate.protocol import factors
from pdstate.protocol.factor_texts import SGLANG_SETTINGS
from pdstate.protocol.fixes import count_layers


@dataclass(frozen=True)
class Knob:
    name: str
    heading: str  # the flag / variable / config field an operator changes
    factors: tuple[str, ...]  # layout factors it can move
    value: Callable[[SGLangSide], Any]
    show: Callable[[SGLangSide], str]
    fix: Callable[[SGLangSide, SGLangSide], str]


def _has(p: SGLangSide, d: SGLangSide, pred: Callable[[SGLangSide], bool]) -> tuple[SGLangSide, SGLangSide]:
    """(the side where ``pred`` holds, the other)."""
    return (p, d) if pred(p) else (d, p)


def _spec_show(s: SGLangSide) -> str:
    if not s.speculative:
        return "off"
    return f"{s.speculative_algorithm} ({s.speculative_num_steps} steps, {s.speculative_num_draft_tokens} draft tokens)"


def _spec_fix(p: SGLangSide, d: SGLangSide) -> str:
    on, off = _has(p, d, lambda s: s.speculative)
    return f"add `{on.spec_flags()}` to the {off.role} (or remove the --speculative-* flags from the {on.role})"


def _steps_fix(p: SGLangSide, d: SGLangSide) -> str:
    return (
        f"set `--speculative-num-steps {p.speculative_num_steps}` on the decode to match the prefill, or "
        f"`--speculative-num-steps {d.speculative_num_steps}` on the prefill (draft tokens = steps + 1 with topk 1)"
    )


def _env_fix(var: str, value: str, pred: Callable[[SGLangSide], bool], extra: str = "") -> Callable:
    def fix(p: SGLangSide, d: SGLangSide) -> str:
        on, off = _has(p, d, pred)
        return f"set {var}={value} on the {off.role} too{extra} (or unset it on the {on.role})"

    return fix


def _online_fix(p: SGLangSide, d: SGLangSide) -> str:
    on, off = _has(p, d, lambda s: s.online_c128)
    mtp = " with SGLANG_EXPERIMENTAL_ONLINE_C128_MTP=1" if off.speculative else ""
    return f"set SGLANG_OPT_USE_ONLINE_COMPRESS=1 on the {off.role} too{mtp} (or unset it on the {on.role})"


def _window_fix(p: SGLangSide, d: SGLangSide) -> str:
    flag = "--json-model-override-args"
    overridden = [s for s in (p, d) if s.window_source.startswith(flag)]
    if len(overridden) == 1:
        o = overridden[0]
        other = d if o is p else p
        return (
            f'remove "sliding_window" from {flag} on the {o.role} (or give the {other.role} the same '
            f"{flag} '{{\"sliding_window\": {o.sliding_window}}}')"
        )
    if len(overridden) == 2:
        return f'give the same "sliding_window" in {flag} on both sides'
    return (
        f"serve one model config on both sides: sliding_window {p.sliding_window} ({p.window_source}) vs "
        f"{d.sliding_window} ({d.window_source}); --model-path / --model-config"
    )


def _layers_fix(p: SGLangSide, d: SGLangSide) -> str:
    return (
        "serve the same model on both sides (its config.json compress_ratios and num_hidden_layers): "
        f"prefill {p.layout_source}, decode {d.layout_source}; --model-path / --model-config"
    )


def _page_fix(p: SGLangSide, d: SGLangSide) -> str:
    return (
        f"run both sides with one page size (--page-size; SGLang 0.5.19 runs DSV4 on CUDA at 256): "
        f"prefill {p.page_size}, decode {d.page_size}"
    )


def _kv_fix(p: SGLangSide, d: SGLangSide) -> str:
    fp8 = [s for s in (p, d) if s.kv_cache_dtype == "fp8_e4m3"]
    if len(fp8) == 1:
        other = d if fp8[0] is p else p
        return f"set `--kv-cache-dtype fp8_e4m3` (or auto) on the {other.role} (it has {other.kv_cache_dtype})"
    return f"set one --kv-cache-dtype on both sides (prefill {p.kv_cache_dtype}, decode {d.kv_cache_dtype})"


def _state_fix(p: SGLangSide, d: SGLangSide) -> str:
    return (
        f"set SGLANG_DSV4_COMPRESS_STATE_DTYPE to one value on both sides "
        f"(prefill {p.state_dtype}, decode {d.state_dtype}; unset means float32)"
    )


# The settings that move several factors, in the order a report lists them (the factors' own
# launch settings go before the last, ``knobs``): headings and factors from ``SGLANG_SETTINGS``,
# the table an SGLang rank's fix lines read too.
SETTINGS: tuple[Knob, ...] = tuple(
    Knob(name, *SGLANG_SETTINGS[name], value, show, fix)
    for name, value, show, fix in (
        ("layers", lambda s: tuple(s.stage_ratios), lambda s: f"{count_layers(s.stage_ratios)} ({s.layout_source})", _layers_fix),
        ("page_size", lambda s: s.page_size, lambda s: str(s.page_size), _page_fix),
        ("kv_cache_dtype", lambda s: s.kv_cache_dtype, lambda s: s.kv_cache_dtype, _kv_fix),
        (
            "unified_kv",
            lambda s: s.unified_kv,
            lambda s: "unified" if s.unified_kv else "paged",
            _env_fix("SGLANG_HACK_FLASHMLA_BACKEND", "unified_kv_triton", lambda s: s.unified_kv),
        ),
        ("online_c128", lambda s: s.online_c128, lambda s: "on" if s.online_c128 else "off", _online_fix),
        ("speculative", lambda s: s.speculative, _spec_show, _spec_fix),
        ("draft_tokens", lambda s: s.speculative_num_draft_tokens if s.speculative else None, _spec_show, _steps_fix),
        ("sliding_window", lambda s: s.sliding_window, lambda s: f"{s.sliding_window} ({s.window_source})", _window_fix),
        ("state_dtype", lambda s: s.state_dtype, lambda s: s.state_dtype, _state_fix),
    )
)  # fmt: skip


def factor_knob(entry: factors.Factor) -> Knob:
    """The knob of a layout factor one launch setting of its own sets (``entry.launch``)."""

    def value(s: SGLangSide) -> Any:
        return s.setting(entry.name)

    def fix(p: SGLangSide, d: SGLangSide) -> str:
        if entry.sglang_fix is None:
            return f"set {entry.flag} to one value on both sides (prefill {value(p)}, decode {value(d)})"
        return entry.sglang_fix(value(p), value(d))

    return Knob(
        entry.name,
        entry.flag or f"--{entry.launch.replace('_', '-')}",
        (entry.name,),
        value,
        lambda s: str(value(s)),
        fix,
    )


def knobs() -> tuple[Knob, ...]:
    """Every knob, in the order a report lists them: the settings (``SETTINGS``), with the knob of
    each factor a launch setting of its own sets before the last (the state dtype)."""
    own = tuple(factor_knob(f) for f in factors.FACTORS.values() if f.launch)
    return SETTINGS[:-1] + own + SETTINGS[-1:]


def knob_differs(k: Knob, p: SGLangSide, d: SGLangSide) -> bool:
    if k.name == "draft_tokens" and not (p.speculative and d.speculative):
        return False  # "on one side only" belongs to the speculative knob
    return k.value(p) != k.value(d)
