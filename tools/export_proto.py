"""Export the wire protocol's JSON Schemas and golden vectors into ``proto/``.

    python tools/export_proto.py            # (re)write proto/schema and proto/vectors
    python tools/export_proto.py --check    # exit 1 if a committed file differs from what would be written

Writes
- ``proto/schema/<kind>.json``: ``wire.json_schemas()[kind]``, JSON with sorted keys, indent 2 and a
  trailing newline (``tests/unit/test_wire.py`` fails when these drift from the models);
- ``proto/vectors/<kind>.msgpack``: the bytes of ``wire.encode(msg)`` for one fixed example message of
  each kind, and ``proto/vectors/<kind>.json``, the same frame decoded for humans (bytes as
  ``{"$hex": "..."}``);
- ``proto/vectors/heartbeat.authed.msgpack`` (+ ``.json``): a frame carrying an auth tag made with
  ``GOLDEN_TOKEN`` (documented in ``proto/vectors/README.md``);
- ``proto/vectors/agent_request.seq_len.msgpack`` (+ ``.json``): the ``agent_request`` example with
  its later, optional ``seq_len`` set (absent from ``agent_request.msgpack``);
- ``proto/vectors/agent_request.verify.msgpack`` and ``transfer_done.digest_form.msgpack`` (+ ``.json``):
  the later, optional verification fields set (``verify: "sampled"``, ``digest_form: "device"``);
- ``proto/vectors/agent_request.sample_rule.msgpack`` (+ ``.json``): a sampled request naming its
  sampling rule (``verify: "sampled"``, ``sample_rule: 2``).

Every example is deterministic: the layout reports come from ``build_report`` on the ``tiny``
preset, with the process-specific fields (mapping-identity nonces and data pointers, buffer
addresses) replaced by fixed values.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import msgpack

from pdstate import errors
from pdstate.pools.presets import build_worker_pools, preset
from pdstate.pools.reporting import build_report
from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo, LayoutReport, MappingIdentityModel

REPO = Path(__file__).resolve().parents[1]
PROTO = REPO / "proto"

GOLDEN_TOKEN = b"pdstate-golden-vector-token"
AUTHED_NAME = "heartbeat.authed"
SEQ_LEN_NAME = "agent_request.seq_len"  # AgentRequest with its later, optional field set
VERIFY_NAME = "agent_request.verify"  # AgentRequest asking a sampled, device-form digest
DIGEST_FORM_NAME = "transfer_done.digest_form"  # TransferDone with a device-form digest
SAMPLE_RULE_NAME = "agent_request.sample_rule"  # AgentRequest asking a sampled digest by rule 2

# Fixed stand-ins for what differs per process.
FIXED_MAPPING_NONCE = "00112233aabbccdd"
FIXED_MAPPING_PTR = 0x5555_0000_0000
FIXED_BUFFER_BASE = 0x7F00_0000_0000
_ALIGN = 4096


def _fixed_identity(report: LayoutReport, nonce: str) -> LayoutReport:
    """The report with its mapping identities replaced by a fixed one (shared by target and draft)."""

    def fix(facts):
        if facts is None or facts.mapping_identity is None:
            return facts
        mi = facts.mapping_identity
        return facts.model_copy(
            update={
                "mapping_identity": MappingIdentityModel(
                    nonce=nonce, data_ptr=FIXED_MAPPING_PTR, numel=mi.numel, dtype=mi.dtype
                )
            }
        )

    return report.model_copy(update={"target": fix(report.target), "draft": fix(report.draft)})


def _fixed_kv(kv: wire.KVDesc) -> wire.KVDesc:
    """The descriptor with every buffer moved to fixed, page-aligned, non-overlapping addresses."""
    addr = FIXED_BUFFER_BASE

    def place(lens: list[int]) -> list[int]:
        nonlocal addr
        out = []
        for n in lens:
            out.append(addr)
            addr += -(-n // _ALIGN) * _ALIGN
        return out

    return wire.KVDesc(
        kv_data_ptrs=place(kv.kv_data_lens),
        kv_data_lens=kv.kv_data_lens,
        kv_item_lens=kv.kv_item_lens,
        components=[c.model_copy(update={"ptrs": place(c.lens)}) for c in kv.components],
    )


def tiny_side(nonce: str = FIXED_MAPPING_NONCE) -> tuple[LayoutReport, wire.KVDesc]:
    """A deterministic layout report and descriptor of a worker built from the ``tiny`` preset."""
    pools = build_worker_pools(preset("tiny"))
    try:
        report, kv_args = build_report(pools.target, pools.draft)
        assert kv_args is not None, report.local_check
        return _fixed_identity(report, nonce), _fixed_kv(wire.KVDesc.of(kv_args))
    finally:
        pools.close()


V1_FIRST_KINDS = (
    "abort",
    "accept",
    "busy",
    "error",
    "heartbeat",
    "register",
    "reject",
    "transfer_done",
    "transfer_request",
)


def examples() -> dict[str, wire.Message]:
    """One fixed example message per kind (the golden vectors), keyed by kind."""
    decode_report, decode_kv = tiny_side("00112233aabbccdd")
    prefill_report, _ = tiny_side("8899aabbccddeeff")
    msgs: list[wire.Message] = [
        wire.Register(
            worker_id="decode-0",
            incarnation="0123456789abcdef",
            role="decode",
            report=decode_report,
            kv=decode_kv,
            engine=wire.EngineDesc(name="shm", endpoint={"segment": "pdstate-decode-0"}),
        ),
        wire.Accept(
            worker_id="prefill-0",
            incarnation="fedcba9876543210",
            report=prefill_report,
            heartbeat_interval_s=1.0,
            peer_timeout_s=5.0,
        ),
        wire.Reject(worker_id="prefill-0", error=ErrorInfo.of(errors.SWAIndexMappingNotShared())),
        wire.Heartbeat(worker_id="decode-0", incarnation="0123456789abcdef", seq=42),
        wire.TransferRequest(
            room=7,
            seq_len=300,
            dst_kv_pages=wire.PackedIndices.pack([1, 2]),
            dst_state_indices=[
                wire.PackedIndices.pack([3, 4]),  # SWA (target)
                wire.PackedIndices.pack([2]),  # C128_STATE
                wire.PackedIndices.pack([3, 4]),  # SWA (draft)
            ],
            deadline_s=30.0,
        ),
        wire.TransferDone(
            room=7,
            status="success",
            bytes=1_234_432,
            descriptors=12,
            digest=hashlib.blake2b(b"pdstate golden vector", digest_size=16).digest(),
            error=None,
            compute_s=0.0125,
            copy_s=0.00375,
        ),
        wire.Abort(room=7, reason="decode cancelled the request"),
        wire.AgentRequest(
            room=9,
            dst_kv_pages=wire.PackedIndices.pack([5, 6, 9]),
            dst_state_indices=[
                wire.PackedIndices.pack([3, 4]),  # SWA (target)
                wire.PackedIndices.pack([2]),  # C128_STATE
                wire.PackedIndices.pack([3, 4]),  # SWA (draft)
            ],
            dst_aux=wire.AuxDest(
                ptrs=[FIXED_BUFFER_BASE + 0x100000, FIXED_BUFFER_BASE + 0x101000], item_lens=[64, 8], index=3
            ),
            digest=True,
            deadline_s=600.0,
        ),
        wire.AgentVerdict(
            room=9,
            status="failed",
            error=ErrorInfo(
                type="DigestMismatch",
                message="room 9: digest of the 4096 bytes that landed (00) differs from the prefill's digest of the bytes it sent (01)",
            ),
        ),
        wire.Busy(room=8, in_flight=64, limit=64),
        wire.Landed(room=9, pages=2, state_landed=True),
        wire.Goodbye(worker_id="prefill-0", incarnation="fedcba9876543210", reason="prefill shutting down"),
        wire.Challenge(
            worker_id="prefill-0",
            incarnation="fedcba9876543210",
            nonce=hashlib.blake2b(b"pdstate golden challenge", digest_size=16).digest(),
        ),
        wire.Error(
            error=ErrorInfo(
                type="ProtocolError",
                # the v1 kinds as first released, spelled out so that later kinds leave this vector as it is
                message="unknown message kind 'hello'; known: " + str(sorted(V1_FIRST_KINDS)),
            ),
            room=None,
        ),
    ]
    out = {m.KIND: m for m in msgs}
    assert sorted(out) == sorted(wire.MESSAGES), "every message kind needs a golden example"
    return out


def authed_example() -> wire.Message:
    return wire.Heartbeat(worker_id="decode-0", incarnation="0123456789abcdef", seq=43)


def _human(value: Any) -> Any:
    """Msgpack-decoded value -> JSON-able value (bytes as ``{"$hex": ...}``)."""
    if isinstance(value, bytes):
        return {"$hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_human(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _human(v) for k, v in value.items()}
    return value


def human_frame(frame: bytes) -> dict:
    """The envelope of ``frame`` with its body decoded as well (the raw wire fields)."""
    env = msgpack.unpackb(frame, raw=False)
    out = {"v": env["v"], "kind": env["kind"], "body": _human(msgpack.unpackb(env["body"], raw=False))}
    if "auth" in env:
        out["auth"] = _human(env["auth"])
    return out


def schema_text(schema: dict) -> str:
    """A schema file's text: sorted keys, indent 2, trailing newline."""
    return json.dumps(schema, sort_keys=True, indent=2) + "\n"


