"""A per-request cost model of pdstate, fitted from one ``pdstate bench`` run and projected to
another host.

Per request of ``B`` bytes at verification level ``L``::

    t = fixed + per_byte * B + verify_per_byte[L] * B        (verify_per_byte["off"] = 0)

- ``fixed``: what a request costs whatever its size (the control path, the planning, the wake-ups);
- ``per_byte``: moving a byte (the engine's copy, on this host's transport);
- ``verify_per_byte[L]``: what level ``L``'s digests add per byte moved (both sides). At ``full``
  every byte is digested, so it is the cost of digesting one byte; ``sampled`` over ``full``
  (``sampled_fraction``) is the share of ``full``'s digest work the default level does.

``fit`` solves it by least squares (numpy, relative residuals) from ``(level, bytes, seconds)`` points. ``fit_results``
takes a run's figures: the agent phase's rows at ``off``, ``sampled`` and ``full`` (shm; the
verification parts come from here: it is the only phase with all three levels), the native engines'
``pdstate_<engine>`` rows (``sampled``) and ``pdstate_<engine>_full_verify`` rows (``full``) with
the agent's verification parts held fixed, the raw engines' rows, and the sglang phase's rows per
release (SGLang's own Mooncake backend: no verification; backend pdstate at ``sampled`` and
``full``), their bytes from ``sglang_bytes_by_release`` where the run counted them, else the agent
phase's bytes at the same length (the ``dsv4-flash`` preset's).

``project`` moves a fit to a ``Target``: the fixed part as measured here, the per-byte part the
target's link, the verification part its device digest (``agent.verify.lane_values``: each side
reduces what it digests where the memory lives), both sides in series. ``H200_RDMA`` states its
figures and where each comes from; ``markdown`` renders the fits and the projection
(``docs/performance.md``'s "Cost model" section, and ``bench.md``'s last tables).

``python -m pdstate.devtools.cost_model bench-out/bench.json`` prints that section from a saved run.
Pure functions over the results dict: no benchmark, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdstate.errors import ExitCode

LEVELS = ("off", "sampled", "full")
AGENT_PATHS = {
    "off": "paged:agent:agent_shm",
    "sampled": "paged:agent:agent_shm_sampled",
    "full": "paged:agent:agent_shm_digest",
}
ENGINES = ("mooncake", "nixl")
SGLANG_LEVELS = {"pdstate": "sampled", "pdstate@full": "full"}  # backend pdstate's rows, by level
_GB = 1e9  # the bytes column is solved in GB (conditioning)

Point = tuple[str, float, float]  # (level, bytes, seconds)


@dataclass(frozen=True)
class Fit:
    fixed_s: float
    per_byte_s: float
    verify_per_byte_s: dict[str, float] = field(default_factory=lambda: {"off": 0.0})
    points: int = 0
    rel_rms: float = 0.0  # the residuals' root mean square, relative to each point's time

    def predict(self, nbytes: float, level: str = "off") -> float:
        """Seconds for one request of ``nbytes`` at ``level``."""
        return self.fixed_s + (self.per_byte_s + self.verify_per_byte_s.get(level, 0.0)) * nbytes


def fit(points: list[Point], verify: dict[str, float] | None = None) -> Fit:
    """Least squares ``t = fixed + per_byte * B + verify[level] * B`` over ``points``, each
    residual relative to its point's time (the lengths span 2k to 128k tokens: 30x in time).

    Without ``verify``, each level other than ``off`` present gets its own verification part, which
    needs ``off`` points to separate it from ``per_byte``. With ``verify`` (s per byte, per level),
    those parts are held fixed and only ``fixed`` and ``per_byte`` are fitted. ``ValueError`` when
    the points cannot determine the unknowns."""
    levels = [] if verify is not None else [lv for lv in LEVELS[1:] if any(p[0] == lv for p in points)]
    if levels and not any(p[0] == "off" for p in points):
        raise ValueError("a verification part needs points at 'off' to tell it from the per-byte part")
    unknowns = 2 + len(levels)
    if len({(p[0], p[1]) for p in points}) < unknowns:
        raise ValueError(f"{len(points)} point(s) cannot determine {unknowns} unknowns")
    a = np.array([[1.0, b / _GB] + [b / _GB if lv == level else 0.0 for lv in levels] for level, b, _ in points])
    held = verify or {}
    y = np.array([t - held.get(level, 0.0) * b for level, b, t in points])
    times = np.array([t for _, _, t in points])
    w = 1.0 / times  # relative errors: a 128k request's milliseconds do not drown a 2k request's
    coef, _, rank, _ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    if rank < unknowns:
        raise ValueError(f"the points determine {rank} of {unknowns} unknowns (one request size?)")
    rel = (a @ coef - y) / times
    parts = {"off": 0.0} | dict(held) | {lv: float(c) / _GB for lv, c in zip(levels, coef[2:])}
    return Fit(float(coef[0]), float(coef[1]) / _GB, parts, len(points), float(np.sqrt(np.mean(rel**2))))


def _points(results: dict, by_level: dict[str, str]) -> list[Point]:
    paths, out = results.get("paths") or {}, []
    for level, path in by_level.items():
        for row in (paths.get(path) or {}).values():
            if row.get("bytes") and (row.get("seconds") or {}).get("median"):
                out.append((level, float(row["bytes"]), float(row["seconds"]["median"])))
    return out


def _try(points: list[Point], verify: dict[str, float] | None = None) -> Fit | None:
    try:
        return fit(points, verify) if points else None
    except ValueError:
        return None


def request_bytes(results: dict, release: str, backend: str) -> dict[str, float]:
    """Per length, the bytes one request of the sglang phase moves: counted by the run
    (``sglang_bytes_by_release``) where it did, else the agent phase's at that length."""
    counted = ((results.get("sglang_bytes_by_release") or {}).get(release) or {}).get(backend.split("@")[0])
    if counted:
        return {str(n): float(v) for n, v in counted.items()}
    row = (results.get("paths") or {}).get(AGENT_PATHS["off"]) or {}
    return {n: float(v["bytes"]) for n, v in row.items() if v.get("bytes")}


