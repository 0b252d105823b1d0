"""The SGLang releases pdstate supports: one row per release, each with the traits the code branches on.

A new release is one row of ``RELEASES`` (oldest first), its argument table
(``launch/args-<release>.json``, written by ``python -m pdstate.devtools.sglang_args --release
<release>``) and its environment for the real-SGLang tests (one ``tools/sglang_env.sh`` line in the
Makefile's ``sglang-env``). Nothing else names a release: ``pdstate check --sglang``, the backend's
release check, the launch rules, the two-process drivers and tests/sglang all read the row.

Where a row says what SGLang's own backend contract does (``keyword_api``, ``deferred_kv_release``,
...), the adapter itself (``manager``, ``sender``, ``receiver``) still detects it in the SGLang it
runs in (a signature, a server setting), so a release missing here is served the same way; the
drivers and tests/sglang read the row, and tests/sglang check each row against its real release.

This module imports neither torch nor SGLang: the launch model, the devtools drivers and their child
processes (under either release's environment) import it alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pdstate.errors import ConfigError

LAUNCH_DIR = Path(__file__).resolve().parent / "launch"  # where the args-<release>.json tables live


@dataclass(frozen=True)
class SGLangRelease:
    """One SGLang release and what differs in it (each trait names the places that read it)."""

    version: str
    # pdstate's pool model of the release's DSV4 pools, one of ``pdstate.pools.dsv4.UPSTREAM_RELEASES``
    # (the pools' ``upstream``): item lengths, ring rows, the five target/draft checks' words
    pools: str
    # --- pdstate check --sglang: the release's parser and start-time rules (``launch.command``, ``launch.rules``)
    config_long_keys: bool  # SGLang's --config YAML takes any long spelling of a flag as its key (else the dest)
    config_refuses_every_non_store: bool  # --config refuses every non-store action (else only those taking values)
    attn_dp_size_flag: bool  # --attn-dp-size sets the attention DP width (else only --dp-size with dp attention)
    dspark_pd_rules: bool  # DSpark refuses context parallelism with dp attention, and PP off a prefill
    decode_radix_spec: tuple[str | None, ...]  # --speculative-algorithm values a decode radix cache accepts
    # --- SGLang's backend contract and internals (the drivers ``devtools.sglang_pair`` / ``sglang_queues``, tests)
    keyword_api: bool  # senders made with keywords only (no dest_tp_ranks / pp_rank), the parallel context
    # kept with override_permanently, pools asking for the request-to-token pool, request-state indices
    # from the pool (``DSV4_REQUEST_STATE``), MetadataBuffers' sampling mask, the unified-KV gate's module
    deferred_kv_release: bool  # a failed decode request's pages are held until every prefill rank acknowledged
    mooncake_checks_item_lens: bool  # SGLang's own Mooncake backend compares the state items' lengths first
    # SGLANG_HTTP_SERVER_APP_PATH names the app its tokenizer workers (--tokenizer-worker-num > 1) import,
    # so pdstate's plugin reaches them (``plugin.route_tokenizer_workers``); without it the KV manager
    # refuses N > 1 at start (``launch.backend.tokenizer_workers_refusal``)
    tokenizer_workers_app_path: bool
    in_lock: bool = False  # tools/sglang-env.txt's own sglang line (its environment: <venv>/sglang-env)
    args_file: str = ""  # its argument table, relative to launch/ (default ``args-<version>.json``)

    @property
    def args_path(self) -> Path:
        """The release's argument table (``launch/args-<version>.json``)."""
        return LAUNCH_DIR / (self.args_file or f"args-{self.version}.json")

    @property
    def speculative_radix_cache(self) -> bool:
        """A speculative (EAGLE) DSV4 decode starts with a decode radix cache (0.5.19 refuses it)."""
        return "EAGLE" in self.decode_radix_spec

    @property
    def env_dir(self) -> str:
        """Its environment for tests/sglang, under the venv (``make sglang-env``)."""
        return "sglang-env" if self.in_lock else f"sglang-env-{self.version}"

    @property
    def env_version(self) -> str | None:
        """``tools/sglang_env.sh``'s VERSION argument: ``None`` for the lock's own line."""
        return None if self.in_lock else self.version


RELEASES: tuple[SGLangRelease, ...] = (
    SGLangRelease(
        version="0.5.19",
        pools="0.5.19",
        config_long_keys=False,
        config_refuses_every_non_store=True,
        attn_dp_size_flag=False,
        dspark_pd_rules=False,
        decode_radix_spec=(None,),
        keyword_api=False,
        deferred_kv_release=False,
        mooncake_checks_item_lens=False,
        tokenizer_workers_app_path=False,
        in_lock=True,
    ),
    SGLangRelease(
        version="0.5.23",
        pools="0.5.23",
        config_long_keys=True,
        config_refuses_every_non_store=False,
        attn_dp_size_flag=True,
        dspark_pd_rules=True,
        decode_radix_spec=(None, "DSPARK", "EAGLE", "EAGLE3"),
        keyword_api=True,
        deferred_kv_release=True,
        mooncake_checks_item_lens=True,
        tokenizer_workers_app_path=True,
    ),
)


def versions() -> tuple[str, ...]:
    """Every release's version, oldest first."""
    return tuple(r.version for r in RELEASES)


def spelled() -> str:
    """The versions as prose: ``"0.5.19 and 0.5.23"``."""
    v = versions()
    return " and ".join(v) if len(v) < 3 else ", ".join(v[:-1]) + " and " + v[-1]


def newest() -> SGLangRelease:
    return RELEASES[-1]


def in_lock() -> SGLangRelease:
    """The release of tools/sglang-env.txt's own sglang line."""
    return next(r for r in RELEASES if r.in_lock)


def find(version: str) -> SGLangRelease | None:
    return next((r for r in RELEASES if r.version == version), None)


def row(version: str) -> SGLangRelease:
    """The row of ``version``; an unknown one is a ``ConfigError`` naming the supported releases."""
    found = find(version)
    if found is None:
        raise ConfigError(f"SGLang {version}: pdstate models SGLang {spelled()}")
    return found


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.23.post1"`` -> ``(0, 5, 23)``."""
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def nearest(version: str) -> SGLangRelease:
    """The row a running SGLang follows: its own, else the newest release not newer than it (a
    post-release follows its release), else the oldest."""
    if (found := find(version)) is not None:
        return found
    at = version_tuple(version)
    older = [r for r in RELEASES if version_tuple(r.version) <= at]
    return older[-1] if older else RELEASES[0]


def pool_rules(version: str) -> str:
    """pdstate's pool model of ``version``'s pools (``pools``); an unknown version is passed on as
    it is, for the pool model to refuse in its own words."""
    found = find(version)
    return found.pools if found is not None else version
