"""Compare two predicted SGLang DSV4 servers with pdstate's own pool model and handshake checks.

``compare(prefill, decode)`` builds each side's ``LayoutReport`` from ``SGLangSide.pool_settings()``
(``pools.presets.build_worker_pools`` + ``pools.reporting.build_report``, small capacities), runs
``protocol.compat.compat_errors`` on the pair — the handshake's checks — and explains every
differing factor: its two values, what SGLang 0.5.19's own backend does at run time when the pair
is launched anyway (measured, ``shared/reference/sglang_cpu.md``), and which SGLang flag to change
on which side. Differing factors are grouped under the SGLang setting ("knob") that explains them:
speculative decoding on one side changes the C4 and C128 rings, the draft and the components.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdstate.integrations.sglang.launch.prediction import SGLangArgsError, SGLangSide
from pdstate.protocol.fixes import count_layers, describe_value
from pdstate.protocol.report import ErrorInfo, LayoutReport

SIDES = ("prefill", "decode")
TIMEOUT = "the decode's timeout (300 s by default)"


# --- the SGLang settings that shape the layout, and the factors each one moves -------------------


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


KNOBS: tuple[Knob, ...] = (
    Knob(
        "layers",
        "compress_ratios / num_hidden_layers (the model's config.json)",
        ("compression_ratios", "stage", "main_kv_item_lens", "components", "c128_ring"),
        lambda s: tuple(s.stage_ratios),
        lambda s: f"{count_layers(s.stage_ratios)} ({s.layout_source})",
        _layers_fix,
    ),
    Knob(
        "page_size",
        "--page-size",
        ("page_size", "main_kv_item_lens", "components", "draft"),
        lambda s: s.page_size,
        lambda s: str(s.page_size),
        _page_fix,
    ),
    Knob(
        "kv_cache_dtype",
        "--kv-cache-dtype",
        ("kv_dtype",),
        lambda s: s.kv_cache_dtype,
        lambda s: s.kv_cache_dtype,
        _kv_fix,
    ),
    Knob(
        "unified_kv",
        "SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton (ROCm unified KV)",
        ("layout", "main_kv_item_lens", "components", "draft"),
        lambda s: s.unified_kv,
        lambda s: "unified" if s.unified_kv else "paged",
        _env_fix("SGLANG_HACK_FLASHMLA_BACKEND", "unified_kv_triton", lambda s: s.unified_kv),
    ),
    Knob(
        "online_c128",
        "SGLANG_OPT_USE_ONLINE_COMPRESS (online C128)",
        ("online_c128", "c128_ring", "components"),
        lambda s: s.online_c128,
        lambda s: "on" if s.online_c128 else "off",
        _online_fix,
    ),
    Knob(
        "speculative",
        "--speculative-algorithm",
        ("c4_ring", "c128_ring", "draft", "components"),
        lambda s: s.speculative,
        _spec_show,
        _spec_fix,
    ),
    Knob(
        "draft_tokens",
        "--speculative-num-steps (draft tokens)",
        ("draft", "components"),
        lambda s: s.speculative_num_draft_tokens if s.speculative else None,
        _spec_show,
        _steps_fix,
    ),
    Knob(
        "sliding_window",
        "sliding_window (config.json / --json-model-override-args)",
        ("sliding_window", "draft"),
        lambda s: s.sliding_window,
        lambda s: f"{s.sliding_window} ({s.window_source})",
        _window_fix,
    ),
    Knob(
        "state_dtype",
        "SGLANG_DSV4_COMPRESS_STATE_DTYPE",
        ("c4_state_dtype", "c128_state_dtype", "components"),
        lambda s: s.state_dtype,
        lambda s: s.state_dtype,
        _state_fix,
    ),
)


def _knob_differs(k: Knob, p: SGLangSide, d: SGLangSide) -> bool:
    if k.name == "draft_tokens" and not (p.speculative and d.speculative):
        return False  # "on one side only" belongs to the speculative knob
    return k.value(p) != k.value(d)


# --- what SGLang's own backend does when the pair is launched anyway -------------------------------


def consequence(factor: str, p: Any, d: Any) -> str:
    """Run-time effect of one differing factor under SGLang 0.5.19's own transfer backend."""
    if factor == "page_size":
        return (
            "SGLang's decode refuses the bootstrap (\"Page size mismatch ... Both servers must use the same "
            '--page-size value."), but the prefill waits in Bootstrapping until its timeout'
        )
    if factor == "kv_dtype":
        return (
            'SGLang\'s decode refuses the bootstrap ("KV cache dtype mismatch", the check beside the page '
            "size's), and the prefill waits in Bootstrapping until its timeout"
        )
    if factor == "layout":
        return (
            "paged and unified state components do not pair: wrong bytes or a failed transfer (SGLang compares neither)"
        )
    if factor == "compression_ratios":
        if isinstance(p, list) and isinstance(d, list) and sorted(p) == sorted(d):
            return (
                "same C4/C128 counts in another order: SGLang reports Success, but (layer, page) slots receive "
                "another layer's KV (measured: 640 of 750 slots wrong)"
            )
        return (
            f"different C4/C128 counts: SGLang's prefill transfer thread dies; requests hang until {TIMEOUT} "
            "and that prefill queue stays dead"
        )
    if factor == "stage":
        return "the buffers pair with other layers: wrong KV"
    if factor == "sliding_window":
        return (
            f"sliding window {p} vs {d}: SGLang reports Success (a log warning only), but every SWA entry lands "
            "one page off: wrong sliding-window KV"
        )
    if factor == "c4_ring":
        return (
            f"C4 state rings {p} vs {d}: wrong state; SGLang 0.5.19 reports Success while C4 compressor state "
            "lands in other ring slots (measured: 42 of 301 destination items wrong for a 700-token request), "
            "0.5.23 refuses the pair on both sides"
        )
    if factor == "c128_ring":
        if None in (p, d):
            return "one side has no C128 state: the components pair with the wrong buffers"
        if 1 in (p, d):
            return f"C128 state ring {p} vs {d} (online vs offline): wrong C128 state, no error (SGLang does not compare item lengths)"
        return (
            f"C128 state rings {p} vs {d}: wrong state; the partial 128-token group's state goes to another "
            "ring block, no error"
        )
    if factor == "online_c128":
        return "online vs offline C128 state: item sizes differ, wrong C128 state, no error"
    if factor in ("c4_state_dtype", "c128_state_dtype"):
        return f"compressor state in {p} vs {d}: item sizes differ, the decode reads misaligned state (SGLang does not compare item lengths)"
    if factor == "draft":
        if p and not d:
            return (
                "the prefill sends a draft SWA component the decode has no buffers for: SGLang's prefill transfer "
                f"thread dies; requests hang until {TIMEOUT} and that prefill queue stays dead"
            )
        if d and not p:
            return (
                "SGLang reports Success, but the decode's draft SWA KV is never written: the draft starts from "
                "stale state"
            )
        return "the two drafts' SWA geometry differs: the draft SWA lands at the wrong slots or sizes"
    if factor == "main_kv_item_lens":
        return "main KV pages of different sizes: misaligned KV (SGLang does not compare item lengths)"
    if factor == "components":
        return "state components pair by position: every one after the first difference meets the wrong buffers"
    return "the state layouts differ: wrong bytes"