def fit_results(results: dict) -> dict[str, Fit]:
    """Every fit one run's figures allow (see the module's docstring), by name: ``agent``,
    ``pdstate_<engine>``, ``raw_<engine>``, ``sglang <release> mooncake`` and ``sglang <release>
    pdstate``. A group whose points cannot determine its unknowns is left out."""
    out: dict[str, Fit] = {}
    agent = _try(_points(results, AGENT_PATHS))
    if agent is not None and {"sampled", "full"} <= set(agent.verify_per_byte_s):
        out["agent"] = agent
    verify = out["agent"].verify_per_byte_s if "agent" in out else None
    for e in ENGINES:
        raw = _try(_points(results, {"off": f"paged:{e}:raw_{e}"}))
        if raw is not None:
            out[f"raw_{e}"] = raw
        if verify is not None:
            by = {"sampled": f"paged:{e}:pdstate_{e}", "full": f"paged:{e}:pdstate_{e}_full_verify"}
            ours = _try(_points(results, by), verify)
            if ours is not None:
                out[f"pdstate_{e}"] = ours
    for release, by in (results.get("sglang_by_release") or {}).items():
        theirs = _sglang_points(results, release, by, {"mooncake": "off"})
        f = _try(theirs)
        if f is not None:
            out[f"sglang {release} mooncake"] = f
        if verify is not None:
            f = _try(_sglang_points(results, release, by, SGLANG_LEVELS), verify)
            if f is not None:
                out[f"sglang {release} pdstate"] = f
    return out


def _sglang_points(results: dict, release: str, by: dict, backends: dict[str, str]) -> list[Point]:
    out = []
    for backend, level in backends.items():
        nbytes = request_bytes(results, release, backend)
        for n, ms in (by.get(backend) or {}).items():
            if ms and n in nbytes:
                out.append((level, nbytes[n], ms / 1e3))
    return out


