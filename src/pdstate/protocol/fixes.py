"""How to fix each refusal, in pdstate's configuration terms (pure: no torch, no I/O).

``fix_for(error)`` gives one ``fix:`` line naming the configuration key and the side to change, or
``None`` when pdstate has no advice beyond the message (``words="sglang"``: a layout factor's line
in SGLang's launch words, for an SGLang rank); ``fix_line(error_type, message)`` does the
same for a refusal as reported (the class name and exact message a handshake, ``/v1/compat/check``,
``pdstate check`` or a local check reports), rebuilt as its class (``error_from_wire``). A
refusal about a layout factor carries the factor and both values as fields
(``CrossSideMismatch.factor``): its line is that factor's, from the registry
(``pdstate.protocol.factors``). Where upstream's message carries its own advice ("Both servers
must use the same --page-size value."), the fix line repeats that sentence first and then names
pdstate's key.

``summarize(error_type, message)`` shortens a ``LayoutMismatch`` whose values are long lists (the
43-entry ``compression_ratios``, the state components) to a readable sentence of the same shape;
every other message is returned unchanged. Both take ``layouts``, the known layer layouts by name
(``{"dsv4-flash": [0, 0, 4, ...]}``; ``pdstate.service.preflight.preset_layouts()`` gives the
presets'), so a ratio list is named ("preset 'dsv4-flash'") instead of printed.

Keys named here are real ``WorkerConfig`` keys (a test checks each one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pdstate.errors import LayoutMismatch, error_from_wire
from pdstate.protocol import factors
from pdstate.protocol.factor_texts import (  # noqa: F401  (re-exported: the names callers use)
    SPECULATIVE_KEYS,
    Layouts,
    compare_layers,
    count_layers,
    describe_components,
    describe_draft,
    describe_layers,
    layout_name,
    plain,
    sides,
)

Words = Literal["serve", "sglang"]  # whose words a fix line uses: pdstate serve's config keys, SGLang's launch

# --- reading a refusal back ----------------------------------------------------------------------


def parse_layout_mismatch(message: str) -> tuple[str, Any, Any] | None:
    """``(factor, prefill_value, decode_value)`` of a ``LayoutMismatch`` message, else ``None``
    (the fields of the error rebuilt from it)."""
    err = LayoutMismatch(message)
    return None if err.factor is None else (err.factor, err.prefill, err.decode)


# --- describing values ---------------------------------------------------------------------------


def describe_value(factor: str, value: Any, layouts: Layouts | None = None) -> str:
    """One factor's value, short: layer lists by name, components and item lists run-length."""
    entry = factors.get(factor)
    return (entry.describe if entry is not None else plain)(value, layouts)


def summarize(error_type: str, message: str, layouts: Layouts | None = None) -> str:
    """The message, with a ``LayoutMismatch``'s long values described instead of dumped."""
    if error_type != "LayoutMismatch":
        return message
    err = LayoutMismatch(message)
    entry = factors.of_error(err)
    if entry is None or (entry.describe is plain and entry.contrast is None):
        return message
    factor, p, d = entry.name, err.prefill, err.decode
    body = entry.contrast(p, d, layouts) if entry.contrast is not None else None
    if body is not None:
        return f"DSV4 layout mismatch on {factor}: {body}. Both servers must build the same state layout."
    return (
        f"DSV4 layout mismatch on {factor}: prefill server has {describe_value(factor, p, layouts)}, "
        f"but decode server has {describe_value(factor, d, layouts)}. Both servers must build the same state layout."
    )


# --- the fixes, one per refusal kind ------------------------------------------------------------

# A kind's fix: its line, or (the few whose advice depends on the message) a function of the
# message and the known layouts giving the line or ``None``.
Fix = str | Callable[[str, Layouts | None], str | None]


