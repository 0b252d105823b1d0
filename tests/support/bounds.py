"""Wall-clock bounds: one way for a test to bound an elapsed time, and the table of them a run prints.

A test bounds a time with ``within(what, measured_s, bound_s, quiet_s)``: ``quiet_s`` is what that
time measured on a quiet machine (written beside the call, with where it was measured), and the
bound must be at least ``MARGIN`` times it, so that a loaded machine (a CI runner, six test runs on
two cores) does not fail a correct change. The tight numbers themselves belong in ``pdstate
bench``, never in a test. Each call is recorded; ``tests/conftest.py`` prints every measured time
beside its bound at the end of a run (``BOUNDS.table()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A bound is at least this many times what it measures on a quiet machine.
MARGIN = 5.0


@dataclass(frozen=True)
class Measured:
    what: str
    measured_s: float
    bound_s: float
    quiet_s: float


@dataclass
class Bounds:
    rows: list[Measured] = field(default_factory=list)

    def table(self) -> str:
        head = ("bound", "measured", "bound", "quiet", "bound / measured")
        body = [
            (
                r.what,
                f"{r.measured_s:.3f} s",
                f"{r.bound_s:.3f} s",
                f"{r.quiet_s:.3f} s",
                f"{r.bound_s / r.measured_s:.1f}x" if r.measured_s > 0 else "-",
            )
            for r in self.rows
        ]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        return "\n".join(line.rstrip() for line in lines + [fmt.format(*b) for b in body])


BOUNDS = Bounds()


def within(what: str, measured_s: float, bound_s: float, quiet_s: float) -> float:
    """Assert ``measured_s < bound_s`` (``what`` names the time in the failure) and record it;
    ``bound_s`` must be at least ``MARGIN * quiet_s``. Returns ``measured_s``."""
    assert bound_s >= MARGIN * quiet_s, f"{what}: bound {bound_s:g} s is under {MARGIN:g}x its quiet {quiet_s:g} s"
    BOUNDS.rows.append(Measured(what, measured_s, bound_s, quiet_s))
    assert measured_s < bound_s, f"{what}: {measured_s:.3f} s, bound {bound_s:g} s (quiet: {quiet_s:g} s)"
    return measured_s