@dataclass(frozen=True)
class Target:
    """A host pair to project to: what moves a byte, what digests one, and where the figures are from."""

    name: str
    link_bytes_s: float  # one request's bytes over the link, effective
    device_digest_bytes_s: float  # ``lane_values`` on the device, effective
    digest_sides: int  # sides digesting one after the other on the request's path
    sources: tuple[str, ...]


H200_RDMA = Target(
    name="two H200 hosts, 400 Gb/s RDMA, device digests",
    link_bytes_s=400e9 / 8 * 0.966,
    device_digest_bytes_s=4.8e12 * 0.8 / 3,
    digest_sides=2,
    sources=(
        "link: one 400 Gb/s port per side (ConnectX-7, NDR 400 Gb/s: NVIDIA's ConnectX-7 user manual), at 96.6% "
        "of line rate, the RDMA write ceiling `ib_write_bw` reaches on a 100 Gb/s EDR link (NVIDIA developer "
        "forum, 'Theoretical bandwidth and latency of NIC'): 48.3 GB/s",
        "device digest: H200 HBM3e 4.8 TB/s (NVIDIA's H200 specification); `lane_values` reads each item, "
        "writes its 64-bit products and reads them again to sum (3 passes over the bytes), at 80% of peak: "
        "1.28 TB/s; `tests/gpu/test_cost_model.py` measures it against the device's own copy bandwidth",
        "both sides digest on the request's path, one after the other (the prefill before `TransferDone`, the "
        "decode after the last byte lands); the fixed parts are this host's (an H200 host's CPU is not slower)",
    ),
)


ZERO = Fit(0.0, 0.0)  # no fixed part: ``project`` then gives the per-byte parts alone


def sampled_fraction(agent: Fit) -> float | None:
    """The share of ``full``'s digest work ``sampled`` did here (its verification part / ``full``'s)."""
    full = agent.verify_per_byte_s.get("full")
    return agent.verify_per_byte_s.get("sampled", 0.0) / full if full else None


def project(f: Fit, target: Target, nbytes: float, level: str, fraction: float | None) -> float:
    """Seconds for one request of ``nbytes`` at ``level`` on ``target``: ``f``'s fixed part, the
    bytes over the target's link, and the level's share (``fraction`` at ``sampled``, 1 at
    ``full``) of the bytes digested on the device by each side in turn."""
    share = {"off": 0.0, "full": 1.0}.get(level, fraction or 0.0)
    digest = share * nbytes * target.digest_sides / target.device_digest_bytes_s
    return f.fixed_s + nbytes / target.link_bytes_s + digest


def projection(results: dict, target: Target = H200_RDMA) -> dict:
    """Per SGLang release and length: SGLang's own backend and backend pdstate (``sampled`` and
    ``full``) on ``target``, ms, and SGLang's time / pdstate's (above 1: pdstate faster), whole and
    of the per-byte parts alone (the link's time / the link's and the device digests': what the
    fixed parts measured here do not decide). Empty without the agent fit or the sglang phase."""
    fits = fit_results(results)
    if "agent" not in fits:
        return {}
    frac = sampled_fraction(fits["agent"])
    out: dict = {}
    for release in results.get("sglang_by_release") or {}:
        theirs, ours = fits.get(f"sglang {release} mooncake"), fits.get(f"sglang {release} pdstate")
        if theirs is None or ours is None:
            continue
        rows = {}
        for n, b in sorted(request_bytes(results, release, "pdstate").items(), key=lambda kv: int(kv[0])):
            sgl = project(theirs, target, b, "off", frac)
            pd = {lv: project(ours, target, b, lv, frac) for lv in ("sampled", "full")}
            link = b / target.link_bytes_s  # the per-byte parts alone: SGLang's / pdstate's
            per_byte = {lv: link / (project(ZERO, target, b, lv, frac)) for lv in ("sampled", "full")}
            rows[n] = {
                "bytes": b,
                "sglang_ms": sgl * 1e3,
                "pdstate_ms": pd["sampled"] * 1e3,
                "pdstate_full_ms": pd["full"] * 1e3,
                "ratio": sgl / pd["sampled"],
                "ratio_full": sgl / pd["full"],
                "per_byte_ratio": per_byte["sampled"],
                "per_byte_ratio_full": per_byte["full"],
            }
        out[release] = rows
    return out


