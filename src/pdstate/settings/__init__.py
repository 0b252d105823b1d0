"""A worker's settings: its configuration (``config``: TOML, ``PDSTATE_*`` environment, ``--set``)
and the auth rules a configuration must pass (``auth``).

Below ``worker``, ``status``, ``integrations`` and ``service``: ``pdstate serve`` and an SGLang rank
read the same configuration through it, and neither imports the other for it.
"""
