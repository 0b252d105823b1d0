"""A two-process driver of SGLang's own disaggregation code (real pools, real managers) on CPU.

``pair.Pair`` runs a prefill child and a decode child under the cached SGLang environment of a
release (``integrations.sglang.releases``; the children follow the SGLang they imported,
``boot.release()``, and read its row: ``boot.row()``) and drives any transfer backend through ``get_kv_class`` in SGLang's call order; ``cases`` names the
pool variants and the mismatch pairs; ``table`` renders README's mismatch table from results.
Importing this package imports neither torch nor SGLang (only the children do, through ``boot``).
"""