def _factor_fix(error: BaseException, layouts: Layouts | None, words: Words = "serve") -> str | None:
    """A layout factor's refusal: the factor's own line (registry) in ``words``, generic advice otherwise."""
    entry = factors.of_error(error)
    if entry is not None and words == "sglang":
        if line := entry.sglang_line(error.prefill, error.decode, layouts):
            return line
    if entry is not None and entry.fix is not None:
        return entry.fix_line(error.prefill, error.decode, layouts)
    factor = getattr(error, "factor", None)
    if words == "sglang" and isinstance(error, LayoutMismatch):
        differs = f"; {factor} differs" if factor else ""
        return f'fix: launch both servers alike (pdstate check --sglang "PREFILL ARGS" "DECODE ARGS" names the setting{differs})'
    if isinstance(error, LayoutMismatch) and factor:
        return f"fix: set preset, [pool] and [draft] alike on both workers ({factor} differs)"
    return "fix: set preset, [pool] and [draft] alike on both workers" if isinstance(error, LayoutMismatch) else None


def _engine_names(message: str) -> tuple[str | None, str | None]:
    """The two engines of a "transfer engine mismatch" sentence (``handshake`` writes it)."""
    _, _, rest = message.partition("prefill server uses ")
    p, _, d = rest.partition(", but decode server uses ")

    def quoted(text: str) -> str | None:
        text = text.strip()
        return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == "'" and "'" not in text[1:-1] else None

    return quoted(p), quoted(d)


def _engine_fix(message: str, _layouts: Layouts | None) -> str | None:
    if "transfer engine mismatch" in message:
        p, d = _engine_names(message)
        return f"fix: set transfer.engine to one engine on both workers ({sides(p, d, str)})"
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


_FIXES: dict[str, Fix] = {
    # the five upstream target/draft checks (this worker's own pair, or the peer's)
    "DraftNotSWAOnly": (
        "fix: a NextN draft has SWA-only layers; pdstate builds draft.layers SWA-only layers: "
        "keep the draft SWA-only, or set draft.enabled = false on that worker"
    ),
    "UnifiedKVModeMismatch": (
        "fix: target and draft must use one KV mode: set pool.unified_kv once for that worker (it applies to both pools)"
    ),
    "SWAIndexMappingNotShared": (
        "fix: register the allocator's full_to_swa_index_mapping on the draft pool (the same tensor "
        'object, not a clone or a view): set draft.mapping = "shared" on that worker'
    ),
    "DraftMappingMissing": (
        'fix: the draft registered no SWA index mapping: set draft.mapping = "shared" on that worker'
    ),
    "SWARingGeometryMismatch": (
        "fix: the draft's ring must equal the target's (window, ring, ring rows): keep pool.sliding_window "
        "and pool.speculative_num_draft_tokens one value per worker (pdstate gives both pools the same)"
    ),
    "PagedSWAGeometryMismatch": (
        "fix: the draft's (page_size, sliding_window) must equal the target's: keep pool.page_size and "
        "pool.sliding_window one value per worker (pdstate gives both pools the same)"
    ),
    "OnlineC128MTPUnsupported": (
        "fix: online C128 with speculative decoding needs pool.online_c128_mtp = true; or set "
        "pool.online_c128 = false, or pool.speculative_num_draft_tokens = 0"
    ),
    # across the two sides: a layout factor's refusal has its factor's line (``fix_for``)
    "DescriptorMismatch": (
        "fix: the registered buffers do not pair: run one pdstate version with the same preset, [pool] and "
        "[draft] on both workers (pdstate check PREFILL.toml DECODE.toml shows the difference)"
    ),
    "RoleMismatch": 'fix: pair a prefill with a decode: set role = "decode" on one of the two workers',
    "EngineError": _engine_fix,
    "EngineUnavailable": ('fix: install the extra the message names, or set transfer.engine = "shm" on both workers'),
    "VersionMismatch": ("fix: run the same pdstate version on both workers (the protocol version is not configurable)"),
    "AuthError": (
        "fix: give both workers the same secret: auth.token_file (or auth.token, PDSTATE_AUTH__TOKEN) "
        "on both, or on neither (then run both as one uid with the same auth.key_dir, or copy its key file to both)"
    ),
    "PoolConfigError": _pool_config_fix,
}


