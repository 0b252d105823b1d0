"""Test support: the one home of the helpers and constants the tests share.

==================  ==============================================================================
``paths``           the repository, ``src``, ``services``, the shared upstream recordings
``upstream``        upstream's error texts, word for word
``pools``           ``TINY``/``ROOMY``, upstream constructor keywords, draft wirings, cached reports
``images``          the ``SENTINEL`` byte and byte images of destination memory
``engines``         same-host engine options and parameters, the engine contract's rig
``decode_peer``     the engine contract's decode side (in a child process, or in this one)
``workers``         worker options, worker processes, their events and status commands
``services``        ``pdstate serve`` processes (``Service``) and HTTP waits with a deadline
``faults``          short timers and the one use of the runtime's fault-injection knob
``waiting``         ``wait_until``: polling with a deadline
``summary``         the reliability summary table
``bounds``          ``within``: a wall-clock bound, at least 5x its quiet measurement, and their table
==================  ==============================================================================

Fixtures are defined once, in ``tests/conftest.py`` (those of one module, in that module); a
conftest holds only fixtures and hooks, and no test imports one (``tests/unit/test_suite_rules.py``).
"""
