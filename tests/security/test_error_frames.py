"""PROTOCOL §7: a prefill never answers an ``error`` frame with an ``error`` frame (well-formed,
malformed, multipart, for an unknown room); an ``error`` naming a room in flight ends that
request with the decode's reason; the prefill keeps answering throughout."""

from __future__ import annotations

import msgpack
import pytest

from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo
from tests.support.faults import hold_copies, release_copies
from tests.support.hostile import RawDealer, RawDecode
from tests.support.workers import Workers, wait_transferring

QUIET_MS = 300


@pytest.fixture
def dealer():
    """A raw ZeroMQ client on a fresh prefill worker process."""
    with Workers() as ws:
        _, endpoint = ws.prefill()
        d = RawDealer(endpoint)
        try:
            yield d
        finally:
            d.close()


def _error(room=None) -> wire.Error:
    return wire.Error(error=ErrorInfo(type="ProtocolError", message="decode could not read a frame"), room=room)


def _assert_still_answers(dealer: RawDealer) -> None:
    hb = wire.Heartbeat(worker_id="probe", incarnation="0", seq=1)
    answer = dealer.ask(hb)
    assert isinstance(answer, wire.Error) and answer.error.type == "NotRegistered", answer


def test_error_frames_are_never_answered_with_error_frames():
    with Workers() as ws:
        _, endpoint = ws.prefill()
        dealer = RawDealer(endpoint)
        try:
            malformed = msgpack.packb({"v": wire.PROTOCOL_VERSION, "kind": "error", "body": b"\x01"})
            wrong_body = msgpack.packb(
                {"v": wire.PROTOCOL_VERSION, "kind": "error", "body": msgpack.packb({"error": 5})}
            )
            for frame in (wire.encode(_error()), wire.encode(_error(room=77)), malformed, wrong_body):
                dealer.send(frame)
                assert dealer.sock.poll(QUIET_MS) == 0, wire.decode(dealer.sock.recv())
            dealer.sock.send_multipart([wire.encode(_error()), wire.encode(_error())])
            assert dealer.sock.poll(QUIET_MS) == 0, wire.decode(dealer.sock.recv())
            _assert_still_answers(dealer)
        finally:
            dealer.close()


def test_an_error_for_a_room_in_flight_ends_that_request_with_the_decodes_reason():
    with Workers() as ws:
        prefill, endpoint = ws.prefill(**hold_copies())
        fake = RawDecode(worker_id="reporter")
        dealer = RawDealer(endpoint, f"reporter/{fake.incarnation}".encode())
        try:
            assert isinstance(fake.handshake(dealer), wire.Accept)
            dealer.send(fake.request(9, 1000))
            wait_transferring(prefill, "reporter", jobs=1)
            dealer.send(_error(room=9))
            done = dealer.read_until(lambda m: isinstance(m, wire.TransferDone))[-1]
            assert done.room == 9 and done.status == "failed"
            assert done.error.message == "decode reported: ProtocolError: decode could not read a frame"
            release_copies(prefill)
        finally:
            dealer.close()
            fake.close()


def test_an_unregistered_heartbeat_gets_not_registered(dealer):
    # was answered with the prefill's own heartbeat: its incarnation to anyone who asked
    answer = dealer.ask(wire.Heartbeat(worker_id="stranger", incarnation="0", seq=5))
    assert answer == wire.Error(
        error=ErrorInfo(type="NotRegistered", message="decode is not registered with this prefill")
    )


def test_multipart_and_oversized_frames_get_a_typed_error(dealer):
    # both were dropped without a word
    hb = wire.encode(wire.Heartbeat(worker_id="probe", incarnation="0", seq=1))
    dealer.sock.send_multipart([hb, hb, hb])
    answer = wire.decode(dealer.sock.recv()) if dealer.sock.poll(10_000) else None
    assert answer == wire.Error(
        error=ErrorInfo(type="ProtocolError", message="a message is one frame (one ZeroMQ part); this one has 3")
    )
    big = wire.MAX_FRAME_BYTES + 100  # past the frame limit, within the transport's (PROTOCOL §2.5)
    dealer.send(b"\x00" * big)
    answer = wire.decode(dealer.sock.recv()) if dealer.sock.poll(10_000) else None
    assert answer == wire.Error(
        error=ErrorInfo(
            type="ProtocolError", message=f"frame of {big} bytes exceeds the limit of {wire.MAX_FRAME_BYTES} bytes"
        )
    )
    _assert_still_answers(dealer)


def test_an_empty_boot_id_is_refused():
    # was: the same-host check skipped, the segments mapped
    with Workers() as ws:
        _, endpoint = ws.prefill()
        fake = RawDecode(worker_id="no-boot-id")
        dealer = RawDealer(endpoint)
        try:
            answer = fake.handshake(dealer, {**fake.endpoint, "boot_id": ""})
            assert isinstance(answer, wire.Reject), answer
            assert answer.error.type == "InvalidEndpoint"
            assert answer.error.message == (
                f"shm engine: peer shm:{fake.endpoint['engine_id']} sent no boot id (/proc/sys/kernel/random/boot_id); "
                "shared memory needs both sides on one host, which the boot id proves"
            )
        finally:
            dealer.close()
            fake.close()