# --- the comparison --------------------------------------------------------------------------------


@dataclass
class FactorDiff:
    name: str
    prefill: Any
    decode: Any
    consequence: str

    def line(self, layouts=None) -> str:
        p, d = describe_value(self.name, self.prefill, layouts), describe_value(self.name, self.decode, layouts)
        return f"{self.name}: {p} vs {d} -> {self.consequence}"


@dataclass
class Cause:
    heading: str
    prefill: str
    decode: str
    factors: list[FactorDiff]
    fix: str


@dataclass
class Verdict:
    prefill: SGLangSide
    decode: SGLangSide
    causes: list[Cause] = field(default_factory=list)
    unexplained: list[FactorDiff] = field(default_factory=list)
    pair: list[tuple[str, str]] = field(default_factory=list)  # (problem, fix) outside the pool layout
    harmless: list[str] = field(default_factory=list)  # settings that differ without moving a factor
    handshake: list[ErrorInfo] = field(default_factory=list)  # what pdstate's handshake checks raise

    @property
    def compatible(self) -> bool:
        launch = self.prefill.launch_errors or self.decode.launch_errors
        return not (self.causes or self.unexplained or self.pair or self.handshake or launch)

    @property
    def not_modelled(self) -> bool:
        return bool(self.prefill.not_modelled or self.decode.not_modelled)

    @property
    def unknown(self) -> bool:
        return bool(self.prefill.unknown or self.decode.unknown)


