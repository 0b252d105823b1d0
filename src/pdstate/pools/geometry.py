"""Pure arithmetic of the DSV4 pool layout: ring sizes, row sizes, buffer shapes.

Formulas are the upstream ones as observed (see ``shared/conformance/LAYOUT_NOTES.md``):
- one paged KV row = one page of 584-byte token records (576 value bytes + 8 scale bytes), padded
  up to a multiple of 576 bytes; a pool of ``size`` tokens has ``(size + page + 1) // page`` rows;
- compress-state pools are ``[rows, last_dim]`` with rows rounded up to the compression ratio;
- a unified layer is bf16 ``[swa_pages + c128_size*K[ratio] + page_size//ratio, 512]``.
"""

from __future__ import annotations

from pdstate.errors import OnlineC128MTPUnsupported

C4, C128, SWA_ONLY = 4, 128, 0
UNIFIED_K_PER_BLOCK = {SWA_ONLY: 0, C4: 32, C128: 1}
C128_ITEM_ROWS = 128  # offline C128 state items are 128 rows, whatever the ring (an upstream quirk)


def value_bytes_per_token(qk_nope_head_dim: int, qk_rope_head_dim: int) -> int:
    """fp8 nope + bf16 rope bytes of one token (576 for DSV4)."""
    return qk_nope_head_dim + 2 * qk_rope_head_dim


def kv_bytes_per_token(qk_nope_head_dim: int, qk_rope_head_dim: int) -> int:
    """Value bytes plus one fp8 scale per 64 nope dims plus one pad byte (584 for DSV4)."""
    return value_bytes_per_token(qk_nope_head_dim, qk_rope_head_dim) + qk_nope_head_dim // 64 + 1


def paged_row_bytes(page: int, bytes_per_token: int, pad_unit: int) -> int:
    return -(-page * bytes_per_token // pad_unit) * pad_unit


def paged_num_rows(size: int, page: int) -> int:
    return (size + page + 1) // page


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def c4_ring_size(speculative: bool) -> int:
    return 16 if speculative else 8


def c128_ring_size(speculative: bool, online_c128: bool, online_c128_mtp: bool) -> int:
    """C128 compress-state ring; online C128 under speculation needs the online-MTP option."""
    if online_c128:
        if speculative and not online_c128_mtp:
            raise OnlineC128MTPUnsupported()
        return 1
    return 256 if speculative else 128


def unified_ring(sliding_window: int, speculative_num_draft_tokens: int | None) -> int:
    spec = speculative_num_draft_tokens or 0
    return sliding_window + (spec - 1 if spec > 0 else 0)


def unified_layer_rows(ratio: int, swa_pages: int, c128_size: int, page_size: int) -> int:
    return swa_pages + c128_size * UNIFIED_K_PER_BLOCK[ratio] + (page_size // ratio if ratio else 0)


def physical_num_rows(size: int, page: int, global_page: int) -> int:
    """0.5.23's rows of a paged buffer: ``ceil((size + global_page) / page)`` (the allocator's
    reserved logical page, counted at the model-wide page size ``global_page``)."""
    return -(-(size + global_page) // page)
