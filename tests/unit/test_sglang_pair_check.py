"""The two-process SGLang driver's byte check and table helpers, without SGLang (pure numpy)."""

from __future__ import annotations

import numpy as np

from pdstate.devtools.sglang_pair import pattern, table


def _dest(n_items: int, item_len: int) -> np.ndarray:
    return np.full(n_items * item_len, pattern.SENTINEL, dtype=np.uint8)


def test_patterns_differ_by_key_and_offset_and_never_hold_the_sentinel():
    a, b = pattern.item_bytes(("kv", 1, "L2", 0, 4096), 4096), pattern.item_bytes(("kv", 1, "L3", 0, 4096), 4096)
    assert not np.array_equal(a, b)
    assert not np.array_equal(a[:8], a[8:16])  # a shifted copy does not match
    for key in range(2000):  # tags whose bytes hit the sentinel are mapped off it
        assert pattern.SENTINEL not in pattern.item_bytes(("k", key), 64)
    assert len(pattern.item_bytes(("odd",), 13)) == 13


def test_check_counts_right_wrong_and_outside_bytes():
    item_len, keys = 64, {1: ("a",), 3: ("b",)}
    view = _dest(5, item_len)
    assert pattern.check_buffer(view, item_len, keys) == (320, 2, 0)  # nothing landed: both wrong
    pattern.write_items(view, item_len, keys)
    assert pattern.check_buffer(view, item_len, keys) == (320, 0, 0)
    view[4 * item_len + 5] = 0  # one byte outside the destinations
    view[1 * item_len] ^= 1  # one byte of item 1
    assert pattern.check_buffer(view, item_len, keys) == (320, 1, 1)
    assert pattern.changed_bytes(view) == 2 * item_len + 1


def test_memory_is_a_view_of_the_address():
    buf = np.zeros(16, dtype=np.uint8)
    pattern.memory(buf.ctypes.data, 16)[3] = 7
    assert buf[3] == 7


def test_factor_of_a_refusal():
    assert (
        table.factor_of("LayoutMismatch: DSV4 layout mismatch on c4_ring: prefill server has c4_ring=16") == "c4_ring"
    )
    assert table.factor_of("PageSizeMismatch: Page size mismatch: prefill server has page_size=512") == "page_size"
    assert table.factor_of("KVTransferError: something else") is None and table.factor_of(None) is None


def test_a_failed_pair_that_wrote_is_not_rendered_as_clean():
    r = {
        "prefill": {"outcome": "Failed", "failure": "LayoutMismatch: DSV4 layout mismatch on draft: ..."},
        "decode": {"outcome": "Failed", "failure": "x", "changed_bytes": 10},
        "elapsed_s": 0.2,
    }
    assert table.describe_request(r, 3.0) == "Failed on both sides in < 1 s (`draft`), 10 bytes written"
