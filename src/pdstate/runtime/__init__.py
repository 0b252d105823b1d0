"""Composition: pools + engine + control channel -> ``PrefillWorker`` and ``DecodeWorker``.

``prefill`` (with ``prefill_peers`` and ``transfer``) and ``decode`` (with ``decode_link``) are
the workers; ``worker`` what they share; ``options`` and ``hooks`` what they are given; ``records``
their request and peer records, whose states move only through ``protocol.lifecycle.move``;
``mailbox`` and ``commands`` how their threads hand each other work; ``snapshot`` what
``status()`` returns; ``stats`` their counters; ``control`` the ZeroMQ sockets; ``requests`` and
``synth`` a request's allocation and its synthetic content. ``common`` only re-exports.
"""
