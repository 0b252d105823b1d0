"""What the layout factors' values, fixes and run-time effects read like (pure: no torch, no I/O).

The entries of ``pdstate.protocol.factors`` name these functions: a value described short (a layer
list by its preset's name, components and item lists run-length), the ``fix:`` line in
``pdstate serve``'s words (the configuration key and the side), the fix in SGLang's words (the
launch flag) and what SGLang 0.5.19's own transfer backend does at run time when a pair differing in
the factor is launched anyway (measured, ``shared/reference/sglang_cpu.md``).

Every function takes values, never message text: an error carries its factor and both values
(``pdstate.errors.CrossSideMismatch``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Layouts = Mapping[str, Sequence[int]]

SPECULATIVE_KEYS = "pool.speculative_num_draft_tokens (0 turns speculative decoding off) and draft.enabled"
TIMEOUT = "the decode's timeout (300 s by default)"
SAME_LAYOUT = "Both servers must build the same state layout."


# --- describing values ---------------------------------------------------------------------------


def count_layers(ratios: Sequence[int]) -> str:
    """``43 layers: 2 SWA-only, 21 C4, 20 C128``."""
    kinds = [(0, "SWA-only"), (4, "C4"), (128, "C128")]
    parts = [f"{sum(1 for r in ratios if r == k)} {name}" for k, name in kinds if k in ratios]
    other = sorted({r for r in ratios if r not in (0, 4, 128)})
    parts += [f"ratio {r}" for r in other]
    return f"{len(ratios)} layers: {', '.join(parts) or 'none'}"


def layout_name(ratios: Sequence[int], layouts: Layouts | None = None) -> str | None:
    for name, known in (layouts or {}).items():
        if list(known) == list(ratios):
            return name
    return None


def describe_layers(ratios: Sequence[int], layouts: Layouts | None = None) -> str:
    """``preset 'dsv4-flash' (43 layers: 2 SWA-only, 21 C4, 20 C128)``, or the counts alone (with
    ", not a known layout" when ``layouts`` were given and none matched)."""
    name = layout_name(ratios, layouts)
    if name:
        return f"{name} ({count_layers(ratios)})"
    return f"{count_layers(ratios)}, not a known layout" if layouts else count_layers(ratios)


def compare_layers(prefill: Sequence[int], decode: Sequence[int], layouts: Layouts | None = None) -> str:
    """Which layouts the two ratio lists are, and where they part when the counts agree."""
    text = f"prefill {describe_layers(prefill, layouts)}, decode {describe_layers(decode, layouts)}"
    if sorted(prefill) == sorted(decode):
        i = next(i for i, (a, b) in enumerate(zip(prefill, decode)) if a != b)
        text += f"; the same layers in another order (first at layer {i}: {prefill[i]} vs {decode[i]})"
    return text


def runs(items: Sequence[Any]) -> str:
    """``[5, 5, 5, 7]`` -> ``3x5, 7``."""
    out: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j < len(items) and items[j] == items[i]:
            j += 1
        out.append(f"{j - i}x{items[i]}" if j - i > 1 else f"{items[i]}")
        i = j
    return ", ".join(out)


def describe_components(components: Any, _layouts: Layouts | None = None) -> str:
    """``swa[85: 43x149760, 42x...] + c128_state[20: ...]`` (item lengths in bytes)."""
    if not isinstance(components, list):
        return repr(components)
    parts = []
    for c in components:
        try:
            state_type, n, items = c
        except (TypeError, ValueError):
            return repr(components)
        parts.append(f"{state_type}[{n}: {runs(list(items))}]")
    return " + ".join(parts) or "none"


def describe_draft(draft: Any, _layouts: Layouts | None = None) -> str:
    if not draft:
        return "none"
    if not isinstance(draft, dict):
        return repr(draft)
    text = f"{draft.get('layers')}-layer {draft.get('layout')} draft, page {draft.get('page_size')}, window {draft.get('sliding_window')}"
    if draft.get("ring_size") is not None:
        text += f", ring {draft['ring_size']}"
    return text


def describe_ratios(value: Any, layouts: Layouts | None = None) -> str:
    return describe_layers(value, layouts) if isinstance(value, list) else plain(value)


def describe_item_lens(value: Any, _layouts: Layouts | None = None) -> str:
    if isinstance(value, list):
        return f"[{runs(value)}]" if value else "[]"
    return plain(value)


def plain(value: Any, _layouts: Layouts | None = None) -> str:
    return value if isinstance(value, str) else repr(value)


def compare_ratios(prefill: Any, decode: Any, layouts: Layouts | None = None) -> str | None:
    """The body of a layer-layout refusal's summary: both layouts named (``None``: not lists)."""
    if isinstance(prefill, list) and isinstance(decode, list):
        return compare_layers(prefill, decode, layouts)
    return None