# The same refusals on an SGLang rank, in its words: the launch flag, or the ``PDSTATE_*`` variable
# backend pdstate reads. The target/draft pair's own checks and the pool's configuration are
# SGLang's building there (no pdstate key changes them): no line beyond upstream's message.
def _sglang_engine_fix(message: str, _layouts: Layouts | None) -> str | None:
    if "transfer engine mismatch" in message:
        p, d = _engine_names(message)
        return f"fix: set PDSTATE_TRANSFER__ENGINE to one engine on both servers ({sides(p, d, str)})"
    if "pip install" in message or "extra" in message:
        return _SGLANG_FIXES["EngineUnavailable"]
    if "fell back to TCP" in message:
        return "fix: make the RDMA devices visible (ibv_devices lists them), or set PDSTATE_TRANSFER__MOONCAKE__PROTOCOL=tcp"
    return None


_SGLANG_FIXES: dict[str, Fix] = {
    "OnlineC128MTPUnsupported": (
        "fix: online C128 with speculative decoding needs SGLANG_EXPERIMENTAL_ONLINE_C128_MTP=1; or unset "
        "SGLANG_OPT_USE_ONLINE_COMPRESS, or remove the --speculative-* flags"
    ),
    "DescriptorMismatch": (
        "fix: the registered buffers do not pair: install one pdstate version beside both servers and launch "
        'them alike (pdstate check --sglang "PREFILL ARGS" "DECODE ARGS" shows the difference)'
    ),
    "RoleMismatch": ("fix: pair a prefill with a decode: launch one of the two with --disaggregation-mode decode"),
    "EngineError": _sglang_engine_fix,
    "EngineUnavailable": (
        "fix: install the extra the message names beside SGLang (an SGLang image ships Mooncake), or set "
        "PDSTATE_TRANSFER__ENGINE to an engine installed on both servers"
    ),
    "VersionMismatch": (
        "fix: install the same pdstate version beside both servers (the protocol version is not configurable)"
    ),
    "AuthError": (
        "fix: give both servers the same secret: PDSTATE_AUTH__TOKEN_FILE (or PDSTATE_AUTH__TOKEN) on both, or "
        "on neither (then run both as one uid with the same PDSTATE_AUTH__KEY_DIR, or copy its key file to both)"
    ),
}


def fix_for(error: BaseException, layouts: Layouts | None = None, words: Words = "serve") -> str | None:
    """The ``fix: ...`` line for a refusal, or ``None`` when there is nothing to add. Never raises
    on an unexpected value or message: the advice then stays generic. ``words="sglang"``: a layout
    factor's line names SGLang's flags and variables (``Factor.sglang_line``), for text an SGLang
    rank renders."""
    kind = type(error).__name__
    if kind not in factors.error_kinds():
        return fix_line(getattr(error, "type_name", kind), str(error), layouts, words)
    try:
        return _factor_fix(error, layouts, words)
    except Exception:  # an unforeseen value must not hide the refusal itself
        return None


def fix_line(error_type: str, message: str, layouts: Layouts | None = None, words: Words = "serve") -> str | None:
    """``fix_for`` a refusal as reported: ``error_type`` is the class name (``ErrorInfo.type``),
    ``message`` the exact message."""
    if error_type in factors.error_kinds():
        return fix_for(error_from_wire(error_type, message), layouts, words)
    fix = (_SGLANG_FIXES if words == "sglang" else _FIXES).get(error_type)
    if fix is None or isinstance(fix, str):
        return fix
    try:
        return fix(message, layouts)
    except Exception:  # an unforeseen message shape must not hide the refusal itself
        return None


def fixes_known() -> tuple[str, ...]:
    """The error kinds that have a fix line (for tests and documentation)."""
    return tuple(dict.fromkeys((*_FIXES, *factors.error_kinds())))
