"""Upstream's own error texts, word for word: what the target/draft checks must raise (and what a
refused peer must read), written out here rather than imported from ``pdstate``."""

from __future__ import annotations

SWA_ONLY_ERROR = "DSV4 draft state transfer expects SWA-only NextN layers"
UNIFIED_ERROR = "DSV4 target and draft pools must use the same unified-KV mode"
MAPPING_ERROR = "DSV4 target and draft pools must share the SWA index mapping"
MISSING_MAPPING_ERROR = "'DeepSeekV4TokenToKVPool' object has no attribute 'full_to_swa_index_mapping'"

# pdstate's own fix line for the mapping refusal (every API error object carries one)
MAPPING_FIX = (
    "fix: register the allocator's full_to_swa_index_mapping on the draft pool (the same tensor object, "
    'not a clone or a view): set draft.mapping = "shared" on that worker'
)
