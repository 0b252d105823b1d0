"""``pdstate serve``'s two workers, callers of the embeddable agent (``pdstate.agent``).

``prefill`` and ``decode`` are the workers; ``base`` what they share (their side, an allocator
callers may wait on, request records); ``options`` what they are given (and the test seams,
``WorkerHooks``); ``requests`` a request's allocation and index lists; ``synth`` the synthetic
content that stands in for the model, and its verification; ``status`` what ``status()``
returns and a decode request's result; ``stats`` their counters.

Layer: over the agent, below ``service`` (HTTP and ``serve``).
"""
