"""Adapters that plug pdstate into serving engines (``sglang``: SGLang's disaggregation backend).

Nothing here imports an engine at import time: each adapter imports its engine only when asked to
register itself.
"""