def side_report(side: SGLangSide) -> LayoutReport:
    """The side's layout report from pdstate's pool model. A KV dtype the paged pool cannot store
    (SGLang would not start with it either; ``launch_errors`` says so) is built as fp8 and the
    report keeps the dtype the side asked for, so the pair is still compared."""
    from pdstate.errors import OnlineC128MTPUnsupported, PoolConfigError
    from pdstate.pools.presets import build_worker_pools
    from pdstate.pools.reporting import build_report
    from pdstate.protocol.report import fingerprint

    settings = side.pool_settings()
    asked = settings.kv_dtype
    try:
        try:
            pools = build_worker_pools(settings)
        except PoolConfigError as exc:
            if "kv dtype" not in str(exc):
                raise
            pools = build_worker_pools(settings.with_(kv_dtype="float8_e4m3fn"))
    except (PoolConfigError, OnlineC128MTPUnsupported) as exc:
        raise SGLangArgsError(f"{side.role}: pdstate cannot build this layout: {type(exc).__name__}: {exc}") from None
    try:
        report, _ = build_report(pools.target, pools.draft)
    finally:
        pools.close()
    if report.kv_dtype != asked:
        report = report.model_copy(
            update={"kv_dtype": asked, "fingerprint": fingerprint(report.page_size, asked, report.factors)}
        )
    return report


def compare(prefill: SGLangSide, decode: SGLangSide) -> Verdict:
    from pdstate.protocol.compat import compat_errors
    from pdstate.protocol.report import diff

    v = Verdict(prefill, decode)
    for side, want in ((prefill, "prefill"), (decode, "decode")):
        if side.disaggregation_mode != want:
            has = side.disaggregation_mode
            v.pair.append(
                (
                    f"the {want} side has --disaggregation-mode {has}"
                    + (" (not a PD server)" if has == "null" else ""),
                    f"add `--disaggregation-mode {want}` to the {want} (give the prefill's launch first, the decode's second)",
                )
            )
    if prefill.transfer_backend != decode.transfer_backend:
        v.pair.append(
            (
                f"--disaggregation-transfer-backend: prefill {prefill.transfer_backend}, decode {decode.transfer_backend}: "
                "the two sides cannot exchange KV",
                f"set `--disaggregation-transfer-backend {prefill.transfer_backend}` on the decode (or "
                f"`{decode.transfer_backend}` on the prefill)",
            )
        )

    _backend_refusals(v)
    p_report, d_report = side_report(prefill), side_report(decode)
    v.handshake = compat_errors(p_report, d_report, "prefill")
    diffs = [FactorDiff(n, pv, dv, consequence(n, pv, dv)) for n, pv, dv in diff(p_report, d_report)]
    placed: set[str] = set()
    for knob in KNOBS:
        if not _knob_differs(knob, prefill, decode):
            continue
        mine = [f for f in diffs if f.name in knob.factors and f.name not in placed]
        placed.update(f.name for f in mine)
        if mine:
            v.causes.append(Cause(knob.heading, knob.show(prefill), knob.show(decode), mine, knob.fix(prefill, decode)))
        else:
            v.harmless.append(
                f"{knob.heading}: prefill {knob.show(prefill)}, decode {knob.show(decode)}: "
                "does not change the transferred layout here"
            )
    v.unexplained = [f for f in diffs if f.name not in placed]
    return v


