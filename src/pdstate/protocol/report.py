"""Layout reports: what each side states about its pools, the fingerprint over it, the diff.

A ``LayoutReport`` carries
- ``factors``: the layout factors that must be equal on both sides (spec §6), as an ordered tuple
  of ``(name, value)`` pairs: the same order is used to hash them and to explain a difference;
- the side's own ``target`` and ``draft`` facts (geometry tuples, mapping identities), so the peer
  can re-run the five upstream checks on them;
- the outcome of the side's own ``setup_state_kv_args``.

Factors that legitimately differ (pool sizes, ``num_req_slots``, ring pages, data lengths,
pointers) stay out of the factors. A mapping is never compared across processes.

Reports are data (no torch): ``pdstate.pools.reporting.build_report`` builds one from live pools.

Bounds on what a peer states. These models validate every frame a peer sends (``wire.decode``)
and every report or error a worker keeps, so a peer's text is bounded where it enters the
process: nothing downstream (refusal records, peer lists, ``/v1/compat``, ``/readyz``, an SGLang
rank's status snapshots, log lines) can hold a larger one, whatever it is later copied into.
- Texts that are echoed (an error's class name and message, ``kv_dtype``, a factor's name and a
  string factor's value, the fingerprint) are clipped (``clip``): the first characters, then
  ``…(+N chars)``. The caps are far above any honest value (a DeepSeek-V4-Pro pair's refusal on
  ``components`` quotes two values in about 2.6 KiB; dtypes, layouts and fingerprints are tens of
  characters), so upstream's texts reach both sides intact, and a clipped value never equals an
  honest one.
- Values compared and never quoted whole (a structured factor, the layer ratios, a mapping
  identity) are refused past their bound: the frame is invalid (``ProtocolError`` naming the field
  and the limit, never the value).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

import msgpack
from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

from pdstate.protocol import factors as registry
from pdstate.protocol.factors import canon
from pdstate.protocol.facts import MappingIdentity, PoolFacts

# The factors' names, in the protocol's order (it is hashed in this order and differences are
# named in it): the registry's (``pdstate.protocol.factors``). ``FACTOR_NAMES`` are the state
# factors every report carries; ``OPTIONAL_FACTOR_NAMES`` the built-in optional ones, each carried
# only where it is not at its default (a report without them is byte-identical to one made before
# they existed, and a report that lacks one states the default). What SGLang 0.5.23 compares
# between its prefill and decode beyond the state layout is optional: ``kv_layout`` (the main and
# compressed KV byte layouts), ``kv_fp8_two_pool``, ``dspark`` and ``allocation_policy``.
FACTOR_NAMES: tuple[str, ...] = registry.names("state")
OPTIONAL_FACTOR_NAMES: tuple[str, ...] = registry.names("optional")


MAX_NAME_CHARS = 128  # an error's class name, a factor's name
MAX_VALUE_CHARS = 256  # kv_dtype, a string factor's value, a mapping identity's nonce or dtype
MAX_FINGERPRINT_CHARS = 64  # a fingerprint (blake2b-128: 32 hex digits)
MAX_MESSAGE_CHARS = 8192  # an error's message
MAX_FACTORS = 64  # factors in a report (16 named by this version)
MAX_FACTOR_BYTES = 4096  # a structured factor's value, msgpack-encoded (dsv4-flash's largest: 521)
MAX_LAYERS = 4096  # entries of a pool's compression ratios (one per layer)


def clip(text: str, limit: int) -> str:
    """``text`` when it has at most ``limit`` characters, else its first characters and
    ``…(+N chars)``, N the characters left out, ``limit`` characters in all: a clipped text is
    kept as it is when it is validated again (a record rebuilt, a refusal relayed)."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - len(f"…(+{len(text)} chars)"))
    return f"{text[:keep]}…(+{len(text) - keep} chars)"


def _bounded(value: str, limit: int, what: str) -> str:
    if len(value) > limit:
        raise ValueError(f"{what} has {len(value)} characters, over the limit of {limit}")
    return value


