"""The registry of layout factors: one entry per factor, read by everything that names one.

A layout factor is something two servers must agree on for the transferred state to be right. Its
entry (``Factor``) says
- its name and kind: a report field (``page_size``, ``kv_dtype``), a state factor every report
  carries (``STATE``, hashed and named in this order), or an optional one carried only where it is
  not at its default (``OPTIONAL``: a report without it is byte-identical to one made before it
  existed, and states the default);
- how it is read: from live pools (``pdstate.pools.reporting.READERS``, by name), from a report
  (``LayoutReport.value``, the default where an optional factor is absent), from a server's
  settings (``launch``: the SGLang ``ServerArgs`` field a launch, or a running server, sets it with);
- how two sides' values are compared (``same``: equality of the canonical values unless the entry
  gives its own rule) and refused (``refusal``: upstream's own sentence, else ``LayoutMismatch``);
- its fix line in ``pdstate serve``'s words (``fix``: the configuration key and the side), and in
  SGLang's (``sglang_line``: ``sglang_fix``, else the SGLang settings that move it, from the table
  the preflight's knobs read, ``factor_texts.SGLANG_SETTINGS``, and its ``flag``), and what SGLang's own backend does at run
  time with the difference (``effect``). The texts are ``factor_texts``.

The report (``report``: factors, fingerprint, diff), the compatibility check (``compat``), the fix
lines (``fixes``), ``pdstate.pools.reporting`` and the SGLang launch model
(``pdstate.integrations.sglang.launch``) read this registry. A new factor is one entry here (made
optional so that older reports and fingerprints stay as they are), its reader in
``pools.reporting`` where it is a fact of the pools, and where SGLang sets it: ``launch`` names the
ServerArgs field a predicted launch reads it from (nothing more to write), and a running SGLang
server's value is passed to the report by the backend (``integrations.sglang.settings``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from pdstate.errors import (
    AllocationPolicyMismatch,
    CompressedMLAPoolMismatch,
    CrossSideMismatch,
    DSparkLayoutMismatch,
    KVCacheDtypeMismatch,
    KVLayoutMismatch,
    LayoutMismatch,
    PageSizeMismatch,
)
from pdstate.protocol import factor_texts as t

Kind = Literal["field", "state", "optional"]
Values = Callable[[Any, Any], str]  # (prefill's value, decode's value) -> text
Fix = Callable[[Any, Any, Any], str]  # (prefill's value, decode's value, known layouts) -> "fix: ..."

DEFAULT_KV_LAYOUT = "v4"
DEFAULT_ALLOCATION_POLICY = "early"


def default_kv_layout(compression_ratios) -> str:
    """0.5.23's ``pd_kv_layout()`` string for the default V4 layout of pools with these ratios."""
    compressed = [f"c{r}:{DEFAULT_KV_LAYOUT}" for r in sorted(set(compression_ratios) - {0})]
    return ",".join([DEFAULT_KV_LAYOUT, *compressed])


def canon(value: Any) -> Any:
    """Tuples -> lists recursively, so a report survives a msgpack/JSON round trip unchanged."""
    if isinstance(value, (list, tuple)):
        return [canon(v) for v in value]
    if isinstance(value, dict):
        return {k: canon(v) for k, v in value.items()}
    return value


def equal(a: Any, b: Any) -> bool:
    return canon(a) == canon(b)


