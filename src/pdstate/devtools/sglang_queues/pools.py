"""Real DSV4-Flash-shaped SGLang pools for one side, on SGLang 0.5.19 or 0.5.23.

Imported only by the driver's child processes, after ``boot``. The pools are the ones
``devtools.sglang_pair.pools`` builds (``cases.Side``: 43 layers, C4/C128 alternating, an optional
NextN draft sharing the target's SWA mapping), on the queues' own request-to-token pool and with a
sampling mask in ``MetadataBuffers`` (0.5.23). The queues fill ``KVArgs`` themselves;
``request_items`` says what every item of a request holds.
"""

from __future__ import annotations

from types import SimpleNamespace

from pdstate.devtools.sglang_pair import pools as pair_pools
from pdstate.devtools.sglang_pair.pools import KV_CACHE_DTYPE, SWA_RING, buffers, request_items

__all__ = ["KV_CACHE_DTYPE", "SAMPLING_MASK_TOKENS", "SWA_RING", "buffers", "build", "request_items"]

SAMPLING_MASK_TOKENS = 16  # MetadataBuffers' max_sampling_mask_tokens (0.5.23)


def build(side, req_to_token_pool, *, hold_pages: int = 0, stage: tuple[int, int] | None = None) -> SimpleNamespace:
    """The pools of ``side`` (its server args published first): ``target``, ``draft`` (or None),
    ``alloc``, ``meta`` (aux), ``labels``; ``hold_pages`` pages are taken first, so that the
    decode's pages differ from the prefill's; ``stage``: a PP stage's layers ``[start, end)``."""
    return pair_pools.build(
        side, hold_pages=hold_pages, req_pool=req_to_token_pool, sampling_mask_tokens=SAMPLING_MASK_TOKENS, stage=stage
    )
