"""The embeddable agent: move DSV4 state between a serving engine's own pools.

``PrefillAgent`` / ``DecodeAgent`` wrap the caller's memory (a filled ``KVArgs``; pdstate never
allocates or frees it) and speak the control protocol to any number of peers; per request a
``KVSender`` (prefill) or ``KVReceiver`` (decode) follows upstream's lifecycle
(``pdstate.protocol.lifecycle.RequestState``: BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING
-> SUCCESS | FAILED). The bytes are digested on both sides (``pdstate.agent.digest``) before a
request succeeds.

Threading contract (both agents):

* Each agent runs one I/O thread, started by the constructor and ended by ``close()``; it alone
  touches the ZeroMQ sockets, calls the engine's ``connect``/``submit``/``poll``/``wait`` and
  moves request states.
* Every public method of the agents, senders and receivers is safe from any thread. Methods that
  change something (``sender``, ``receiver``, ``init``, ``send``, ``abort``, ``close``) hand the
  work to the I/O thread and wait until it is accepted (``send`` does not wait for the copy);
  ``poll``, ``state``, ``failure_exception`` and ``metrics`` read without waiting; ``wait``
  blocks the calling thread only.
* ``KVReceiver.abort()`` blocks until the fence: the receiver is FAILED and no write of the
  request can land any more. The prefill confirms an abort (a failed ``TransferDone``) only after
  every engine handle of the request finished: shm copies synchronously on the prefill's I/O
  thread; loopback, Mooncake and NIXL handles are awaited as pending work while that thread goes
  on serving (``agent.fence``; a handle still in flight after ``fence.FENCE_TIMEOUT_S`` is never
  confirmed, and the decode's ``abort`` raises ``TransferTimedOut``). ``KVSender.abort()`` fences
  the same way before it tells the decode, and returns once the fence held.
* Never call an agent's blocking methods from inside the I/O thread (there are no callbacks, so
  only a caller that hands the agent its own thread could).

Layer: under ``pdstate.worker`` (serve's workers) — imports errors, protocol, pools and transfer only.
"""

from pdstate.agent.decode import DecodeAgent, KVReceiver
from pdstate.agent.prefill import KVSender, PrefillAgent
from pdstate.protocol.lifecycle import RequestState

__all__ = ["DecodeAgent", "KVReceiver", "KVSender", "PrefillAgent", "RequestState"]
