"""The protocol: facts, layout reports, compatibility, wire messages, handshake, lifecycles.

Pure and torch-free (msgpack and pydantic only), so a probe, a schema export or a peer written
against the wire can import it without the pool model.
"""
