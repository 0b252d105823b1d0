"""Every user-facing error text, character for character (users grep for the upstream sentences)."""

import pytest

from pdstate import errors as e
from pdstate.pools import geometry as g
from tests.support.upstream import MAPPING_ERROR, MISSING_MAPPING_ERROR, SWA_ONLY_ERROR, UNIFIED_ERROR

# --- the five upstream target/draft checks --------------------------------------------------


@pytest.mark.parametrize(
    "cls,text",
    [
        (e.DraftNotSWAOnly, SWA_ONLY_ERROR),
        (e.UnifiedKVModeMismatch, UNIFIED_ERROR),
        (e.SWAIndexMappingNotShared, MAPPING_ERROR),
    ],
)
def test_fixed_upstream_sentences(cls, text):
    err = cls()
    assert str(err) == text
    assert err.args == (text,)
    assert isinstance(err, RuntimeError)
    assert isinstance(err, e.DSV4StateError)


def test_ring_geometry_sentence_prints_python_tuples():
    err = e.SWARingGeometryMismatch.build((128, 131, 655), (64, 67, 335))
    assert type(err) is e.SWARingGeometryMismatch
    assert isinstance(err, RuntimeError)
    assert str(err) == (
        "DSV4 target and draft pools must share SWA ring geometry: target=(128, 131, 655), draft=(64, 67, 335)"
    )


def test_ring_geometry_sentence_normalises_lists_to_tuples():
    err = e.SWARingGeometryMismatch.build([128, 131, 655], [128, 128, 640])
    assert str(err) == (
        "DSV4 target and draft pools must share SWA ring geometry: target=(128, 131, 655), draft=(128, 128, 640)"
    )


def test_paged_geometry_sentence_prints_python_tuples():
    err = e.PagedSWAGeometryMismatch.build((256, 128), (512, 128))
    assert type(err) is e.PagedSWAGeometryMismatch
    assert isinstance(err, RuntimeError)
    assert str(err) == (
        "DSV4 target and draft pools must share paged SWA geometry: target=(256, 128), draft=(512, 128)"
    )
    err = e.PagedSWAGeometryMismatch.build([256, 128], [256, 64])
    assert str(err) == ("DSV4 target and draft pools must share paged SWA geometry: target=(256, 128), draft=(256, 64)")


@pytest.mark.parametrize("cls", [e.SWARingGeometryMismatch, e.PagedSWAGeometryMismatch])
def test_geometry_errors_need_their_tuples(cls):
    with pytest.raises(TypeError):
        cls()


def test_missing_draft_mapping_reads_like_upstream_attribute_error():
    err = e.DraftMappingMissing()
    assert isinstance(err, AttributeError)
    assert isinstance(err, RuntimeError)
    assert str(err) == MISSING_MAPPING_ERROR


@pytest.mark.parametrize(
    "cls",
    [
        e.DraftNotSWAOnly,
        e.UnifiedKVModeMismatch,
        e.SWAIndexMappingNotShared,
        e.SWARingGeometryMismatch,
        e.PagedSWAGeometryMismatch,
        e.PageSizeMismatch,
        e.KVCacheDtypeMismatch,
    ],
)
def test_upstream_errors_are_runtime_errors(cls):
    # one root for everything pdstate raises; upstream's base kept as a mixin for its callers
    assert issubclass(cls, RuntimeError)
    assert issubclass(cls, e.PdStateError)


# --- cross-side sentences ---------------------------------------------------------------------


def test_page_size_sentence():
    err = e.PageSizeMismatch.build(256, 512)
    assert isinstance(err, e.CrossSideMismatch) and isinstance(err, RuntimeError)
    assert str(err) == (
        "Page size mismatch: prefill server has page_size=256, but decode server has page_size=512. "
        "Both servers must use the same --page-size value."
    )


def test_kv_dtype_sentence():
    err = e.KVCacheDtypeMismatch.build("float8_e4m3fn", "bfloat16")
    assert isinstance(err, e.CrossSideMismatch) and isinstance(err, RuntimeError)
    assert str(err) == (
        "KV cache dtype mismatch: prefill server has kv_cache_dtype=float8_e4m3fn, but decode server "
        "has kv_cache_dtype=bfloat16. Both servers must use the same --kv-cache-dtype value."
    )


