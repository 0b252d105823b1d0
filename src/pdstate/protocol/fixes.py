"""How to fix each refusal, in pdstate's configuration terms (pure: no torch, no I/O).

``fix_line(error_type, message)`` maps a refusal (the class name and exact message a handshake,
``/v1/compat/check``, ``pdstate check`` or a local check reports) to one ``fix:`` line naming the
configuration key and the side to change, or ``None`` when pdstate has no advice beyond the
message. Where upstream's message carries its own advice ("Both servers must use the same
--page-size value."), the fix line repeats that sentence first and then names pdstate's key.

``summarize(error_type, message)`` shortens a ``LayoutMismatch`` whose values are long lists (the
43-entry ``compression_ratios``, the state components) to a readable sentence of the same shape;
every other message is returned unchanged. Both take ``layouts``, the known layer layouts by name
(``{"dsv4-flash": [0, 0, 4, ...]}``; ``pdstate.service.preflight.preset_layouts()`` gives the
presets'), so a ratio list is named ("preset 'dsv4-flash'") instead of printed.

Keys named here are real ``WorkerConfig`` keys (a test checks each one).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Layouts = Mapping[str, Sequence[int]]

_LAYOUT_RE = re.compile(
    r"^DSV4 layout mismatch on (?P<factor>\w+): prefill server has (?P=factor)=(?P<prefill>.*), "
    r"but decode server has (?P=factor)=(?P<decode>.*)\. Both servers must build the same state layout\.$",
    re.S,
)
_PAIR_RE = re.compile(r"prefill server has \w+=(?P<prefill>.+?),? but decode server has \w+=(?P<decode>[^.\s]+)")
_ENGINE_RE = re.compile(r"prefill server uses (?P<prefill>'[^']*'), but decode server uses (?P<decode>'[^']*')")

SPECULATIVE_KEYS = "pool.speculative_num_draft_tokens (0 turns speculative decoding off) and draft.enabled"


# --- reading a message back ----------------------------------------------------------------------


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_layout_mismatch(message: str) -> tuple[str, Any, Any] | None:
    """``(factor, prefill_value, decode_value)`` of a ``LayoutMismatch`` message, else ``None``."""
    m = _LAYOUT_RE.match(message)
    if m is None:
        return None
    return m["factor"], _value(m["prefill"]), _value(m["decode"])


def _pair(message: str, pattern: re.Pattern = _PAIR_RE) -> tuple[Any, Any]:
    m = pattern.search(message)
    return (None, None) if m is None else (_value(m["prefill"]), _value(m["decode"]))


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


def _runs(items: Sequence[Any]) -> str:
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


def describe_components(components: Any) -> str:
    """``swa[85: 43x149760, 42x...] + c128_state[20: ...]`` (item lengths in bytes)."""
    if not isinstance(components, list):
        return repr(components)
    parts = []
    for c in components:
        try:
            state_type, n, items = c
        except (TypeError, ValueError):
            return repr(components)
        parts.append(f"{state_type}[{n}: {_runs(list(items))}]")
    return " + ".join(parts) or "none"


def describe_draft(draft: Any) -> str:
    if not draft:
        return "none"
    if not isinstance(draft, dict):
        return repr(draft)
    text = f"{draft.get('layers')}-layer {draft.get('layout')} draft, page {draft.get('page_size')}, window {draft.get('sliding_window')}"
    if draft.get("ring_size") is not None:
        text += f", ring {draft['ring_size']}"
    return text


def describe_value(factor: str, value: Any, layouts: Layouts | None = None) -> str:
    """One factor's value, short: layer lists by name, components and item lists run-length."""
    if factor == "compression_ratios" and isinstance(value, list):
        return describe_layers(value, layouts)
    if factor == "components":
        return describe_components(value)
    if factor == "main_kv_item_lens" and isinstance(value, list):
        return f"[{_runs(value)}]" if value else "[]"
    if factor == "draft":
        return describe_draft(value)
    return value if isinstance(value, str) else repr(value)


def summarize(error_type: str, message: str, layouts: Layouts | None = None) -> str:
    """The message, with a ``LayoutMismatch``'s long values described instead of dumped."""
    if error_type != "LayoutMismatch":
        return message
    parsed = parse_layout_mismatch(message)
    if parsed is None:
        return message
    factor, p, d = parsed
    if factor not in ("compression_ratios", "components", "main_kv_item_lens", "draft"):
        return message
    if factor == "compression_ratios" and isinstance(p, list) and isinstance(d, list):
        body = compare_layers(p, d, layouts)
        return f"DSV4 layout mismatch on compression_ratios: {body}. Both servers must build the same state layout."
    return (
        f"DSV4 layout mismatch on {factor}: prefill server has {describe_value(factor, p, layouts)}, "
        f"but decode server has {describe_value(factor, d, layouts)}. Both servers must build the same state layout."
    )


# --- the fixes, one per refusal kind ------------------------------------------------------------


