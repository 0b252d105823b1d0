"""``DeepSeekV4TokenToKVPool``: the DSV4 target (or SWA-only draft) KV pool, byte-exact.

The constructor takes upstream's keyword arguments, plus explicit keywords for what upstream reads
from process globals (``unified_kv``, ``speculative_num_draft_tokens``, ``online_c128``,
``online_c128_mtp``), ``memory`` (private tensors, or a named shared-memory segment) and
``upstream``: the SGLang release whose layout the pool reproduces (``"0.5.19"`` or ``"0.5.23"``,
default the newest). What the release changes (formulas checked against the recorded shapes of
``shared/conformance/setup_state_kv_args*.json``):

- rows of a paged KV or indexer buffer of ``size`` tokens, ``page`` tokens a row:
  0.5.19 ``(size + page + 1) // page``; 0.5.23 ``ceil((size + G) / page)`` with ``G`` the
  model-wide page of that pool (``page_size`` for C4/C128 KV and the C4 indexer,
  ``swa_page_size`` for SWA KV). Defaults (``c4_size=256``, ``c128_size=8``, page 256): C4 KV and
  indexer 5 -> 8 rows, C128 KV 5 -> 132 rows, SWA KV 3 rows in both;
- unified mode, C4 compress states (attention and indexer): 0.5.19 sizes them from the caller's
  ``c4_state_pool_size`` and addresses them by SWA page (``swa_page*ring + loc % ring``); 0.5.23
  keeps one ring per request slot, ``size = num_req_slots * c4_ring`` (rows ``roundup(size + ring
  + 1, 4)``: 84 -> 100 for 5 slots under speculation) addressed ``req_pool_idx*ring + pos % ring``,
  so the SWA component's C4 items are indexed by request slot (``pdstate.pools.indices``);
- 0.5.23 names the C128 state method ``get_request_state_buf_infos`` (0.5.19's
  ``get_c128_state_buf_infos`` stays as an alias), holds ``None`` as the mapping until one is
  registered, and states ``swa_req_ring_size`` (the unified ring, else ``None``) and
  ``request_window`` (``None``: pdstate models no encoder-replay window) for the draft geometry
  check; ``get_swa_valid_from_buf_infos`` is empty (pdstate models no DSpark draft).

Buffers are built once and never reallocated. The ``get_*_buf_infos`` methods return three parallel
lists (pointers, byte lengths, item lengths) in upstream's order; ``setup_state_kv_args`` in
``pdstate.pools.kvargs`` assembles them into state components.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdstate.errors import DraftMappingMissing, PoolConfigError
from pdstate.pools import geometry as g
from pdstate.pools.allocator import MappingIdentity
from pdstate.pools.memory import BufferSpec, Memory, PrivateMemory

BufInfos = tuple[list[int], list[int], list[int]]


def as_dtype(d: torch.dtype | str) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    dt = getattr(torch, str(d).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise PoolConfigError(f"unknown dtype {d!r}")
    return dt


def dtype_name(d: torch.dtype | str) -> str:
    return str(as_dtype(d)).replace("torch.", "")


_FP8_DTYPES = {"float8_e4m3fn", "float8_e5m2", "uint8"}

UPSTREAM_RELEASES = ("0.5.19", "0.5.23")
DEFAULT_UPSTREAM = UPSTREAM_RELEASES[-1]


def check_upstream(upstream: object) -> str:
    """``upstream`` as given when it names a supported SGLang release, else ``PoolConfigError``."""
    if upstream not in UPSTREAM_RELEASES:
        raise PoolConfigError(
            f"upstream must be one of {', '.join(repr(r) for r in UPSTREAM_RELEASES)} (the SGLang release "
            f"whose pool layout to reproduce); got {upstream!r}"
        )
    return str(upstream)


class DeepSeekV4TokenToKVPool:
    def __init__(
        self,
        *,
        max_num_reqs: int,
        swa_size: int,
        c4_size: int,
        c128_size: int,
        c4_state_pool_size: int,
        c128_state_pool_size: int,
        page_size: int,
        swa_page_size: int,
        dtype: torch.dtype | str,
        c4_state_dtype: torch.dtype | str,
        c128_state_dtype: torch.dtype | str,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        indexer_head_dim: int,
        layer_num: int,
        device: str = "cpu",
        enable_memory_saver: bool = False,
        compression_ratios: Sequence[int],
        sliding_window: int = 128,
        start_layer: int | None = None,
        end_layer: int | None = None,
        enable_hisparse: bool = False,
        online_mtp_max_draft_tokens: int = 0,
        num_req_slots: int | None = None,
        unified_kv: bool = False,
        speculative_num_draft_tokens: int | None = None,
        online_c128: bool = False,
        online_c128_mtp: bool = False,
        memory: Memory | None = None,
        name: str = "pool",
        upstream: str = DEFAULT_UPSTREAM,
        unified_fp8: bool | None = None,
        kv_source_layers: Sequence[int] = (),
        full_size: int | None = None,
        is_draft_worker: bool = False,
        kv_layout: str = "v4",
        compressed_kv_layout: str | None = None,
    ) -> None:
        self.upstream = check_upstream(upstream)
        self._check_release_options(unified_fp8, kv_source_layers, is_draft_worker, kv_layout, compressed_kv_layout)
        self.full_size = full_size
        self.is_draft_worker = bool(is_draft_worker)
        if device != "cpu":
            raise PoolConfigError(f"device {device!r} is not supported (pools live in host memory)")
        if enable_hisparse:
            raise PoolConfigError("enable_hisparse is not supported by pdstate")
        self.name = name
        self.max_num_reqs = max_num_reqs
        self.num_req_slots = num_req_slots if num_req_slots is not None else max_num_reqs + 1
        self.swa_size, self.c4_size, self.c128_size = swa_size, c4_size, c128_size
        self.c4_state_pool_size, self.c128_state_pool_size = c4_state_pool_size, c128_state_pool_size
        self.page_size, self.swa_page_size = page_size, swa_page_size
        self.sliding_window = sliding_window
        self.dtype = as_dtype(dtype)
        self.c4_state_dtype = as_dtype(c4_state_dtype)
        self.c128_state_dtype = as_dtype(c128_state_dtype)
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.indexer_head_dim = indexer_head_dim
        self.head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.layer_num = layer_num
        self.device = device
        self.compression_ratios = list(compression_ratios)
        # This PP stage's layers, as upstream's DSV4 pool takes them: [start_layer, end_layer) when
        # both are given and the ratio list reaches end_layer, else the whole ratio list. The
        # stage does not depend on ``layer_num`` (a list with an MTP placeholder, given alone,
        # builds that layer too; SGLang's pool configurator passes the stage's bounds).
        if start_layer is not None and end_layer is not None and len(self.compression_ratios) >= end_layer:
            self._stage_start, self._stage_end = start_layer, end_layer
        else:
            self._stage_start, self._stage_end = 0, len(self.compression_ratios)
        self.stage_ratios = self.compression_ratios[self._stage_start : self._stage_end]
        bad = sorted({r for r in self.stage_ratios if r not in g.UNIFIED_K_PER_BLOCK})
        if bad:
            raise PoolConfigError(f"unsupported compression ratios {bad}; DSV4 layers are 0, 4 or 128")
        self._unified_kv = bool(unified_kv)
        self.speculative_num_draft_tokens = speculative_num_draft_tokens
        self.speculative = bool(speculative_num_draft_tokens)
        self.online_c128, self.online_c128_mtp = bool(online_c128), bool(online_c128_mtp)
        self.online_mtp_max_draft_tokens = online_mtp_max_draft_tokens or 0
        self.c4_ring_size = g.c4_ring_size(self.speculative)
        has_c128 = g.C128 in self.stage_ratios
        self.c128_ring_size = (
            g.c128_ring_size(self.speculative, self.online_c128, self.online_c128_mtp) if has_c128 else None
        )
        self.kv_bytes_per_token = g.kv_bytes_per_token(qk_nope_head_dim, qk_rope_head_dim)
        if not self._unified_kv:
            if dtype_name(self.dtype) not in _FP8_DTYPES:
                raise PoolConfigError(
                    f"paged DSV4 KV stores fp8 as uint8; kv dtype {dtype_name(self.dtype)} is not supported"
                )
            if self.kv_bytes_per_token != 584:
                raise PoolConfigError(f"DSV4 paged KV expects 584 bytes per token, got {self.kv_bytes_per_token}")
        self._mapping: torch.Tensor | None = None
        self.mapping_identity: MappingIdentity | None = None
        # 0.5.23's draft-geometry facts: the per-request SWA ring (unified mode; a DSpark draft's
        # ring, not modelled) and the encoder-replay request window (not modelled)
        self.request_window = None
        self.swa_req_ring_size: int | None = None
        self._memory = memory if memory is not None else PrivateMemory()
        self._build()

    def _check_release_options(
        self,
        unified_fp8: bool | None,
        kv_source_layers: Sequence[int],
        is_draft_worker: bool,
        kv_layout: str,
        compressed_kv_layout: str | None,
    ) -> None:
        """0.5.23's extra constructor keywords: accepted at the values pdstate models."""
        given = {
            "unified_fp8": unified_fp8 not in (None, False),
            "kv_source_layers": bool(list(kv_source_layers)),
            "kv_layout": str(getattr(kv_layout, "value", kv_layout)).lower() != "v4",
            "compressed_kv_layout": compressed_kv_layout not in (None, "auto", "fp8"),
        }
        if self.upstream == "0.5.19":
            given["is_draft_worker"] = bool(is_draft_worker)
            given["unified_fp8"] = unified_fp8 is not None
            given["compressed_kv_layout"] = compressed_kv_layout is not None
        bad = sorted(k for k, v in given.items() if v)
        if bad:
            raise PoolConfigError(
                f"upstream={self.upstream}: {', '.join(bad)} not supported by pdstate's pools "
                "(they model the V4 KV layout, one bf16 unified pool, no ratio-1/2 layers)"
            )

    @property
    def release(self) -> str:
        """The SGLang release whose layout this pool reproduces (``upstream``)."""
        return self.upstream

    # -- construction -------------------------------------------------------------------------
    def _layers(self, ratio: int) -> list[int]:
        """Absolute layer ids of this stage with ``ratio``."""
        return [self._stage_start + i for i, r in enumerate(self.stage_ratios) if r == ratio]

    def _specs(self) -> list[BufferSpec]:
        specs: list[BufferSpec] = []
        u8 = torch.uint8
        pad = g.value_bytes_per_token(self.qk_nope_head_dim, self.qk_rope_head_dim)

        new = self.upstream != "0.5.19"

        def nrows(size: int, page: int, global_page: int) -> int:
            return g.physical_num_rows(size, page, global_page) if new else g.paged_num_rows(size, page)

        def paged(label: str, size: int, page: int, global_page: int) -> BufferSpec:
            row = g.paged_row_bytes(page, self.kv_bytes_per_token, pad)
            return BufferSpec(label, (nrows(size, page, global_page), row), u8)

        c4_layers, c128_layers = self._layers(g.C4), self._layers(g.C128)
        if self._unified_kv:
            self.unified_swa_window = self.sliding_window
            self.unified_swa_ring_size = g.unified_ring(self.sliding_window, self.speculative_num_draft_tokens)
            self.unified_swa_pages = self.num_req_slots * self.unified_swa_ring_size
            if new:
                self.swa_req_ring_size = self.unified_swa_ring_size
            for i, r in enumerate(self.stage_ratios):
                rows = g.unified_layer_rows(r, self.unified_swa_pages, self.c128_size, self.page_size)
                specs.append(BufferSpec(f"unified_kv[local_layer={i}]", (rows, self.head_dim), torch.bfloat16))
        else:
            for i in range(len(self.stage_ratios)):
                specs.append(paged(f"swa_kv[local_layer={i}]", self.swa_size, self.swa_page_size, self.swa_page_size))
            for j, _ in enumerate(c4_layers):
                specs.append(paged(f"c4_kv[c4_idx={j}]", self.c4_size, self.page_size // 4, self.page_size))
            for j, _ in enumerate(c128_layers):
                specs.append(paged(f"c128_kv[c128_idx={j}]", self.c128_size, self.page_size // 128, self.page_size))
        ipage = self.page_size // 4
        for j, _ in enumerate(c4_layers):
            rows = nrows(self.c128_size * 32, ipage, self.page_size)
            specs.append(BufferSpec(f"c4_indexer_k[c4_idx={j}]", (rows, ipage * (self.indexer_head_dim + 4)), u8))
        c4_state_size = self.c4_state_pool_size
        if new and self._unified_kv:  # 0.5.23: one C4 ring per request slot
            c4_state_size = self.num_req_slots * self.c4_ring_size
        c4_rows = g.roundup(c4_state_size + self.c4_ring_size + 1, g.C4)
        for layer in c4_layers:
            specs.append(BufferSpec(f"attn_state_c4[layer={layer}]", (c4_rows, 4 * self.head_dim), self.c4_state_dtype))
        for layer in c4_layers:
            specs.append(
                BufferSpec(
                    f"indexer_state_c4[layer={layer}]", (c4_rows, 4 * self.indexer_head_dim), self.c4_state_dtype
                )
            )
        if c128_layers:
            ring = self.c128_ring_size
            if self.online_c128:
                size = max(self.c128_state_pool_size, self.num_req_slots)
                banks = 1 + (self.online_mtp_max_draft_tokens if self.online_c128_mtp else 0)
                shape = ((size + 2) * banks, 3 * self.head_dim)
            else:
                size = max(self.c128_state_pool_size, self.num_req_slots * ring)
                shape = (g.roundup(size + ring + 1, g.C128), 2 * self.head_dim)
            for layer in c128_layers:
                specs.append(BufferSpec(f"attn_state_c128[layer={layer}]", shape, self.c128_state_dtype))
        return specs

    def _build(self) -> None:
        specs = self._specs()
        tensors = self._memory.allocate(self.name, specs)
        self.buffers: dict[str, torch.Tensor] = {s.label: t for s, t in zip(specs, tensors)}
        self.buffer_specs = specs
        by = lambda prefix: [t for s, t in zip(specs, tensors) if s.label.startswith(prefix)]  # noqa: E731
        self.unified_kv_buffers = by("unified_kv[")
        self.swa_kv_buffers = by("swa_kv[")
        self.c4_kv_buffers = by("c4_kv[")
        self.c128_kv_buffers = by("c128_kv[")
        self.c4_indexer_buffers = by("c4_indexer_k[")
        self.c4_attn_states = by("attn_state_c4[")
        self.c4_indexer_states = by("indexer_state_c4[")
        self.c128_states = by("attn_state_c128[")

    # -- the SWA index mapping ----------------------------------------------------------------
    def register_mapping(self, mapping: torch.Tensor) -> None:
        """Hold a reference to ``mapping`` (never a copy) and record its identity."""
        self._mapping = mapping
        self.mapping_identity = MappingIdentity.of(mapping)

    @property
    def full_to_swa_index_mapping(self) -> torch.Tensor | None:
        """The registered mapping. Before ``register_mapping``: 0.5.19 has no such attribute
        (``DraftMappingMissing``, an ``AttributeError``), 0.5.23 holds ``None``."""
        if self._mapping is None:
            if self.upstream == "0.5.19":
                raise DraftMappingMissing()
            return None
        return self._mapping

    @property
    def has_mapping(self) -> bool:
        return self._mapping is not None

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        if self._mapping is None:
            raise DraftMappingMissing()
        return self._mapping[kv_indices]

    # -- buffer infos -------------------------------------------------------------------------
    @staticmethod
    def _infos(entries: list[tuple[int, int, int]]) -> BufInfos:
        return [e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries]

    @staticmethod
    def _whole(t: torch.Tensor, item_len: int) -> tuple[int, int, int]:
        return t.data_ptr(), t.nbytes, item_len

    def _row_bytes(self, t: torch.Tensor) -> int:
        return t[0].nbytes

    def get_contiguous_buf_infos(self) -> BufInfos:
        """Main KV channel: C4 KV, C4 indexer, C128 KV; item = the share of one full page."""
        entries = []
        if self._unified_kv:
            by_ratio = {g.C4: [], g.C128: []}
            for r, t in zip(self.stage_ratios, self.unified_kv_buffers):
                if r in by_ratio:
                    row = self._row_bytes(t)
                    off = self.unified_swa_pages * row
                    by_ratio[r].append((t.data_ptr() + off, t.nbytes - off, (self.page_size // r) * row))
            entries += by_ratio[g.C4]
            entries += [self._whole(t, self._row_bytes(t)) for t in self.c4_indexer_buffers]
            entries += by_ratio[g.C128]
        else:
            for group in (self.c4_kv_buffers, self.c4_indexer_buffers, self.c128_kv_buffers):
                entries += [self._whole(t, self._row_bytes(t)) for t in group]
        return self._infos(entries)

    def get_state_buf_infos(self) -> BufInfos:
        """SWA component: paged SWA KV pages (paged mode), then C4 attention and indexer rings."""
        entries = [] if self._unified_kv else [self._whole(t, self._row_bytes(t)) for t in self.swa_kv_buffers]
        for group in (self.c4_attn_states, self.c4_indexer_states):
            entries += [self._whole(t, self._row_bytes(t) * self.c4_ring_size) for t in group]
        return self._infos(entries)

    def get_unified_swa_ring_buf_infos(self) -> BufInfos:
        if not self._unified_kv:
            return [], [], []
        entries = []
        for t in self.unified_kv_buffers:
            row = self._row_bytes(t)
            entries.append((t.data_ptr(), self.unified_swa_pages * row, row))
        return self._infos(entries)

    def get_request_state_buf_infos(self) -> BufInfos:
        """The request-scoped state component (C128 compress states): one item is one C128 page
        of the ring (128 rows, whatever the ring) offline, one row online."""
        rows = 1 if self.online_c128 else g.C128_ITEM_ROWS
        return self._infos([self._whole(t, self._row_bytes(t) * rows) for t in self.c128_states])

    # 0.5.19's name of the same component
    get_c128_state_buf_infos = get_request_state_buf_infos

    def get_swa_valid_from_buf_infos(self) -> BufInfos:
        """0.5.23's DSpark draft request-row state: pdstate's pools model no DSpark draft."""
        return [], [], []

    @property
    def c4_state_addressing(self) -> str:
        """How the SWA component's C4 state items are indexed: ``"swa_page"`` (the SWA page of the
        window, through the mapping) or ``"request"`` (0.5.23 unified: the request slot)."""
        return "request" if self._unified_kv and self.upstream != "0.5.19" else "swa_page"

    # -- facts used by checks and reports -----------------------------------------------------
    @property
    def ring_geometry(self) -> tuple[int, int, int] | None:
        if not self._unified_kv:
            return None
        return (self.unified_swa_window, self.unified_swa_ring_size, self.unified_swa_pages)

    @property
    def paged_geometry(self) -> tuple[int, int]:
        return (self.page_size, self.sliding_window)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.buffers.values())

    def close(self) -> None:
        self._memory.close()

    def __repr__(self) -> str:
        mode = "unified" if self._unified_kv else "paged"
        return (
            f"DeepSeekV4TokenToKVPool(name={self.name!r}, upstream={self.upstream}, {mode}, layers={self.stage_ratios}, "
            f"page_size={self.page_size}, window={self.sliding_window}, bytes={self.total_bytes})"
        )