@dataclass(frozen=True)
class Factor:
    name: str
    kind: Kind
    what: str  # one line: what it is
    default: Any = None  # an optional factor's value where a report lacks it; a callable gets the report
    launch: str | None = None  # the SGLang ServerArgs field that sets it (a launch's, a running server's)
    same: Callable[[Any, Any], bool] = equal  # two reports' values (an absent optional one: None) agree
    error: type[CrossSideMismatch] = LayoutMismatch  # the refusal's class
    refusal: Callable[[Any, Any], CrossSideMismatch] | None = None  # (prefill, decode reports); None: LayoutMismatch
    describe: Callable[[Any, Any], str] = t.plain  # (value, layouts) -> short text
    contrast: Fix | None = None  # both values described at once, where that reads better (a summary's body)
    fix: Fix | None = None  # pdstate serve's words
    flag: str | None = None  # SGLang's words: the flag or variable an operator changes
    sglang_fix: Values | None = None  # SGLang's words, where the factor is one launch setting of its own
    effect: Values | None = None  # what SGLang 0.5.19's own backend does at run time with the difference

    @property
    def optional(self) -> bool:
        return self.kind == "optional"

    def of(self, report: Any) -> Any:
        """The factor's value in a ``LayoutReport`` (an absent optional one: its default)."""
        if self.kind == "field":
            return getattr(report, self.name)
        value = dict(report.factors).get(self.name) if self.optional else dict(report.factors)[self.name]
        if value is None and self.optional:
            return self.default(report) if callable(self.default) else self.default
        return value

    def refuse(self, prefill: Any, decode: Any) -> CrossSideMismatch:
        """The refusal of a pair of reports that differ in this factor."""
        if self.refusal is not None:
            return self.refusal(prefill, decode)
        return LayoutMismatch.build(self.name, self.of(prefill), self.of(decode))

    def fix_line(self, prefill: Any, decode: Any, layouts: Any = None) -> str | None:
        return None if self.fix is None else self.fix(prefill, decode, layouts)

    def sglang_line(self, prefill: Any, decode: Any, layouts: Any = None) -> str | None:
        """The fix line in SGLang's words: the entry's own (``sglang_fix``), else the SGLang
        settings that move the factor (``factor_texts.SGLANG_SETTINGS``, the preflight's knobs) and
        its ``flag``; ``None`` where neither names one."""
        if self.sglang_fix is not None:
            return f"fix: {self.sglang_fix(prefill, decode)}"
        settings = t.sglang_settings(self.name) + ((self.flag,) if self.flag else ())
        if not settings:
            return None
        if prefill is None and decode is None:
            return t.sglang_alike(settings, None)
        both = self.contrast(prefill, decode, layouts) if self.contrast is not None else None
        if both is None:
            both = t.sides(self.describe(prefill, layouts), self.describe(decode, layouts), str)
        return t.sglang_alike(settings, both)


# --- the refusals SGLang 0.5.23 words itself -------------------------------------------------------


def _regions(report: Any) -> tuple[int, int, int]:
    """``(registered, one pool per layer, fp8 two-pool)`` main-KV region counts, as 0.5.23 counts them."""
    ratios = report.factor("compression_ratios")
    c4, c128 = sum(1 for r in ratios if r == 4), sum(1 for r in ratios if r == 128)
    single, two = 2 * c4 + c128, 3 * c4 + 2 * c128
    return (two if report.factor("kv_fp8_two_pool") else single), single, two


def _two_pool_refusal(prefill: Any, decode: Any) -> CrossSideMismatch:
    (p_regions, single, two), (d_regions, _, _) = _regions(prefill), _regions(decode)
    return CompressedMLAPoolMismatch.build(p_regions, d_regions, single, two)


def _dspark_refusal(prefill: Any, decode: Any) -> CrossSideMismatch:
    p, d = prefill.factor("dspark") or {}, decode.factor("dspark") or {}
    return DSparkLayoutMismatch.build(sorted(k for k in p.keys() | d.keys() if p.get(k) != d.get(k)))


def _values_refusal(build: Callable[[Any, Any], CrossSideMismatch], name: str):
    return lambda prefill, decode: build(FACTORS[name].of(prefill), FACTORS[name].of(decode))


# --- the entries -------------------------------------------------------------------------------


def _upstream_field(name: str, what: str, error: type[CrossSideMismatch], flag: str, key: str, effect: str) -> Factor:
    """A report field upstream itself compares, refused in its words (which name its flag)."""
    refusal = _values_refusal(error.build, name)
    return Factor(
        name, "field", what, error=error, refusal=refusal, fix=t.upstream_fix(flag, key), effect=t.effect(effect)
    )


def _state_dtype(ratio: int) -> Factor:
    return Factor(
        f"c{ratio}_state_dtype",
        "state",
        f"the C{ratio} compressor state dtype",
        fix=t.alike("pool.state_dtype"),
        effect=t.state_dtype_effect,
    )