def _sides(p: Any, d: Any, what: Callable[[Any], str] = repr) -> str:
    return f"prefill {what(p)}, decode {what(d)}"


def _one_side(p: Any, d: Any) -> tuple[str, str]:
    """(side that has it, side that lacks it) for a factor present on one side only."""
    return ("prefill", "decode") if p and not d else ("decode", "prefill")


def _preset_fix(p: Any, d: Any, layouts: Layouts | None) -> str:
    if isinstance(p, list) and isinstance(d, list):
        return f"fix: set the same preset on both workers ({compare_layers(p, d, layouts)})"
    return "fix: set the same preset on both workers"


def _ring_fix(factor: str, p: Any, d: Any) -> str:
    if factor == "c128_ring" and 1 in (p, d):
        return f"fix: online C128 is on one side only (ring 1 = online): set pool.online_c128 alike on both workers ({_sides(p, d)})"
    if None in (p, d):
        return f"fix: one side has no C128 layer: set the same preset on both workers ({_sides(p, d)})"
    return (
        f"fix: speculative decoding is on one side only ({factor} {p} vs {d}; the larger ring is speculative): "
        f"set {SPECULATIVE_KEYS} alike on both workers"
    )


def _draft_fix(p: Any, d: Any) -> str:
    if not p or not d:
        has, lacks = _one_side(p, d)
        return (
            f"fix: only the {has} has a draft: set draft.enabled = true on the {lacks} "
            f"(with pool.speculative_num_draft_tokens > 0), or draft.enabled = false on the {has}"
        )
    keys = {
        "layers": "draft.layers",
        "layout": "pool.unified_kv",
        "page_size": "pool.page_size",
        "swa_page_size": "pool.page_size",
        "sliding_window": "pool.sliding_window",
        "ring_size": "pool.speculative_num_draft_tokens",
    }
    if isinstance(p, dict) and isinstance(d, dict):
        differing = [k for k in keys if p.get(k) != d.get(k)]
        if differing:
            what = "; ".join(f"{k} {p.get(k)!r} vs {d.get(k)!r}" for k in differing)
            names = ", ".join(dict.fromkeys(keys[k] for k in differing))
            return f"fix: the drafts differ ({what}): set {names} alike on both workers"
    return "fix: set draft.enabled, draft.layers and pool.speculative_num_draft_tokens alike on both workers"


def _layout_fix(message: str, layouts: Layouts | None) -> str:
    parsed = parse_layout_mismatch(message)
    if parsed is None:
        return "fix: set preset, [pool] and [draft] alike on both workers"
    factor, p, d = parsed
    if factor in ("compression_ratios", "stage"):
        return (
            _preset_fix(p, d, layouts)
            if factor == "compression_ratios"
            else f"fix: set the same preset on both workers (layer range {_sides(p, d)})"
        )
    if factor in ("c4_ring", "c128_ring"):
        return _ring_fix(factor, p, d)
    if factor == "draft":
        return _draft_fix(p, d)
    simple = {
        "layout": "pool.unified_kv (true = unified, false = paged)",
        "sliding_window": "pool.sliding_window",
        "online_c128": "pool.online_c128 (and pool.online_c128_mtp with speculative decoding)",
        "c4_state_dtype": "pool.state_dtype",
        "c128_state_dtype": "pool.state_dtype",
    }
    if factor in simple:
        return f"fix: set {simple[factor]} alike on both workers ({_sides(p, d)})"
    if factor == "main_kv_item_lens":
        return "fix: main KV item lengths follow preset, pool.page_size and pool.unified_kv: set them alike on both workers"
    if factor == "components":
        return (
            "fix: the state components follow preset, pool.unified_kv, pool.speculative_num_draft_tokens, "
            "pool.online_c128, pool.state_dtype and draft.enabled: set them alike on both workers"
        )
    return f"fix: set preset, [pool] and [draft] alike on both workers ({factor} differs)"


def _page_fix(message: str, _layouts: Layouts | None) -> str:
    p, d = _pair(message)
    return (
        "fix: Both servers must use the same --page-size value: in pdstate, set pool.page_size "
        f"to one value in both workers' configs ({_sides(p, d, str)})"
    )


def _dtype_fix(message: str, _layouts: Layouts | None) -> str:
    p, d = _pair(message)
    return (
        "fix: Both servers must use the same --kv-cache-dtype value: in pdstate, set pool.kv_dtype "
        f"to one value in both workers' configs ({_sides(p, d, str)})"
    )


def _engine_fix(message: str, _layouts: Layouts | None) -> str | None:
    if "transfer engine mismatch" in message:
        p, d = _pair(message, _ENGINE_RE)
        return f"fix: set transfer.engine to one engine on both workers ({_sides(p, d, str)})"
    if "pip install" in message or "extra" in message:
        return 'fix: install the extra the message names, or set transfer.engine = "shm" on both workers'
    if "fell back to TCP" in message:
        return 'fix: make the RDMA devices visible (ibv_devices lists them), or set transfer.mooncake.protocol = "tcp"'
    return None


