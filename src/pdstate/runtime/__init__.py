"""Composition: pools + engine + control channel -> ``PrefillWorker`` and ``DecodeWorker``."""
