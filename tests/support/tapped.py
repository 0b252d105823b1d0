"""A prefill agent whose messages to its decodes pass through a test's tap.

``PrefillAgent`` sends every message to a decode (not its probes) through one method,
``_reply(identity, msg)``, on its I/O thread. ``TappedPrefillAgent`` overrides that one method and
nothing else, so the product class keeps no hook of its own for tests:

    pa = TappedPrefillAgent(kv_args, pools, engine=...)
    pa.tap = lambda identity, msg, send: (seen.append(msg), send(identity, msg))

``tap(identity, msg, send)`` runs on the I/O thread instead of the send: it sends the message with
``send(identity, msg)``, or not, and may send others beside it. ``tap = None`` sends them
straight again. Set it before the traffic it is for (a plain attribute the I/O thread reads once
per message).
"""

from __future__ import annotations

from collections.abc import Callable

from pdstate.agent import PrefillAgent
from pdstate.protocol import wire

Send = Callable[[bytes, wire.Message], None]
Tap = Callable[[bytes, wire.Message, Send], None]


class TappedPrefillAgent(PrefillAgent):
    """``PrefillAgent`` with ``tap``: see the module's docstring."""

    tap: Tap | None = None

    def _reply(self, identity: bytes, msg: wire.Message) -> None:
        tap = self.tap
        if tap is None:
            super()._reply(identity, msg)
        else:
            tap(identity, msg, super()._reply)