# --- fixes in SGLang's words ----------------------------------------------------------------------

# The SGLang settings that move layout factors: name -> (the flag, variable or config field an
# operator changes, the factors it moves). The preflight's knobs (``integrations.sglang.launch.knobs``)
# and an SGLang rank's fix lines (``Factor.sglang_line``) both read this table.
SGLANG_SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "layers": (
        "compress_ratios / num_hidden_layers (the model's config.json)",
        ("compression_ratios", "stage", "main_kv_item_lens", "components", "c128_ring"),
    ),
    "page_size": ("--page-size", ("page_size", "main_kv_item_lens", "components", "draft")),
    "kv_cache_dtype": ("--kv-cache-dtype", ("kv_dtype",)),
    "unified_kv": (
        "SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton (ROCm unified KV)",
        ("layout", "main_kv_item_lens", "components", "draft"),
    ),
    "online_c128": ("SGLANG_OPT_USE_ONLINE_COMPRESS (online C128)", ("online_c128", "c128_ring", "components")),
    "speculative": ("--speculative-algorithm", ("c4_ring", "c128_ring", "draft", "components")),
    "draft_tokens": ("--speculative-num-steps (draft tokens)", ("draft", "components")),
    "sliding_window": ("sliding_window (config.json / --json-model-override-args)", ("sliding_window", "draft")),
    "state_dtype": ("SGLANG_DSV4_COMPRESS_STATE_DTYPE", ("c4_state_dtype", "c128_state_dtype", "components")),
}


def sglang_settings(factor: str) -> tuple[str, ...]:
    """The SGLang settings (``SGLANG_SETTINGS``' headings) that move ``factor``, in the table's order."""
    return tuple(heading for heading, moved in SGLANG_SETTINGS.values() if factor in moved)


def sglang_alike(settings: Sequence[str], values: str | None) -> str:
    """``fix: launch both servers with the same A; B (VALUES)`` (``values``: both sides' values, or ``None``)."""
    return f"fix: launch both servers with the same {'; '.join(settings)}" + (f" ({values})" if values else "")


# --- fixes in pdstate serve's words ---------------------------------------------------------------


def sides(p: Any, d: Any, what=repr) -> str:
    return f"prefill {what(p)}, decode {what(d)}"


def alike(key: str):
    """``fix: set KEY alike on both workers (prefill P, decode D)``."""
    return lambda p, d, _layouts=None: f"fix: set {key} alike on both workers ({sides(p, d)})"


def fixed(line: str):
    """A fix line that does not depend on the values."""
    return lambda _p, _d, _layouts=None: line


def preset_fix(p: Any, d: Any, layouts: Layouts | None = None) -> str:
    if isinstance(p, list) and isinstance(d, list):
        return f"fix: set the same preset on both workers ({compare_layers(p, d, layouts)})"
    return "fix: set the same preset on both workers"


def stage_fix(p: Any, d: Any, _layouts: Layouts | None = None) -> str:
    return f"fix: set the same preset on both workers (layer range {sides(p, d)})"


def ring_fix(factor: str):
    def fix(p: Any, d: Any, _layouts: Layouts | None = None) -> str:
        if factor == "c128_ring" and 1 in (p, d):
            return f"fix: online C128 is on one side only (ring 1 = online): set pool.online_c128 alike on both workers ({sides(p, d)})"
        if None in (p, d):
            return f"fix: one side has no C128 layer: set the same preset on both workers ({sides(p, d)})"
        return (
            f"fix: speculative decoding is on one side only ({factor} {p} vs {d}; the larger ring is speculative): "
            f"set {SPECULATIVE_KEYS} alike on both workers"
        )

    return fix