def _label(n: str) -> str:
    k = int(n)
    return f"{k // 1024}k" if k % 1024 == 0 else str(k)


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def _per_gb(s_per_byte: float | None) -> str:
    return "–" if s_per_byte is None else f"{s_per_byte * 1e9 * 1e3:.1f}"


def markdown(results: dict, target: Target = H200_RDMA) -> str:
    """The fits, the target's figures and the projection, as markdown ("" when nothing fits)."""
    fits = fit_results(results)
    if not fits:
        return ""
    out = [
        "| fit: t = fixed + per byte x B + verify(level) x B | points | fixed, ms | per byte, ms/GB "
        "| verify `sampled`, ms/GB | verify `full`, ms/GB | residual (rms, relative) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in fits.items():
        v = f.verify_per_byte_s
        out.append(
            f"| {name} | {f.points} | {_ms(f.fixed_s)} | {_per_gb(f.per_byte_s)} | {_per_gb(v.get('sampled'))} "
            f"| {_per_gb(v.get('full'))} | {100 * f.rel_rms:.1f}% |"
        )
    frac = sampled_fraction(fits["agent"]) if "agent" in fits else None
    if frac is not None:
        out += ["", f"`sampled` did {100 * frac:.0f}% of `full`'s digest work per byte in this run (agent phase)."]
    proj = projection(results, target)
    if not proj:
        return "\n".join(out) + "\n"
    out += [
        "",
        f"| projected to {target.name} | value |",
        "|---|---|",
        f"| link, effective | {target.link_bytes_s / 1e9:.1f} GB/s ({_per_gb(1 / target.link_bytes_s)} ms/GB) |",
        f"| device digest, effective | {target.device_digest_bytes_s / 1e12:.2f} TB/s per side, "
        f"{target.digest_sides} sides in series |",
    ]
    for release, rows in proj.items():
        lengths = list(rows)
        out += [
            "",
            f"| projected from SGLang {release}'s fits, ms | " + " | ".join(_label(n) for n in lengths) + " |",
            "|---" * (len(lengths) + 1) + "|",
            "| MB per request (`sglang_bytes_by_release`, else the agent phase's) | "
            + " | ".join(f"{rows[n]['bytes'] / 1e6:.1f}" for n in lengths)
            + " |",
            "| SGLang's own backend | " + " | ".join(f"{rows[n]['sglang_ms']:.2f}" for n in lengths) + " |",
            "| backend pdstate, `sampled` | " + " | ".join(f"{rows[n]['pdstate_ms']:.2f}" for n in lengths) + " |",
            "| backend pdstate, `full` | " + " | ".join(f"{rows[n]['pdstate_full_ms']:.2f}" for n in lengths) + " |",
            "| ratio, `sampled` (above 1: pdstate faster) | "
            + " | ".join(f"{rows[n]['ratio']:.2f}" for n in lengths)
            + " |",
            "| ratio, `full` | " + " | ".join(f"{rows[n]['ratio_full']:.2f}" for n in lengths) + " |",
            "| per-byte parts alone (link / link + device digests), `sampled` | "
            + " | ".join(f"{rows[n]['per_byte_ratio']:.2f}" for n in lengths)
            + " |",
            "| per-byte parts alone, `full` | "
            + " | ".join(f"{rows[n]['per_byte_ratio_full']:.2f}" for n in lengths)
            + " |",
        ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m pdstate.devtools.cost_model BENCH_JSON``: print the cost model of a saved run."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pdstate.devtools.cost_model bench-out/bench.json", file=sys.stderr)
        return int(ExitCode.CONFIG)
    try:
        results = json.loads(Path(args[0]).read_text())
    except (OSError, ValueError) as exc:
        print(f"cost_model: cannot read {args[0]}: {exc}", file=sys.stderr)
        return int(ExitCode.FAILED)
    text = markdown(results)
    print(text or "cost_model: the run has no figures to fit (no agent phase?)", end="" if text else "\n")
    return int(ExitCode.OK if text else ExitCode.FAILED)


if __name__ == "__main__":
    raise SystemExit(main())
