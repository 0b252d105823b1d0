"""``SGLangSide``: what one SGLang server resolves to, in the terms that shape the transferred
DSV4 state (built by ``prediction.predict``), and pdstate's own pool model of it
(``SGLangSide.pool_settings()``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdstate.integrations.sglang import releases


@dataclass
class SGLangSide:
    """What one SGLang server resolves to, in the terms that shape the transferred DSV4 state."""

    role: str  # "prefill" | "decode": the position it was given in
    origin: str  # "arguments", "@path", "http://..."
    model: str
    layout_source: str  # where the layer layout came from
    compress_ratios: list[int]
    num_hidden_layers: int
    sliding_window: int
    window_source: str
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128
    page_size: int = 256
    kv_cache_dtype: str = "fp8_e4m3"
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    online_c128: bool = False
    online_c128_mtp: bool = False
    unified_kv: bool = False
    state_dtype: str = "float32"
    disaggregation_mode: str = "null"
    transfer_backend: str = "mooncake"
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    pp_size: int = 1
    attn_tp_size: int = 1
    attn_cp_size: int = 1
    dcp_size: int = 1
    decode_radix_cache: bool = False
    tokenizer_worker_num: int = 1  # --tokenizer-worker-num: pdstate's backend refuses N > 1 on 0.5.19
    # the layout factors the server's own settings set, by name (``protocol.factors``: each with a
    # ``launch`` field, e.g. --disaggregation-decode-allocation-policy), their defaults where not given
    settings: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    release: str = field(default_factory=lambda: releases.newest().version)  # the SGLang release it runs
    release_source: str = "default: the newest release"
    given: dict[str, str] = field(default_factory=dict)  # ServerArgs field -> the flag as written
    notes: list[str] = field(default_factory=list)
    not_modelled: list[str] = field(default_factory=list)
    launch_errors: list[str] = field(default_factory=list)  # why SGLang would not start
    neutral: list[str] = field(default_factory=list)  # given settings that do not touch the layout
    unknown: list[str] = field(default_factory=list)  # what SGLang's own parser does not know

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def stage_ratios(self) -> list[int]:
        return list(self.compress_ratios[: self.num_hidden_layers])

    def setting(self, factor: str) -> Any:
        """The value the server's settings give a layout factor (its default where not given)."""
        from pdstate.protocol.factors import FACTORS

        return self.settings[factor] if factor in self.settings else FACTORS[factor].default

    def spec_flags(self) -> str:
        """The speculative flags as DSV4 needs them written (empty when not speculative)."""
        if not self.speculative:
            return ""
        return (
            f"--speculative-algorithm {self.speculative_algorithm} --speculative-num-steps "
            f"{self.speculative_num_steps} --speculative-eagle-topk {self.speculative_eagle_topk} "
            f"--speculative-num-draft-tokens {self.speculative_num_draft_tokens}"
        )

    def describe(self) -> str:
        from pdstate.protocol.fixes import count_layers

        spec = (
            f"{self.speculative_algorithm} ({self.speculative_num_steps} steps, "
            f"{self.speculative_num_draft_tokens} draft tokens, 1-layer NextN draft)"
            if self.speculative
            else "not speculative"
        )
        parts = [
            f"{self.model} [{count_layers(self.stage_ratios)}; {self.layout_source}]",
            f"page {self.page_size}",
            f"kv {self.kv_cache_dtype}",
            f"window {self.sliding_window}",
            spec,
            "unified KV" if self.unified_kv else "paged",
        ]
        if self.online_c128:
            parts.append("online C128" + (" (MTP)" if self.online_c128_mtp else ""))
        if self.state_dtype != "float32":
            parts.append(f"state {self.state_dtype}")
        parts.append(f"tp {self.tp_size} dp {self.dp_size}" + (" dp-attention" if self.enable_dp_attention else ""))
        parts.append(f"SGLang {self.release} ({self.release_source})")
        return ", ".join(parts)

    def pool_settings(self):
        """pdstate's pool model for this side, with small capacities (the report's factors do
        not depend on pool sizes)."""
        from pdstate.pools.presets import PoolSettings

        kv = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "bfloat16": "bfloat16"}.get(
            self.kv_cache_dtype, self.kv_cache_dtype
        )
        return PoolSettings(
            compression_ratios=tuple(self.compress_ratios),
            layer_num=self.num_hidden_layers,
            full_tokens=4 * self.page_size,
            swa_tokens=2 * self.page_size,
            max_num_reqs=1,
            page_size=self.page_size,
            swa_page_size=self.page_size,
            sliding_window=self.sliding_window,
            kv_dtype=kv,
            state_dtype=self.state_dtype,
            qk_nope_head_dim=self.head_dim - self.qk_rope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            indexer_head_dim=self.index_head_dim,
            unified_kv=self.unified_kv,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens if self.speculative else None,
            online_c128=self.online_c128,
            online_c128_mtp=self.online_c128_mtp,
            draft_enabled=self.speculative,
            draft_layers=1,
            upstream=releases.pool_rules(self.release),  # pdstate's pool model of the release's pools
        )
