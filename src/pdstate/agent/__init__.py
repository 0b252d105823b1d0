"""The embeddable agent: move DSV4 state between a serving engine's own pools.

``PrefillAgent`` / ``DecodeAgent`` wrap the caller's memory (a filled ``KVArgs``) and speak the
control protocol to any number of peers; per request a ``KVSender`` (prefill) or ``KVReceiver``
(decode) follows upstream's lifecycle (``pdstate.protocol.lifecycle.RequestState``). The bytes
are digested on both sides (``pdstate.agent.digest``) before a request succeeds.

Layer: beside ``pdstate.runtime`` — imports errors, protocol, pools and transfer only.
"""

from pdstate.agent.decode import DecodeAgent, KVReceiver
from pdstate.agent.prefill import KVSender, PrefillAgent
from pdstate.protocol.lifecycle import RequestState

__all__ = ["DecodeAgent", "KVReceiver", "KVSender", "PrefillAgent", "RequestState"]
