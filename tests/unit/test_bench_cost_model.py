"""The cost model: the least-squares fit recovers known parts exactly from synthetic figures, each
group of a run is fitted from its own rows, and the projection is the stated arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdstate.devtools import bench_tables, cost_model
from pdstate.devtools.cost_model import Fit, Target

FIXED, PER_BYTE = 2e-3, 0.5e-9  # 2 ms, 2 GB/s
VERIFY = {"off": 0.0, "sampled": 0.2e-9, "full": 0.6e-9}
SIZES = {"2048": 18e6, "8192": 42e6, "32768": 138e6, "131072": 530e6}


def _t(nbytes: float, level: str, fixed: float = FIXED, per_byte: float = PER_BYTE) -> float:
    return fixed + (per_byte + VERIFY[level]) * nbytes


def _rows(level: str, fixed: float = FIXED, per_byte: float = PER_BYTE) -> dict:
    return {n: {"bytes": b, "seconds": {"median": _t(b, level, fixed, per_byte)}} for n, b in SIZES.items()}


def _results() -> dict:
    """The agent at three levels (the parts above), Mooncake's pair (3 ms fixed, 1 GB/s), raw
    Mooncake (1 ms, 1.25 GB/s), and one SGLang release (its backend 4 ms and 1 GB/s; backend
    pdstate 5 ms and 1 GB/s, plus the verification parts) on 2k and 32k, bytes counted."""
    by_release = {
        "mooncake": {n: (4e-3 + 1e-9 * SIZES[n]) * 1e3 for n in ("2048", "32768")},
        "pdstate": {n: (5e-3 + (1e-9 + VERIFY["sampled"]) * SIZES[n]) * 1e3 for n in ("2048", "32768")},
        "pdstate@full": {n: (5e-3 + (1e-9 + VERIFY["full"]) * SIZES[n]) * 1e3 for n in ("2048", "32768")},
    }
    raw = {n: {"bytes": b, "seconds": {"median": 1e-3 + 0.8e-9 * b}} for n, b in SIZES.items()}
    return {
        "paths": {
            "paged:agent:agent_shm": _rows("off"),
            "paged:agent:agent_shm_sampled": _rows("sampled"),
            "paged:agent:agent_shm_digest": _rows("full"),
            "paged:mooncake:pdstate_mooncake": _rows("sampled", 3e-3, 1e-9),
            "paged:mooncake:pdstate_mooncake_full_verify": _rows("full", 3e-3, 1e-9),
            "paged:mooncake:raw_mooncake": raw,
        },
        "sglang_by_release": {"0.5.19": by_release},
        "sglang_bytes_by_release": {
            "0.5.19": {b: {n: SIZES[n] for n in ("2048", "32768")} for b in ("pdstate", "mooncake")}
        },
    }


def test_the_fit_recovers_known_parts_exactly():
    points = [(level, b, _t(b, level)) for level in cost_model.LEVELS for b in SIZES.values()]
    f = cost_model.fit(points)
    assert f.fixed_s == pytest.approx(FIXED, rel=1e-9) and f.per_byte_s == pytest.approx(PER_BYTE, rel=1e-9)
    assert f.verify_per_byte_s == pytest.approx(VERIFY, rel=1e-9, abs=1e-18)
    assert f.points == 12 and f.rel_rms < 1e-9
    assert f.predict(1e9, "full") == pytest.approx(FIXED + 1.1, rel=1e-9)
    assert cost_model.sampled_fraction(f) == pytest.approx(1 / 3)


def test_the_fit_is_least_squares_of_relative_residuals():
    """Two sizes at ``off``, each measured 10% high and 10% low: at each size the fit takes the time
    ``p`` that minimises ``((p - y1) / y1)^2 + ((p - y2) / y2)^2``, and the line runs through both."""
    pts = [("off", 1e8, 0.11), ("off", 1e8, 0.09), ("off", 3e8, 0.33), ("off", 3e8, 0.27)]
    f = cost_model.fit(pts)

    def best(y1: float, y2: float) -> float:
        return (1 / y1 + 1 / y2) / (1 / y1**2 + 1 / y2**2)

    p1, p3 = best(0.11, 0.09), best(0.33, 0.27)
    assert f.per_byte_s == pytest.approx((p3 - p1) / 2e8) and f.fixed_s == pytest.approx(p1 - 1e8 * f.per_byte_s)
    rel = [(p1 - 0.11) / 0.11, (p1 - 0.09) / 0.09, (p3 - 0.33) / 0.33, (p3 - 0.27) / 0.27]
    assert f.rel_rms == pytest.approx((sum(x * x for x in rel) / 4) ** 0.5)


def test_the_fit_refuses_what_its_points_cannot_determine():
    with pytest.raises(ValueError, match="needs points at 'off'"):
        cost_model.fit([("full", b, _t(b, "full")) for b in SIZES.values()])
    with pytest.raises(ValueError, match="cannot determine 2 unknowns"):
        cost_model.fit([("off", 1e6, 1.0), ("off", 1e6, 1.1)])
    held = cost_model.fit([("full", b, _t(b, "full")) for b in SIZES.values()], VERIFY)  # parts held: fine
    assert held.fixed_s == pytest.approx(FIXED) and held.per_byte_s == pytest.approx(PER_BYTE)


def test_each_group_of_a_run_is_fitted_from_its_own_rows():
    fits = cost_model.fit_results(_results())
    assert set(fits) == {"agent", "raw_mooncake", "pdstate_mooncake", "sglang 0.5.19 mooncake", "sglang 0.5.19 pdstate"}
    expect = {
        "agent": (FIXED, PER_BYTE),
        "raw_mooncake": (1e-3, 0.8e-9),
        "pdstate_mooncake": (3e-3, 1e-9),
        "sglang 0.5.19 mooncake": (4e-3, 1e-9),
        "sglang 0.5.19 pdstate": (5e-3, 1e-9),
    }
    for name, (fixed, per_byte) in expect.items():
        assert (fits[name].fixed_s, fits[name].per_byte_s) == (pytest.approx(fixed), pytest.approx(per_byte)), name
    assert fits["pdstate_mooncake"].verify_per_byte_s == fits["agent"].verify_per_byte_s  # held from the agent
    assert cost_model.fit_results({}) == {}
    assert cost_model.fit_results({"paths": {"paged:agent:agent_shm": _rows("off")}}) == {}  # one level only


def test_without_counted_bytes_the_agent_rows_give_them():
    r = _results()
    del r["sglang_bytes_by_release"]
    assert cost_model.request_bytes(r, "0.5.19", "pdstate@full") == SIZES
    assert cost_model.fit_results(r)["sglang 0.5.19 mooncake"].fixed_s == pytest.approx(4e-3)


def test_the_projection_is_the_stated_arithmetic():
    target = Target("a pair", link_bytes_s=50e9, device_digest_bytes_s=1e12, digest_sides=2, sources=())
    f = Fit(1e-3, 1e-9, {"off": 0.0, "sampled": 1e-10, "full": 3e-10})
    assert cost_model.project(f, target, 1e9, "off", 0.5) == pytest.approx(1e-3 + 0.02)
    assert cost_model.project(f, target, 1e9, "full", 0.5) == pytest.approx(1e-3 + 0.02 + 0.002)
    assert cost_model.project(f, target, 1e9, "sampled", 0.5) == pytest.approx(1e-3 + 0.02 + 0.001)
    proj = cost_model.projection(_results(), target)
    row = proj["0.5.19"]["32768"]
    b = SIZES["32768"]
    assert row["sglang_ms"] == pytest.approx((4e-3 + b / 50e9) * 1e3)
    assert row["pdstate_ms"] == pytest.approx((5e-3 + b / 50e9 + b * 2 / 1e12 / 3) * 1e3)
    assert row["pdstate_full_ms"] == pytest.approx((5e-3 + b / 50e9 + b * 2 / 1e12) * 1e3)
    assert row["ratio"] == pytest.approx(row["sglang_ms"] / row["pdstate_ms"])
    assert row["per_byte_ratio"] == pytest.approx(1 / (1 + 50e9 * 2 / 1e12 / 3))
    assert row["per_byte_ratio_full"] == pytest.approx(1 / (1 + 50e9 * 2 / 1e12))
    assert list(proj["0.5.19"]) == ["2048", "32768"]
    assert cost_model.projection({}) == {}


def test_the_section_renders_and_prints_from_a_saved_run(tmp_path):
    r = _results()
    md = cost_model.markdown(r).splitlines()
    assert "| agent | 12 | 2.00 | 500.0 | 200.0 | 600.0 | 0.0% |" in md
    assert "`sampled` did 33% of `full`'s digest work per byte in this run (agent phase)." in md
    assert "| link, effective | 48.3 GB/s (20.7 ms/GB) |" in md
    assert "| projected from SGLang 0.5.19's fits, ms | 2k | 32k |" in md
    assert "| MB per request (`sglang_bytes_by_release`, else the agent phase's) | 18.0 | 138.0 |" in md
    assert cost_model.markdown({}) == ""
    assert bench_tables.markdown(r, None).endswith("\n".join(md) + "\n")  # bench.md's last tables
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(r))
    cmd = [sys.executable, "-m", "pdstate.devtools.cost_model"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([*cmd, str(path)], capture_output=True, text=True, env=env, check=True).stdout
    assert out == cost_model.markdown(r)
    path.write_text("{}")
    empty = subprocess.run([*cmd, str(path)], capture_output=True, text=True, env=env)
    assert empty.returncode == 1 and "no figures to fit" in empty.stdout