_BUILT_IN = (
    _upstream_field(
        "page_size",
        "tokens per page",
        PageSizeMismatch,
        "--page-size",
        "pool.page_size",
        "SGLang's decode refuses the bootstrap (\"Page size mismatch ... Both servers must use the same "
        '--page-size value."), but the prefill waits in Bootstrapping until its timeout',
    ),
    _upstream_field(
        "kv_dtype",
        "the main KV dtype",
        KVCacheDtypeMismatch,
        "--kv-cache-dtype",
        "pool.kv_dtype",
        'SGLang\'s decode refuses the bootstrap ("KV cache dtype mismatch", the check beside the page '
        "size's), and the prefill waits in Bootstrapping until its timeout",
    ),
    Factor(
        "layout",
        "state",
        "paged or unified KV",
        fix=t.alike("pool.unified_kv (true = unified, false = paged)"),
        effect=t.effect(
            "paged and unified state components do not pair: wrong bytes or a failed transfer (SGLang compares neither)"
        ),
    ),
    Factor(
        "compression_ratios",
        "state",
        "each layer's compression ratio (0 SWA-only, 4, 128)",
        describe=t.describe_ratios,
        contrast=t.compare_ratios,
        fix=t.preset_fix,
        effect=t.ratios_effect,
    ),
    Factor("stage", "state", "the pools' layer range", fix=t.stage_fix, effect=t.effect(t.STAGE_EFFECT)),
    Factor("sliding_window", "state", "the SWA window", fix=t.alike("pool.sliding_window"), effect=t.window_effect),
    Factor("c4_ring", "state", "the C4 compress-state ring", fix=t.ring_fix("c4_ring"), effect=t.c4_ring_effect),
    Factor("c128_ring", "state", "the C128 state ring", fix=t.ring_fix("c128_ring"), effect=t.c128_ring_effect),
    Factor(
        "online_c128",
        "state",
        "online C128 compression",
        fix=t.alike("pool.online_c128 (and pool.online_c128_mtp with speculative decoding)"),
        effect=t.effect("online vs offline C128 state: item sizes differ, wrong C128 state, no error"),
    ),
    *(_state_dtype(ratio) for ratio in (4, 128)),
    Factor(
        "draft", "state", "the NextN draft's pool", describe=t.describe_draft, fix=t.draft_fix, effect=t.draft_effect
    ),
    Factor(
        "main_kv_item_lens",
        "state",
        "the main KV buffers' item lengths",
        describe=t.describe_item_lens,
        fix=t.fixed(
            "fix: main KV item lengths follow preset, pool.page_size and pool.unified_kv: set them alike on both workers"
        ),
        effect=t.effect("main KV pages of different sizes: misaligned KV (SGLang does not compare item lengths)"),
    ),
    Factor(
        "components",
        "state",
        "the state components: kind, buffer count, item lengths",
        describe=t.describe_components,
        fix=t.fixed(
            "fix: the state components follow preset, pool.unified_kv, pool.speculative_num_draft_tokens, "
            "pool.online_c128, pool.state_dtype and draft.enabled: set them alike on both workers"
        ),
        effect=t.effect(
            "state components pair by position: every one after the first difference meets the wrong buffers"
        ),
    ),
    Factor(
        "kv_layout",
        "optional",
        "the main and compressed KV byte layouts (0.5.23's pd_kv_layout(); default V4 throughout)",
        default=lambda report: default_kv_layout(report.factor("compression_ratios")),
        error=KVLayoutMismatch,
        refusal=_values_refusal(KVLayoutMismatch.build, "kv_layout"),
        fix=t.fixed("fix: launch both servers with the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT"),
        flag="--dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT",
    ),
    Factor(
        "kv_fp8_two_pool",
        "optional",
        "the compressed-MLA fp8 two-pool layout (SGLANG_DSV4_UNIFIED_KV_FP8)",
        default=False,
        error=CompressedMLAPoolMismatch,
        refusal=_two_pool_refusal,
        fix=t.fixed("fix: set SGLANG_DSV4_UNIFIED_KV_FP8 the same on both servers"),
        flag="SGLANG_DSV4_UNIFIED_KV_FP8",
    ),
    Factor(
        "dspark",
        "optional",
        "a DeepSeek-V4.1 DSpark draft's transfer layout (0.5.23's get_dsv41_spec_layout)",
        error=DSparkLayoutMismatch,
        refusal=_dspark_refusal,
        fix=t.fixed(
            "fix: enable DSpark on both servers with the same block size and target/draft KV layout "
            "(upgrade both servers together)"
        ),
        flag="--speculative-algorithm and --speculative-dspark-block-size (DSpark, and its target/draft KV layout)",
    ),
    Factor(
        "allocation_policy",
        "optional",
        "the decode's allocation policy (SGLang 0.5.23)",
        default=DEFAULT_ALLOCATION_POLICY,
        launch="disaggregation_decode_allocation_policy",
        error=AllocationPolicyMismatch,
        refusal=_values_refusal(AllocationPolicyMismatch.build, "allocation_policy"),
        fix=t.fixed("fix: set --disaggregation-decode-allocation-policy identically on both servers"),
        flag="--disaggregation-decode-allocation-policy",
        sglang_fix=lambda p, d: (
            f"set `--disaggregation-decode-allocation-policy {d}` on the prefill (or `{p}` on the decode): "
            "SGLang 0.5.23 wants it identical on both roles"
        ),
        effect=lambda p, d: (
            "SGLang 0.5.23's decode fails every request of the pair (\"Disaggregation decode allocation policy "
            f"mismatch: prefill={p}, decode={d}\"), and pdstate's handshake refuses it"
        ),
    ),
)

