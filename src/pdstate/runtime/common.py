"""Re-exports for the modules outside the runtime that still import from here (the command line,
the service, devtools and some tests). New code imports each name from the module that defines it:
``runtime.options`` (WorkerOptions), ``runtime.stats`` (Stats, LATENCY_WINDOW), ``runtime.worker``
(settle, tune_interpreter), ``pdstate.errors`` (LocalCheckFailed)."""

from pdstate.errors import LocalCheckFailed
from pdstate.runtime.options import WorkerOptions
from pdstate.runtime.stats import LATENCY_WINDOW, Stats
from pdstate.runtime.worker import settle, tune_interpreter

__all__ = ["LATENCY_WINDOW", "LocalCheckFailed", "Stats", "WorkerOptions", "settle", "tune_interpreter"]
