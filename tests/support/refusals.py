"""The own-pair refusals (a worker's own pools refused before any peer is met), built as the pools
build them: one table for the fix-line tests, each adding or dropping its own kinds."""

from __future__ import annotations

from pdstate import errors as e

OWN_PAIR: dict[str, e.PdStateError] = {
    "SWAIndexMappingNotShared": e.SWAIndexMappingNotShared(),
    "DraftNotSWAOnly": e.DraftNotSWAOnly(),
    "UnifiedKVModeMismatch": e.UnifiedKVModeMismatch(),
    "SWARingGeometryMismatch": e.SWARingGeometryMismatch.build((128, 131, 655), (64, 67, 335)),
    "PagedSWAGeometryMismatch": e.PagedSWAGeometryMismatch.build((256, 128), (512, 128)),
    "DraftMappingMissing": e.DraftMappingMissing(),
    "OnlineC128MTPUnsupported": e.OnlineC128MTPUnsupported(),
}
