"""The reliability summary table printed at the end of a run (``tests/conftest.py``): one row per
scenario with its requests' outcomes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    scenario: str
    requests: int = 0
    succeeded: int = 0
    failed_with_reason: int = 0
    lost: int = 0
    leaked: int = 0
    detect_s: float | None = None
    note: str = ""


@dataclass
class Summary:
    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def table(self) -> str:
        head = ("scenario", "requests", "succeeded", "failed w/ reason", "lost", "leaked", "time to detect", "note")
        body = [
            (
                r.scenario,
                str(r.requests),
                str(r.succeeded),
                str(r.failed_with_reason),
                str(r.lost),
                str(r.leaked),
                "-" if r.detect_s is None else f"{r.detect_s:.2f} s",
                r.note,
            )
            for r in self.rows
        ]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*b) for b in body]
        return "\n".join(lines)


SUMMARY = Summary()


def tally(scenario: str, outcomes: list[dict], leaked: int = 0, detect_s: float | None = None, note: str = "") -> Row:
    """Count request outcomes (dicts with ``status`` and ``error``) into a summary row.

    A request is *lost* unless it ended ``success`` (verified, where the record says) or
    ``failed`` with an error that has a type and a message."""
    ok = [o for o in outcomes if o["status"] == "success" and o.get("verified", True)]
    failed = [
        o
        for o in outcomes
        if o["status"] == "failed" and o.get("error") and o["error"].get("type") and o["error"].get("message")
    ]
    row = Row(
        scenario, len(outcomes), len(ok), len(failed), len(outcomes) - len(ok) - len(failed), leaked, detect_s, note
    )
    return SUMMARY.add(row)
