"""``pdstate probe``'s readable report (``service.probe.format_probe``) of workers' documents."""

from __future__ import annotations

from pdstate.service.probe import format_probe


def test_a_peers_long_error_is_printed_clipped():
    """A worker's document quoting a peer's error of 8 MiB (a worker of an older version keeps
    them whole) prints as a line of the cap (8192 characters of message), marked."""
    n = 8 << 20
    doc = {
        "role": "prefill",
        "worker_id": "p",
        "incarnation": "",
        "protocol_version": 1,
        "engine": "shm",
        "control": "tcp://127.0.0.1:5601",
        "fingerprint": "0" * 32,
        "layout": {"page_size": 256},
        "local_check": {"ok": True, "error": None},
        "peers": [{"id": "d", "state": "rejected", "error": {"type": "KVCacheDtypeMismatch", "message": "m" * n}}],
    }
    lines = format_probe({"workers": [{"url": "http://127.0.0.1:8101", "ready": {"ready": True}, "compat": doc}]})
    [peer] = [line for line in lines.splitlines() if line.startswith("  peers ")]
    assert peer == "  peers        d rejected: KVCacheDtypeMismatch: " + "m" * 8175 + f"…(+{n - 8175} chars)"