def human_text(frame: bytes) -> str:
    """A vector's ``.json`` text: keys in wire order (map order is part of the exact bytes)."""
    return json.dumps(human_frame(frame), indent=2) + "\n"


def outputs() -> dict[Path, bytes]:
    """Every file this tool writes, relative to ``proto/``, with its content."""
    files: dict[Path, bytes] = {}
    for kind, schema in wire.json_schemas().items():
        files[Path("schema") / f"{kind}.json"] = schema_text(schema).encode()
    frames = {kind: wire.encode(msg) for kind, msg in examples().items()}
    frames[AUTHED_NAME] = wire.encode(authed_example(), token=GOLDEN_TOKEN)
    frames[SEQ_LEN_NAME] = wire.encode(examples()["agent_request"].model_copy(update={"seq_len": 300}))
    asks = {"verify": "sampled", "digest_form": "device"}
    frames[VERIFY_NAME] = wire.encode(examples()["agent_request"].model_copy(update=asks))
    rule = {"verify": "sampled", "sample_rule": 2}
    frames[SAMPLE_RULE_NAME] = wire.encode(examples()["agent_request"].model_copy(update=rule))
    frames[DIGEST_FORM_NAME] = wire.encode(examples()["transfer_done"].model_copy(update={"digest_form": "device"}))
    for name, frame in frames.items():
        files[Path("vectors") / f"{name}.msgpack"] = frame
        files[Path("vectors") / f"{name}.json"] = human_text(frame).encode()
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report drift instead of writing")
    ap.add_argument("--out", type=Path, default=PROTO, help="the proto/ directory")
    args = ap.parse_args(argv)
    stale = []
    for rel, content in sorted(outputs().items()):
        path = args.out / rel
        if path.exists() and path.read_bytes() == content:
            continue
        stale.append(str(rel))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
    if args.check:
        for rel in stale:
            print(f"stale: proto/{rel}", file=sys.stderr)
        return 1 if stale else 0
    print(f"wrote {len(stale)} file(s) under {args.out}" if stale else "proto/ is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
