"""Named pool layouts, and the one call that builds a worker's target + draft + allocator.

- ``tiny``: the conformance defaults (layers ``[0, 4, 128]``, 1-layer draft, 1024 full tokens).
- ``dsv4-flash``: DeepSeek-V4-Flash, 43 layers ``[0, 0, 4, 128, 4, ..., 128, 4]`` (2 SWA-only,
  21 C4, 20 C128) plus the trailing MTP placeholder, a 1-layer NextN draft, page 256, window 128,
  room for 64k full tokens and 8 concurrent requests.

``PoolSettings.upstream`` names the SGLang release whose layout and checks the pools reproduce
(``"0.5.19"`` or ``"0.5.23"``, default the newest); every preset takes it.

``build_worker_pools`` wires the pair as upstream does: the allocator registers its mapping on the
target, and the draft registers **the same tensor object** (``draft_mapping="shared"``). The other
wirings (``own``, ``clone``, ``view``, ``none``) reproduce upstream misconfigurations on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from pdstate.errors import PoolConfigError
from pdstate.pools.allocator import ReqToTokenPool, SWATokenToKVPoolAllocator
from pdstate.pools.dsv4 import DEFAULT_UPSTREAM, DeepSeekV4TokenToKVPool, check_upstream
from pdstate.pools.memory import Memory, PrivateMemory

DraftMapping = Literal["shared", "own", "clone", "view", "none"]

DSV4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0]  # 43 layers + MTP placeholder


@dataclass(frozen=True)
class PoolSettings:
    compression_ratios: tuple[int, ...] = (0, 4, 128)
    layer_num: int = 3
    start_layer: int = 0
    full_tokens: int = 1024
    swa_tokens: int = 512
    max_num_reqs: int = 4
    num_req_slots: int | None = None
    page_size: int = 256
    swa_page_size: int = 256
    sliding_window: int = 128
    kv_dtype: str = "float8_e4m3fn"
    state_dtype: str = "float32"
    qk_nope_head_dim: int = 448
    qk_rope_head_dim: int = 64
    indexer_head_dim: int = 128
    unified_kv: bool = False
    speculative_num_draft_tokens: int | None = 4
    online_c128: bool = False
    online_c128_mtp: bool = False
    draft_enabled: bool = True
    draft_layers: int = 1
    # None: ``draft_layers`` SWA-only layers (upstream NextN). A tuple with a non-zero ratio
    # reproduces the upstream "draft is not SWA-only" misconfiguration on purpose.
    draft_compression_ratios: tuple[int, ...] | None = None
    draft_mapping: DraftMapping = "shared"
    draft_sliding_window: int | None = None
    draft_page_size: int | None = None
    draft_speculative_num_draft_tokens: int | None | Literal["same"] = "same"
    draft_unified_kv: bool | None = None
    max_context_len: int | None = None
    upstream: str = DEFAULT_UPSTREAM

    def __post_init__(self) -> None:
        check_upstream(self.upstream)

    @property
    def speculative(self) -> bool:
        return bool(self.speculative_num_draft_tokens)

    @property
    def slots(self) -> int:
        return self.num_req_slots if self.num_req_slots is not None else self.max_num_reqs + 1

    def with_(self, **changes) -> PoolSettings:
        return replace(self, **changes)


PRESETS: dict[str, PoolSettings] = {
    "tiny": PoolSettings(),
    "dsv4-flash": PoolSettings(
        compression_ratios=tuple(DSV4_FLASH_RATIOS),
        layer_num=43,
        full_tokens=65536 + 8 * 256,
        swa_tokens=24 * 256,
        max_num_reqs=8,
    ),
}


def preset(name: str, *, upstream: str | None = None) -> PoolSettings:
    """A named preset; ``upstream`` (``"0.5.19"`` / ``"0.5.23"``) picks the SGLang release its
    pools reproduce (default: the preset's, the newest)."""
    try:
        s = PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
    return s if upstream is None else s.with_(upstream=upstream)


def pool_kwargs(s: PoolSettings, *, draft: bool = False) -> dict:
    """Upstream constructor keywords (plus pdstate's explicit global-state keywords)."""
    end = s.start_layer + s.layer_num
    if s.start_layer < 0 or s.layer_num < 0 or end > len(s.compression_ratios):
        # upstream's pool would quietly take the whole ratio list for such bounds: refuse them
        raise PoolConfigError(
            f"pool: the stage [start_layer, start_layer + layer_num) = [{s.start_layer}, {end}) does not lie "
            f"within the {len(s.compression_ratios)} compression ratios"
        )
    spec = s.speculative_num_draft_tokens
    full = s.full_tokens
    ring_c4 = 16 if s.speculative else 8
    if s.online_c128:
        c128_state = s.slots
    else:
        c128_state = s.slots * (256 if s.speculative else 128)
    kw = dict(
        max_num_reqs=s.max_num_reqs,
        swa_size=s.swa_tokens,
        c4_size=full // 4,
        c128_size=full // 128,
        c4_state_pool_size=s.swa_tokens // s.sliding_window * ring_c4,
        c128_state_pool_size=c128_state,
        page_size=s.page_size,
        swa_page_size=s.swa_page_size,
        dtype=s.kv_dtype,
        c4_state_dtype=s.state_dtype,
        c128_state_dtype=s.state_dtype,
        qk_nope_head_dim=s.qk_nope_head_dim,
        qk_rope_head_dim=s.qk_rope_head_dim,
        indexer_head_dim=s.indexer_head_dim,
        layer_num=s.layer_num,
        device="cpu",
        enable_memory_saver=False,
        compression_ratios=list(s.compression_ratios),
        sliding_window=s.sliding_window,
        start_layer=s.start_layer,
        end_layer=end,  # exclusive, as upstream's pool configurator passes it
        enable_hisparse=False,
        online_mtp_max_draft_tokens=spec or 0,
        num_req_slots=s.slots,
        unified_kv=s.unified_kv,
        speculative_num_draft_tokens=spec,
        online_c128=s.online_c128,
        online_c128_mtp=s.online_c128_mtp,
        upstream=s.upstream,
    )
    if draft:
        dspec = spec if s.draft_speculative_num_draft_tokens == "same" else s.draft_speculative_num_draft_tokens
        ratios = [0] * s.draft_layers if s.draft_compression_ratios is None else list(s.draft_compression_ratios)
        kw.update(
            c4_size=0,
            c128_size=0,
            c4_state_pool_size=0,
            c128_state_pool_size=0,
            layer_num=len(ratios),
            compression_ratios=ratios,
            start_layer=0,
            end_layer=len(ratios),
            sliding_window=s.draft_sliding_window or s.sliding_window,
            page_size=s.draft_page_size or s.page_size,
            unified_kv=s.unified_kv if s.draft_unified_kv is None else s.draft_unified_kv,
            speculative_num_draft_tokens=dspec,
        )
    return kw


@dataclass
class WorkerPools:
    settings: PoolSettings
    target: DeepSeekV4TokenToKVPool
    draft: DeepSeekV4TokenToKVPool | None
    allocator: SWATokenToKVPoolAllocator
    req_to_token: ReqToTokenPool
    memory: Memory
    extra_allocators: list = field(default_factory=list)

    def close(self) -> None:
        self.memory.close()


def build_worker_pools(settings: PoolSettings, memory: Memory | None = None) -> WorkerPools:
    """Target, draft (if enabled), allocator and request slots, wired as ``draft_mapping`` says."""
    s = settings
    mem = memory if memory is not None else PrivateMemory()
    target = DeepSeekV4TokenToKVPool(**pool_kwargs(s), memory=mem, name="target")
    allocator = SWATokenToKVPoolAllocator(s.full_tokens, s.swa_tokens, s.page_size, device="cpu", kvcache=target)
    extra = []
    draft = None
    if s.draft_enabled:
        draft = DeepSeekV4TokenToKVPool(**pool_kwargs(s, draft=True), memory=mem, name="draft")
        mapping = allocator.full_to_swa_index_mapping
        if s.draft_mapping == "shared":
            draft.register_mapping(mapping)
        elif s.draft_mapping == "own":
            own = SWATokenToKVPoolAllocator(s.full_tokens, s.swa_tokens, s.page_size, kvcache=draft)
            extra.append(own)
        elif s.draft_mapping == "clone":
            draft.register_mapping(mapping.clone())
        elif s.draft_mapping == "view":
            draft.register_mapping(mapping[:])
        elif s.draft_mapping != "none":
            raise ValueError(f"draft_mapping must be shared, own, clone, view or none; got {s.draft_mapping!r}")
    max_ctx = s.max_context_len or s.full_tokens
    return WorkerPools(s, target, draft, allocator, ReqToTokenPool(s.slots, max_ctx), mem, extra)
