"""The pool variants and pairs the two-process SGLang driver runs (pure data: no torch, no SGLang).

A *side* is one server's pools: DeepSeek-V4-Flash-shaped (43 layers: 2 SWA-only, then C4/C128
alternating) paged pools, as SGLang builds them from its constructor keywords, with a variant:
speculative or not (the C4 state ring is 16 rows with speculation, 8 without), a NextN draft or
none, the C4/C128 layer order, the sliding window and the page size. A *case* pairs a prefill side
with a decode side; the mismatch cases are the ones SGLang 0.5.19 checks nothing of beyond the page
size (0.5.23's own backend refuses some of them: ``../shared/reference/sglang_cpu.md``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# DeepSeek-V4-Flash's 43 layers (2 SWA-only, 21 C4, 20 C128), and the same counts in another order.
FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)
FLASH_SWAPPED = (0, 0) + (128, 4) * 20 + (4,)
FLASH_OTHER_COUNTS = (0, 0) + (4, 128) * 20 + (128,)  # 20 C4, 21 C128

TEST_TOKENS = (700,)  # three pages of 256, the last partial: a C128 state row goes too


@dataclass(frozen=True)
class Side:
    """One server's pools, as the keywords of SGLang's ``DeepSeekV4TokenToKVPool`` take them."""

    speculative: bool = True
    draft: bool = True
    ratios: tuple[int, ...] = FLASH_RATIOS
    sliding_window: int = 128
    page_size: int = 256
    full_tokens: int = 2048  # capacity of the full (compressed) pools, in tokens
    swa_tokens: int = 1024
    max_num_reqs: int = 2  # request slots 0..2 (SGLang adds one): the prefill uses 0, the decode 2
    unified: bool = False  # 0.5.23's unified KV layout (the SWA window in per-slot rings, SWA_RING)

    def key(self) -> str:
        """A stable name for a child's pool cache."""
        return repr(sorted(asdict(self).items()))

    def to_json(self) -> dict:
        d = asdict(self)
        d["ratios"] = list(self.ratios)
        return d

    @classmethod
    def from_json(cls, d: dict) -> Side:
        return cls(**{**d, "ratios": tuple(d["ratios"])})


@dataclass(frozen=True)
class Case:
    """A prefill side facing a decode side; ``what`` says in words how they differ, ``factor`` what
    pdstate's handshake names (``None``: nothing differs), ``tokens`` the requests' lengths."""

    name: str
    what: str
    prefill: Side
    decode: Side
    factor: str | None = None
    tokens: tuple[int, ...] = TEST_TOKENS


BASE = Side()
NOSPEC = replace(BASE, speculative=False, draft=False)
SPEC_NODRAFT = replace(BASE, draft=False)

CORRECT = Case("correct", "the same pools on both sides", BASE, BASE)


def _case(name: str, what: str, prefill: Side, decode: Side, factor: str, tokens: tuple[int, ...] = TEST_TOKENS):
    return Case(name, what, prefill, decode, factor, tokens)


# 700 tokens: windows of 256 and 128 start on different pages; 600 tokens: windows of 64 and 128 do.
MISMATCHES: tuple[Case, ...] = (
    _case("spec_vs_nospec", "prefill speculative, decode not (C4 ring 16 vs 8)", SPEC_NODRAFT, NOSPEC, "c4_ring"),
    _case("nospec_vs_spec", "prefill not speculative, decode speculative (C4 ring 8 vs 16)", NOSPEC, SPEC_NODRAFT, "c4_ring"),
    _case("draft_decode_only", "a NextN draft on the decode only", SPEC_NODRAFT, BASE, "draft"),
    _case("draft_prefill_only", "a NextN draft on the prefill only", BASE, SPEC_NODRAFT, "draft"),
    _case("c4_c128_order", "the same C4/C128 layer counts in another order", BASE, replace(BASE, ratios=FLASH_SWAPPED), "compression_ratios"),
    _case("c4_c128_counts", "other C4/C128 layer counts (21/20 vs 20/21)", BASE, replace(BASE, ratios=FLASH_OTHER_COUNTS), "compression_ratios"),
    _case("window_256", "sliding window 256 (prefill) vs 128 (decode)", replace(BASE, sliding_window=256), BASE, "sliding_window"),
    _case("window_64", "sliding window 64 (prefill) vs 128 (decode)", replace(BASE, sliding_window=64), BASE, "sliding_window", (600,)),
    _case("page_size", "page size 512 (prefill) vs 256 (decode)", replace(BASE, page_size=512), BASE, "page_size"),
)  # fmt: skip

CASES: dict[str, Case] = {c.name: c for c in (CORRECT, *MISMATCHES)}

# Not speculative, no draft model: what a pipeline-parallel prefill runs (the scheduler-queue driver).
NO_DRAFT = Case("no_draft", "the same pools, not speculative, no draft model", NOSPEC, NOSPEC)
QUEUE_CASES: dict[str, Case] = {**CASES, NO_DRAFT.name: NO_DRAFT}

# The bench's pools: room for one 32k-token request (plus the window) on each side.
BENCH_SIDE = replace(BASE, full_tokens=36864, swa_tokens=4096)
# One page of BENCH_SIDE (256 tokens): SGLang's smallest request in pages, sent as one chunk with
# its state (``side.send``): what pdstate's fixed cost per request is measured against.
ONE_PAGE_TOKENS = BENCH_SIDE.page_size
BENCH_TOKENS = (ONE_PAGE_TOKENS, 2048, 8192, 32768)
