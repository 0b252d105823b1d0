"""Compare two predicted SGLang DSV4 servers with pdstate's own pool model and handshake checks.

``compare(prefill, decode)`` builds each side's ``LayoutReport`` from ``SGLangSide.pool_settings()``
(``pools.presets.build_worker_pools`` + ``pools.reporting.build_report``, small capacities), runs
``protocol.compat.compat_errors`` on the pair — the handshake's checks — and explains every
differing factor: its two values, what SGLang 0.5.19's own backend does at run time when the pair
is launched anyway (measured, ``shared/reference/sglang_cpu.md``), and which SGLang flag to change
on which side. Differing factors are grouped under the SGLang setting ("knob", ``knobs``) that
explains them: speculative decoding on one side changes the C4 and C128 rings, the draft and the
components. Each factor's run-time effect is ``consequences``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdstate.errors import SGLangArgsError
from pdstate.integrations.sglang.launch.consequences import consequence
from pdstate.integrations.sglang.launch.knobs import knob_differs, knobs
from pdstate.integrations.sglang.launch.side import SGLangSide
from pdstate.protocol.fixes import describe_value
from pdstate.protocol.report import ErrorInfo, LayoutReport

SIDES = ("prefill", "decode")


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
        report, _ = build_report(pools.target, pools.draft, settings=side.settings)
    finally:
        pools.close()
    if report.kv_dtype != asked:
        report = report.model_copy(
            update={"kv_dtype": asked, "fingerprint": fingerprint(report.page_size, asked, report.factors)}
        )
    return report


def compare(prefill: SGLangSide, decode: SGLangSide) -> Verdict:
    from pdstate.protocol.compat import compat_errors

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
    diffs = [FactorDiff(n, pv, dv, consequence(n, pv, dv)) for n, pv, dv in _diff(p_report, d_report)]
    placed: set[str] = set()
    for knob in knobs():
        if not knob_differs(knob, prefill, decode):
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


def _diff(p_report: LayoutReport, d_report: LayoutReport) -> list[tuple[str, Any, Any]]:
    """The differing factors, an optional one at its default shown by its default value."""
    from pdstate.protocol.report import diff

    return [
        (n, p_report.value(n) if pv is None else pv, d_report.value(n) if dv is None else dv)
        for n, pv, dv in diff(p_report, d_report)
    ]


def _backend_refusals(v: Verdict) -> None:
    """What ``--disaggregation-transfer-backend pdstate`` refuses at start (``launch.backend``, the
    backend's own rules), added to the verdict."""
    from pdstate.integrations.sglang import releases
    from pdstate.integrations.sglang.launch.backend import (
        context_parallel_refusal,
        pipeline_parallel_refusal,
        tokenizer_workers_refusal,
    )

    for role, s in (("prefill", v.prefill), ("decode", v.decode)):
        if s.transfer_backend == "pdstate":
            app_path = releases.nearest(s.release).tokenizer_workers_app_path
            pp = pipeline_parallel_refusal(s.pp_size, role, draft=s.speculative)
            cp = context_parallel_refusal(s.attn_cp_size, s.dcp_size)
            for why in (cp, tokenizer_workers_refusal(s.tokenizer_worker_num, app_path), pp):
                if why:
                    s.launch_errors.append(f"ValueError from pdstate's KV manager: {why}")


def wrap(text: str, width: int | None) -> str:
    """``text`` with each line folded to ``width`` columns (continuations indented 4 more), as is
    when ``width`` is ``None``."""
    if not width:
        return text
    import textwrap

    out: list[str] = []
    for line in text.splitlines():
        indent = line[: len(line) - len(line.lstrip(" "))]
        out += textwrap.wrap(
            line, width, subsequent_indent=indent + "    ", break_long_words=False, break_on_hyphens=False
        ) or [line]
    return "\n".join(out)


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
