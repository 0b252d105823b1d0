"""SGLang's launch arguments -> the DeepSeek-V4 layout each server will build, and the pair's check.

What ``pdstate check --sglang PREFILL DECODE`` runs, offline: no SGLang and no torch at import
(``pdstate.service.preflight`` imports this package lazily, when ``--sglang`` is given; a test
imports it with both blocked). The pool model is imported only when a side is compared.

- ``command``: reading one launch (``VAR=value`` tokens, ``--flags``, ``@path``, a running
  server's ``/get_server_info``) and the tables of what is modelled, layout-neutral or not modelled;
- ``prediction``: ``predict(role, launch)`` -> ``SGLangSide``, what a release (0.5.19 or 0.5.23)
  resolves the arguments to, and ``SGLangSide.pool_settings()`` for pdstate's own pool model;
- ``comparison``: ``compare(prefill, decode)`` runs the handshake's checks on the two predicted
  layouts and ``render`` explains each differing factor: both values, what SGLang's own backend
  does at run time, and the flag to change on which side.
"""