# Every factor by name, in the protocol's order: report fields, state factors, optional ones.
FACTORS: dict[str, Factor] = {f.name: f for f in _BUILT_IN}


def register(entry: Factor) -> Factor:
    """Add a factor (after every other of its kind's; a new one is ``optional``: reports without it
    keep their bytes and fingerprints)."""
    if entry.name in FACTORS:
        raise ValueError(f"layout factor {entry.name!r} is registered already")
    order = ("field", "state", "optional")
    rows = [*FACTORS.values(), entry]
    FACTORS.clear()
    FACTORS.update((f.name, f) for f in sorted(rows, key=lambda f: order.index(f.kind)))
    return entry


def unregister(name: str) -> None:
    if name in {f.name for f in _BUILT_IN}:
        raise ValueError(f"layout factor {name!r} is built in")
    FACTORS.pop(name, None)


@contextmanager
def registered(entry: Factor) -> Iterator[Factor]:
    """``entry`` registered for the ``with`` block."""
    register(entry)
    try:
        yield entry
    finally:
        unregister(entry.name)


def get(name: str) -> Factor | None:
    return FACTORS.get(name)


def names(kind: Kind) -> tuple[str, ...]:
    return tuple(f.name for f in FACTORS.values() if f.kind == kind)


def refusal_order() -> tuple[Factor, ...]:
    """The order in which the handshake refuses differing factors: those refused in upstream's own
    words first (page size, KV dtype, SGLang 0.5.23's), then the rest as ``LayoutMismatch``, each
    group in protocol order."""
    entries = tuple(FACTORS.values())
    return tuple(f for f in entries if f.refusal) + tuple(f for f in entries if not f.refusal)


def of_error(error: BaseException) -> Factor | None:
    """The entry of the factor an error is about (its ``factor`` field), if registered."""
    name = getattr(error, "factor", None)
    return FACTORS.get(name) if isinstance(name, str) else None


def error_kinds() -> tuple[str, ...]:
    """The class names of the factors' refusals."""
    return tuple(dict.fromkeys(f.error.__name__ for f in FACTORS.values()))


def launch_fields() -> frozenset[str]:
    """The SGLang ServerArgs fields that set a factor."""
    return frozenset(f.launch for f in FACTORS.values() if f.launch)


def launch_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The factors a server's settings set, by name (``values``: its ServerArgs fields): each
    factor with a ``launch`` field, its default where the field is not given."""
    out = {}
    for f in FACTORS.values():
        if f.launch:
            given = values.get(f.launch)
            out[f.name] = f.default if given is None or given == "" else given
    return out
