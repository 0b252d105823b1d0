"""``python -m pdstate.integrations.sglang.launch_server ARGS...``: SGLang's server with pdstate installed.

The arguments are SGLang's own (``python -m sglang.launch_server ARGS...``), so an operator changes
one word: ``--disaggregation-transfer-backend pdstate``. ``main`` installs pdstate, then runs what
``sglang.launch_server`` runs as ``__main__``: ``load_plugins()``, ``prepare_server_args(argv)``,
``run_server(...)`` and, whatever happens, ``kill_process_tree(own pid, include_parent=False)``.

Importing this module installs too: SGLang starts its schedulers with the ``spawn`` start method,
and a spawned child re-imports the main module (as ``__mp_main__``), so every process of the
server registers the backend before it reads ``--disaggregation-transfer-backend``.
"""

from __future__ import annotations

import os
import sys

from pdstate.errors import ExitCode, SGLangUnavailable
from pdstate.integrations.sglang import install

try:
    install()
except SGLangUnavailable as exc:
    if __name__ not in ("__main__", "__mp_main__"):
        raise
    print(f"pdstate: {exc}", file=sys.stderr)  # one line, no traceback: the command itself was run
    raise SystemExit(ExitCode.CONFIG) from None


def main(argv: list[str] | None = None) -> None:
    """Run SGLang's server entry point on ``argv`` (default: this process's arguments)."""
    install()
    from sglang import launch_server as entry

    entry.load_plugins()
    server_args = entry.prepare_server_args(list(sys.argv[1:] if argv is None else argv))
    try:
        entry.run_server(server_args)
    finally:
        entry.kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