def test_layout_sentence_names_factor_and_reprs():
    err = e.LayoutMismatch.build("sliding_window", 128, 64)
    assert str(err) == (
        "DSV4 layout mismatch on sliding_window: prefill server has sliding_window=128, but decode "
        "server has sliding_window=64. Both servers must build the same state layout."
    )
    err = e.LayoutMismatch.build("layout_variant", "paged", "unified")
    assert "layout_variant='paged'" in str(err) and "layout_variant='unified'" in str(err)


# --- construction ---------------------------------------------------------------------------


def test_online_c128_mtp_text():
    err = e.OnlineC128MTPUnsupported()
    assert str(err) == "online c128 does not support MTP"
    assert isinstance(err, AssertionError)  # upstream asserts it
    assert isinstance(err, e.PdStateError)


def test_online_c128_ring_rule_raises_the_text():
    with pytest.raises(e.OnlineC128MTPUnsupported, match=r"^online c128 does not support MTP$"):
        g.c128_ring_size(speculative=True, online_c128=True, online_c128_mtp=False)
    assert g.c128_ring_size(speculative=True, online_c128=True, online_c128_mtp=True) == 1
    assert g.c128_ring_size(speculative=False, online_c128=True, online_c128_mtp=False) == 1
    assert g.c128_ring_size(speculative=False, online_c128=False, online_c128_mtp=False) == 128
    assert g.c128_ring_size(speculative=True, online_c128=False, online_c128_mtp=False) == 256
    assert g.c4_ring_size(False) == 8 and g.c4_ring_size(True) == 16


@pytest.mark.parametrize("cls", [e.PoolConfigError, e.ConfigError])
def test_config_errors_are_value_errors(cls):
    assert issubclass(cls, ValueError) and issubclass(cls, e.PdStateError)


def test_index_errors_are_not_the_builtin():
    for cls in (e.PaddingPageIndex, e.IndexCountMismatch, e.IndexOutOfRange, e.ItemLengthMismatch):
        assert issubclass(cls, e.IndexRefused) and issubclass(cls, e.PdStateError)
        assert not issubclass(cls, IndexError)


# --- rebuilding a peer's refusal ------------------------------------------------------------


@pytest.mark.parametrize(
    "err",
    [
        e.DraftNotSWAOnly(),
        e.UnifiedKVModeMismatch(),
        e.SWAIndexMappingNotShared(),
        e.SWARingGeometryMismatch.build((128, 131, 655), (64, 67, 335)),
        e.PagedSWAGeometryMismatch.build((256, 128), (512, 128)),
        e.DraftMappingMissing(),
        e.PageSizeMismatch.build(256, 512),
        e.KVCacheDtypeMismatch.build("float8_e4m3fn", "bfloat16"),
        e.LayoutMismatch.build("c4_ring_size", 16, 8),
        e.PaddingPageIndex("slot maps to 0"),
    ],
)
def test_error_from_wire_round_trip(err):
    back = e.error_from_wire(type(err).__name__, str(err))
    assert type(back) is type(err)
    assert str(back) == str(err)


def test_error_from_wire_unknown_type_is_a_remote_error():
    back = e.error_from_wire("SomethingElse", "boom")
    assert type(back) is e.RemoteError and isinstance(back, RuntimeError)
    assert str(back) == "boom" and back.type_name == "SomethingElse"


def test_error_from_wire_knows_every_class_without_other_imports():
    # the table is this module's own classes: no class elsewhere, none missing
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; from pdstate import errors as e; "
        "assert type(e.error_from_wire('InvalidEndpoint', 'x')) is e.InvalidEndpoint; "
        "assert type(e.error_from_wire('NotRegistered', 'x')) is e.NotRegistered; "
        "assert all(c.__module__ == 'pdstate.errors' for c in e.WIRE_TYPES.values())"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_swa_geometry_sentence_of_0_5_23():
    """0.5.23's paged geometry refusal: its wording, a three-element tuple with ``None`` where a
    pool has no request window / per-request ring; a ``PagedSWAGeometryMismatch`` and a RuntimeError."""
    err = e.SWAGeometryMismatch.build((256, 128, None), [512, 128, None])
    assert type(err) is e.SWAGeometryMismatch
    assert isinstance(err, e.PagedSWAGeometryMismatch) and isinstance(err, RuntimeError)
    assert str(err) == (
        "DSV4 target and draft pools must share SWA geometry: target=(256, 128, None), draft=(512, 128, None)"
    )
    assert e.WIRE_TYPES["SWAGeometryMismatch"] is e.SWAGeometryMismatch
    back = e.error_from_wire("SWAGeometryMismatch", str(err))
    assert type(back) is e.SWAGeometryMismatch and str(back) == str(err)