def _pool_config_fix(message: str, _layouts: Layouts | None) -> str:
    if "kv dtype" in message:
        return 'fix: a paged pool stores fp8 KV: set pool.kv_dtype = "float8_e4m3fn" (or pool.unified_kv = true)'
    if "compression ratios" in message or "bytes per token" in message:
        return "fix: choose a DSV4 layout: set preset to one of the known presets"
    if "unknown dtype" in message:
        return "fix: check pool.kv_dtype and pool.state_dtype (torch dtype names, e.g. float8_e4m3fn, float32)"
    return "fix: check preset and the [pool] keys of this worker"


_FIXES: dict[str, Callable[[str, Layouts | None], str | None]] = {
    # the five upstream target/draft checks (this worker's own pair, or the peer's)
    "DraftNotSWAOnly": lambda m, _: (
        "fix: a NextN draft has SWA-only layers; pdstate builds draft.layers SWA-only layers: "
        "keep the draft SWA-only, or set draft.enabled = false on that worker"
    ),
    "UnifiedKVModeMismatch": lambda m, _: (
        "fix: target and draft must use one KV mode: set pool.unified_kv once for that worker (it applies to both pools)"
    ),
    "SWAIndexMappingNotShared": lambda m, _: (
        "fix: register the allocator's full_to_swa_index_mapping on the draft pool (the same tensor "
        'object, not a clone or a view): set draft.mapping = "shared" on that worker'
    ),
    "DraftMappingMissing": lambda m, _: (
        'fix: the draft registered no SWA index mapping: set draft.mapping = "shared" on that worker'
    ),
    "SWARingGeometryMismatch": lambda m, _: (
        "fix: the draft's ring must equal the target's (window, ring, ring rows): keep pool.sliding_window "
        "and pool.speculative_num_draft_tokens one value per worker (pdstate gives both pools the same)"
    ),
    "PagedSWAGeometryMismatch": lambda m, _: (
        "fix: the draft's (page_size, sliding_window) must equal the target's: keep pool.page_size and "
        "pool.sliding_window one value per worker (pdstate gives both pools the same)"
    ),
    "OnlineC128MTPUnsupported": lambda m, _: (
        "fix: online C128 with speculative decoding needs pool.online_c128_mtp = true; or set "
        "pool.online_c128 = false, or pool.speculative_num_draft_tokens = 0"
    ),
    # across the two sides
    "PageSizeMismatch": _page_fix,
    "KVCacheDtypeMismatch": _dtype_fix,
    "LayoutMismatch": lambda m, layouts: _layout_fix(m, layouts),
    # what SGLang 0.5.23 compares beyond the state layout: server flags and environment, not pdstate keys
    "KVLayoutMismatch": lambda m, _: (
        "fix: launch both servers with the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT"
    ),
    "CompressedMLAPoolMismatch": lambda m, _: "fix: set SGLANG_DSV4_UNIFIED_KV_FP8 the same on both servers",
    "DSparkLayoutMismatch": lambda m, _: (
        "fix: enable DSpark on both servers with the same block size and target/draft KV layout "
        "(upgrade both servers together)"
    ),
    "AllocationPolicyMismatch": lambda m, _: (
        "fix: set --disaggregation-decode-allocation-policy identically on both servers"
    ),
    "DescriptorMismatch": lambda m, _: (
        "fix: the registered buffers do not pair: run one pdstate version with the same preset, [pool] and "
        "[draft] on both workers (pdstate check PREFILL.toml DECODE.toml shows the difference)"
    ),
    "RoleMismatch": lambda m, _: 'fix: pair a prefill with a decode: set role = "decode" on one of the two workers',
    "EngineError": _engine_fix,
    "EngineUnavailable": lambda m, _: (
        'fix: install the extra the message names, or set transfer.engine = "shm" on both workers'
    ),
    "VersionMismatch": lambda m, _: (
        "fix: run the same pdstate version on both workers (the protocol version is not configurable)"
    ),
    "AuthError": lambda m, _: (
        "fix: give both workers the same secret: auth.token_file (or auth.token, PDSTATE_AUTH__TOKEN) "
        "on both, or on neither (then run both as one uid with the same auth.key_dir, or copy its key file to both)"
    ),
    "PoolConfigError": _pool_config_fix,
}


def fix_line(error_type: str, message: str, layouts: Layouts | None = None) -> str | None:
    """The ``fix: ...`` line for a refusal, or ``None`` when there is nothing to add.

    ``error_type`` is the class name as reported (``ErrorInfo.type``); ``message`` the exact
    message. Never raises on an unexpected message: the advice then stays generic.
    """
    fix = _FIXES.get(error_type)
    if fix is None:
        return None
    try:
        return fix(message, layouts)
    except Exception:  # an unforeseen message shape must not hide the refusal itself
        return None


def fixes_known() -> tuple[str, ...]:
    """The error kinds that have a fix line (for tests and documentation)."""
    return tuple(_FIXES)