def _bounded_factors(factors: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    if len(factors) > MAX_FACTORS:
        raise ValueError(f"{len(factors)} factors, over the limit of {MAX_FACTORS}")
    out = []
    for name, value in factors:
        name = clip(name, MAX_NAME_CHARS)
        if isinstance(value, str):
            value = clip(value, MAX_VALUE_CHARS)
        elif value is not None and not isinstance(value, (bool, int, float)):
            size = len(msgpack.packb(value, use_bin_type=True, default=str))
            if size > MAX_FACTOR_BYTES:
                raise ValueError(f"factor {name[:32]!r} is {size} bytes encoded, over the limit of {MAX_FACTOR_BYTES}")
        out.append((name, value))
    return tuple(out)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MappingIdentityModel(_Frozen):
    nonce: str
    data_ptr: int
    numel: int
    dtype: str

    @field_validator("nonce", "dtype")
    @classmethod
    def _short(cls, v: str, info) -> str:
        return _bounded(v, MAX_VALUE_CHARS, info.field_name)


class PoolFactsModel(_Frozen):
    compression_ratios: tuple[int, ...]
    unified_kv: bool
    ring_geometry: tuple[int, int, int] | None
    paged_geometry: tuple[int, int]
    mapping_identity: MappingIdentityModel | None

    @field_validator("compression_ratios")
    @classmethod
    def _layers(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if len(v) > MAX_LAYERS:
            raise ValueError(f"{len(v)} layers, over the limit of {MAX_LAYERS}")
        return v

    @classmethod
    def of(cls, facts: PoolFacts) -> PoolFactsModel:
        mi = facts.mapping_identity
        return cls(
            compression_ratios=facts.compression_ratios,
            unified_kv=facts.unified_kv,
            ring_geometry=facts.ring_geometry,
            paged_geometry=facts.paged_geometry,
            mapping_identity=None if mi is None else MappingIdentityModel(**mi.as_dict()),
        )

    def to_facts(self) -> PoolFacts:
        mi = self.mapping_identity
        return PoolFacts(
            tuple(self.compression_ratios),
            self.unified_kv,
            None if self.ring_geometry is None else tuple(self.ring_geometry),
            tuple(self.paged_geometry),
            None if mi is None else MappingIdentity(mi.nonce, mi.data_ptr, mi.numel, mi.dtype),
        )


def _clipped(limit: int) -> Any:
    """``str``, clipped to ``limit`` characters as it validates (``clip``)."""
    return Annotated[str, AfterValidator(lambda v: clip(v, limit))]


NameText = _clipped(MAX_NAME_CHARS)
MessageText = _clipped(MAX_MESSAGE_CHARS)
ValueText = _clipped(MAX_VALUE_CHARS)
FingerprintText = _clipped(MAX_FINGERPRINT_CHARS)


class ErrorInfo(_Frozen):
    # an error as it travels and is kept: its class name and message, both clipped (``clip``)
    type: NameText
    message: MessageText

    @classmethod
    def of(cls, exc: BaseException) -> ErrorInfo:
        return cls(type=type(exc).__name__, message=str(exc))


class LocalCheck(_Frozen):
    ok: bool
    error: ErrorInfo | None = None


class LayoutReport(_Frozen):
    page_size: int
    kv_dtype: ValueText
    factors: tuple[tuple[str, Any], ...]
    fingerprint: FingerprintText
    target: PoolFactsModel
    draft: PoolFactsModel | None
    local_check: LocalCheck

    @field_validator("factors")
    @classmethod
    def _clip_factors(cls, v: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
        return _bounded_factors(v)

    def factor(self, name: str) -> Any:
        """A factor's value as carried; an optional factor the report does not carry is ``None``."""
        entry = registry.get(name)
        carried = dict(self.factors)
        return carried.get(name) if entry is not None and entry.optional else carried[name]

    def value(self, name: str) -> Any:
        """A registered factor's value, its default where an optional one is not carried."""
        entry = registry.get(name)
        if entry is None:
            raise KeyError(name)
        return entry.of(self)

    def kv_layout(self) -> str:
        """The KV byte layout as 0.5.23 names it (the default V4 one where the report carries none)."""
        return self.value("kv_layout")

    def allocation_policy(self) -> str:
        return self.value("allocation_policy")


_canon = canon  # the name tests and older callers use


def fingerprint(page_size: int, kv_dtype: str, factors: tuple[tuple[str, Any], ...]) -> str:
    """blake2b-128 hex digest over page size, KV dtype and the factors, in the order given (a
    report's: the registry's)."""
    payload = msgpack.packb(
        [["page_size", page_size], ["kv_dtype", kv_dtype]] + [[n, canon(v)] for n, v in factors],
        use_bin_type=True,
    )
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def diff(ours: LayoutReport, theirs: LayoutReport) -> list[tuple[str, Any, Any]]:
    """Every differing factor, in protocol order, as ``(name, ours, theirs)``: the report fields'
    values, the factors' as carried (an absent optional one: ``None``), compared by each entry's
    rule (``Factor.same``)."""
    out = []
    a, b = dict(ours.factors), dict(theirs.factors)
    for entry in registry.FACTORS.values():
        name = entry.name
        if entry.kind == "field":
            x, y = getattr(ours, name), getattr(theirs, name)
        else:
            x, y = a.get(name), b.get(name)
        if not entry.same(x, y):
            out.append((name, x, y))
    return out
