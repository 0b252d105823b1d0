"""Walk every recorded upstream outcome of ``setup_state_kv_args`` and reproduce it.

Two recordings, one per SGLang release (0.5.19 and 0.5.23, the same public cases); pdstate's pools
are built with ``upstream=`` the recording's release.
"""

import json

import pytest
import torch

from pdstate.errors import PdStateError
from pdstate.pools import DeepSeekV4TokenToKVPool, SWATokenToKVPoolAllocator
from pdstate.pools.kvargs import KVArgs, StateType, setup_state_kv_args
from tests.support.paths import CONFORMANCE_JSON, SHARED
from tests.support.pools import wire_draft

# release -> the vendored recording (each checked against its ../shared/conformance original)
_DATA = {
    "0.5.19": CONFORMANCE_JSON,
    "0.5.23": CONFORMANCE_JSON.with_name("setup_state_kv_args-0.5.23.json"),
}
_CASES = []
for _release, _path in _DATA.items():
    _doc = json.loads(_path.read_text())
    assert _doc.get("sglang_version", "0.5.19") == _release, _path
    for variant in _doc["variants"]:
        for case in variant["cases"]:
            _CASES.append(
                pytest.param(_release, variant["variant"], case, id=f"{_release}:{variant['variant']}:{case['name']}")
            )

# the recorded names of the draft's mapping wirings -> ``support.pools.wire_draft``'s
_WIRINGS = {
    "shared": "shared",
    "own_allocator": "own",
    "own_identity": "identity",
    "clone": "clone",
    "view": "view",
    None: "none",
    "none": "none",
}

_VARIANT_FLAGS = {
    "offline_c128": dict(online_c128=False, online_c128_mtp=False),
    "online_c128": dict(online_c128=True, online_c128_mtp=False),
    "online_c128_mtp": dict(online_c128=True, online_c128_mtp=True),
}


def _build(side: dict, variant: str, release: str) -> DeepSeekV4TokenToKVPool:
    return DeepSeekV4TokenToKVPool(
        **side["ctor_kwargs"],
        unified_kv=side["oracle"]["unified_kv"],
        speculative_num_draft_tokens=side["oracle"]["spec"],
        **_VARIANT_FLAGS[variant],
        upstream=release,
    )


def _run(release: str, variant: str, case: dict):
    p = params = case["params"]
    target = _build(params["target"], variant, release)
    a = p["allocator"]
    alloc = SWATokenToKVPoolAllocator(a["size_full"], a["size_swa"], a["page_size"], kvcache=target)
    alloc.alloc(2 * a["page_size"])  # the recorded demo allocation: 2 pages
    draft = None
    if p["draft_kind"] == "non_dsv4_object":
        draft = object()
    elif p["draft"] is not None:
        draft = _build(p["draft"], variant, release)
        wire_draft(alloc, draft, _WIRINGS[p["draft_mapping"]])
    kv_args = KVArgs()
    setup_state_kv_args(kv_args, target, draft)
    return target, draft, alloc, kv_args


@pytest.mark.parametrize("release,variant,case", _CASES)
def test_upstream_outcome(release, variant, case):
    outcome = case["outcome"]
    if outcome["status"] == "error":
        with pytest.raises(Exception) as info:
            _run(release, variant, case)
        exc = info.value
        if outcome["exc_type"] == "AttributeError":
            assert isinstance(exc, AttributeError)
        elif outcome["exc_type"] == "AssertionError" and not outcome.get("message"):
            # upstream: a bare assertion at construction; an assertion or one of our errors is
            # acceptable (not a KeyError or TypeError of this harness)
            assert isinstance(exc, (AssertionError, PdStateError)), repr(exc)
        else:
            assert outcome["exc_type"] == "RuntimeError"
            assert isinstance(exc, RuntimeError)
            assert str(exc) == outcome["message"]
        return

    target, draft, alloc, kv_args = _run(release, variant, case)
    # by member: 0.5.23's DSV4_REQUEST_STATE is 0.5.19's C128_STATE (one wire value)
    assert kv_args.state_types == [StateType[name] for name in outcome["state_types"]]
    assert len(outcome["components"]) == kv_args.num_components
    for i, comp in enumerate(outcome["components"]):
        assert kv_args.state_types[i].value == comp["state_type_value"]
        assert len(kv_args.state_data_ptrs[i]) == comp["num_ptrs"]
        assert kv_args.state_data_lens[i] == comp["data_lens"], comp["buffers"]
        assert kv_args.state_item_lens[i] == comp["item_lens"], comp["buffers"]
    assert kv_args.is_hybrid_mla_backend == outcome["is_hybrid_mla_backend"]
    assert kv_args.state_dim_per_tensor == outcome["state_dim_per_tensor"]

    main = case["target_contiguous_buf_infos"]
    ptrs, lens, items = target.get_contiguous_buf_infos()
    assert len(ptrs) == main["num_ptrs"]
    assert lens == main["data_lens"]
    assert items == main["item_lens"]

    # every recorded buffer: shape, dtype, bytes
    recorded = {b["label"].split(".", 1)[1]: b for b in case["target_layout"]["buffers"]}
    for label, b in recorded.items():
        t = target.buffers[label]
        assert list(t.shape) == b["shape"], label
        assert str(t.dtype).replace("torch.", "") == b["dtype"], label
        assert t.nbytes == b["nbytes"], label

    demo = case["translate_demo"]
    idx = torch.tensor(demo["full_indices"])
    assert target.translate_loc_from_full_to_swa(idx).tolist() == demo["target.translate_loc_from_full_to_swa"]
    if (
        "draft.translate_loc_from_full_to_swa" in demo
        and draft is not None
        and hasattr(draft, "translate_loc_from_full_to_swa")
    ):
        assert draft.translate_loc_from_full_to_swa(idx).tolist() == demo["draft.translate_loc_from_full_to_swa"]


def test_cases_present():
    for release in _DATA:
        assert sum(1 for c in _CASES if c.values[0] == release) >= 20, release


@pytest.mark.parametrize("release", sorted(_DATA))
def test_vendored_copy_matches_shared(release):
    vendored = _DATA[release]
    shared = SHARED / "conformance" / vendored.name
    if not shared.exists():
        pytest.skip(f"{shared} not present; the vendored copy is used alone")
    assert json.loads(shared.read_text()) == json.loads(vendored.read_text()), (
        f"tests/conformance/data/{vendored.name} differs from shared/conformance: copy it again"
    )
