"""``pdstate bench``'s re-registration row (``devtools.bench._handshake_ms``) on ``pdstate serve``'s
worker pair (``tiny`` pools, shm, in this process): each call is one new handshake, answered
once, and what it returns is the decode's own round trip of that handshake."""

from __future__ import annotations

from pdstate.devtools.bench import _handshake_ms
from pdstate.pools.presets import preset
from pdstate.protocol.lifecycle import PeerState
from pdstate.worker.decode import AgentDecodeWorker
from pdstate.worker.options import WorkerOptions
from pdstate.worker.prefill import AgentPrefillWorker


def test_each_re_registration_is_one_answered_handshake_timed_by_the_decode():
    tiny = preset("tiny")
    with AgentPrefillWorker(WorkerOptions(role="prefill", pool=tiny, engine="shm")) as p:
        opts = WorkerOptions(role="decode", pool=tiny, engine="shm", peer=p.endpoint)
        with AgentDecodeWorker(opts) as d:
            first = _handshake_ms(d, 30)
            answers = dict(d.agent.handshakes)
            assert first > 0 and answers == {"accepted": 1, "rejected": 0}
            for k in range(2, 5):
                ms = _handshake_ms(d, 30, again=True)
                peer = d.agent.prefills()[p.endpoint]
                assert d.agent.handshakes == {"accepted": k, "rejected": 0}
                assert peer.state is PeerState.ACCEPTED and peer.handshakes == k
                assert ms == peer.handshake_s * 1e3 and ms > 0