def _backend_refusals(v: Verdict) -> None:
    """What ``--disaggregation-transfer-backend pdstate`` refuses at start or at run time
    (``launch.backend``, the backend's own rules), added to the verdict."""
    from pdstate.integrations.sglang.launch.backend import context_parallel_refusal, topology_refusal

    p, d = v.prefill, v.decode
    for s in (p, d):
        if s.transfer_backend == "pdstate":
            why = context_parallel_refusal(s.attn_cp_size, s.dcp_size)
            if why:
                s.launch_errors.append(f"ValueError from pdstate's KV manager: {why}")
    if p.transfer_backend == d.transfer_backend == "pdstate":
        why = topology_refusal(p.pp_size, d.pp_size, p.attn_tp_size, d.attn_tp_size)
        if why:
            fix = (
                f"launch both sides with one --pp-size (prefill {p.pp_size}, decode {d.pp_size})"
                if p.pp_size != d.pp_size
                else f"give the decode an attention TP of at most {p.attn_tp_size} (--tp / --dp with "
                f"--enable-dp-attention: attention TP = tp / dp), or widen the prefill's"
            )
            v.pair.append((f"pdstate's SGLang backend fails every request of this pair: {why}", fix))


def render(v: Verdict, strict: bool = False, layouts=None, verbose: bool = False) -> tuple[str, bool]:
    """The report as text, and whether the pair passes (``strict``: no setting may be unknown to
    SGLang's own parser). It never says "compatible" when the pair does not pass."""
    from pdstate.protocol.fixes import summarize

    out: list[str] = []
    for s in (v.prefill, v.decode):
        out.append(f"{s.role} ({s.origin}): {s.describe()}")
        out += [f"  note: {n}" for n in s.notes]
        out += [f"  not modelled: {n}" for n in s.not_modelled]
        out += [
            f"  unknown: {u} (SGLang {s.release}'s parser does not know it: SGLang exits with "
            "'unrecognized arguments' unless a wrapper takes it)"
            for u in s.unknown
        ]
        if verbose and s.neutral:
            out.append(f"  layout-neutral: {', '.join(s.neutral)}")
    n_neutral = len(v.prefill.neutral) + len(v.decode.neutral)
    if n_neutral:
        out.append(
            f"{n_neutral} setting{'s' if n_neutral != 1 else ''} (prefill {len(v.prefill.neutral)}, decode "
            f"{len(v.decode.neutral)}) {'do' if n_neutral != 1 else 'does'} not affect the state layout"
            + ("" if verbose else " (--verbose lists them)")
        )
    for h in v.harmless:
        out.append(f"same layout although {h}")
    ok = v.compatible and not (strict and v.unknown)
    if v.compatible and not ok:
        n = len(v.prefill.unknown) + len(v.decode.unknown)
        out.append(f"not confirmed (--strict): {n} setting{'s' if n != 1 else ''} unknown to SGLang's parser above")
        return "\n".join(out), ok
    if v.compatible:
        caveat = " (in what is modelled; see 'not modelled' above)" if v.not_modelled else ""
        caveat = caveat or (" (see 'unknown' above)" if v.unknown else "")
        out.append(f"compatible{caveat}")
        return "\n".join(out), ok
    n_launch = len(v.prefill.launch_errors) + len(v.decode.launch_errors)
    n = len(v.causes) + len(v.unexplained) + len(v.pair) + n_launch
    out.append(f"INCOMPATIBLE: {n} problem{'s' if n != 1 else ''}")
    for s in (v.prefill, v.decode):
        out += [f"- the {s.role}: SGLang would not start: {e}" for e in s.launch_errors]
    for problem, fix in v.pair:
        out.append(f"- {problem}")
        out.append(f"  fix: {fix}")
    for c in v.causes:
        out.append(f"- {c.heading}: prefill {c.prefill}, decode {c.decode}")
        out += [f"  {f.line(layouts)}" for f in c.factors]
        out.append(f"  fix: {c.fix}")
    for f in v.unexplained:
        out.append(f"- {f.line(layouts)}")
        out.append("  fix: make the two launches build the same layout (no single SGLang setting explains this)")
    if v.handshake:
        first = v.handshake[0]
        out.append(
            f"pdstate's handshake refuses the pair with {first.type}: {summarize(first.type, first.message, layouts)}"
        )
    return "\n".join(out), ok