_DRAFT_KEYS = {
    "layers": "draft.layers",
    "layout": "pool.unified_kv",
    "page_size": "pool.page_size",
    "swa_page_size": "pool.page_size",
    "sliding_window": "pool.sliding_window",
    "ring_size": "pool.speculative_num_draft_tokens",
}


def draft_fix(p: Any, d: Any, _layouts: Layouts | None = None) -> str:
    if not p or not d:
        has, lacks = ("prefill", "decode") if p and not d else ("decode", "prefill")
        return (
            f"fix: only the {has} has a draft: set draft.enabled = true on the {lacks} "
            f"(with pool.speculative_num_draft_tokens > 0), or draft.enabled = false on the {has}"
        )
    if isinstance(p, dict) and isinstance(d, dict):
        differing = [k for k in _DRAFT_KEYS if p.get(k) != d.get(k)]
        if differing:
            what = "; ".join(f"{k} {p.get(k)!r} vs {d.get(k)!r}" for k in differing)
            names = ", ".join(dict.fromkeys(_DRAFT_KEYS[k] for k in differing))
            return f"fix: the drafts differ ({what}): set {names} alike on both workers"
    return "fix: set draft.enabled, draft.layers and pool.speculative_num_draft_tokens alike on both workers"


def first_word(value: Any) -> str:
    """``value`` up to its first period or space (a clipped peer's value: up to its count)."""
    text = str(value)
    return text[: next((i for i, c in enumerate(text) if c == "." or c.isspace()), len(text))]


def upstream_fix(flag: str, key: str):
    """Upstream's own advice first ("Both servers must use the same --page-size value."), then
    pdstate's key and both values (the decode's as one word: the sentence's period follows it)."""
    return lambda p, d, _layouts=None: (
        f"fix: Both servers must use the same {flag} value: in pdstate, set {key} "
        f"to one value in both workers' configs (prefill {p}, decode {first_word(d)})"
    )


# --- SGLang's own backend at run time (0.5.19, measured) -----------------------------------------


STAGE_EFFECT = "the buffers pair with other layers: wrong KV"


def effect(text: str):
    return lambda _p, _d: text


def ratios_effect(p: Any, d: Any) -> str:
    if isinstance(p, list) and isinstance(d, list) and sorted(p) == sorted(d):
        return (
            "same C4/C128 counts in another order: SGLang reports Success, but (layer, page) slots receive "
            "another layer's KV (measured: 640 of 750 slots wrong)"
        )
    return (
        f"different C4/C128 counts: SGLang's prefill transfer thread dies; requests hang until {TIMEOUT} "
        "and that prefill queue stays dead"
    )


def window_effect(p: Any, d: Any) -> str:
    return (
        f"sliding window {p} vs {d}: SGLang reports Success (a log warning only), but every SWA entry lands "
        "one page off: wrong sliding-window KV"
    )


def c4_ring_effect(p: Any, d: Any) -> str:
    return (
        f"C4 state rings {p} vs {d}: wrong state; SGLang 0.5.19 reports Success while C4 compressor state "
        "lands in other ring slots (measured: 42 of 301 destination items wrong for a 700-token request), "
        "0.5.23 refuses the pair on both sides"
    )


def c128_ring_effect(p: Any, d: Any) -> str:
    if None in (p, d):
        return "one side has no C128 state: the components pair with the wrong buffers"
    if 1 in (p, d):
        return f"C128 state ring {p} vs {d} (online vs offline): wrong C128 state, no error (SGLang does not compare item lengths)"
    return f"C128 state rings {p} vs {d}: wrong state; the partial 128-token group's state goes to another ring block, no error"


def state_dtype_effect(p: Any, d: Any) -> str:
    return f"compressor state in {p} vs {d}: item sizes differ, the decode reads misaligned state (SGLang does not compare item lengths)"


def draft_effect(p: Any, d: Any) -> str:
    if p and not d:
        return (
            "the prefill sends a draft SWA component the decode has no buffers for: SGLang's prefill transfer "
            f"thread dies; requests hang until {TIMEOUT} and that prefill queue stays dead"
        )
    if d and not p:
        return (
            "SGLang reports Success, but the decode's draft SWA KV is never written: the draft starts from stale state"
        )
    return "the two drafts' SWA geometry differs: the draft SWA lands at the wrong slots or sizes"
