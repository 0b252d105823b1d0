"""SGLang's launch arguments -> the DeepSeek-V4 layout each server will build, and the pair's check.

What ``pdstate check --sglang PREFILL DECODE`` runs, offline: no SGLang and no torch at import
(``pdstate.service.preflight`` imports this package lazily, when ``--sglang`` is given; a test
imports it with both blocked). The pool model is imported only when a side is compared.

- ``argtable``: SGLang's own argument parser per release, rebuilt from ``args-<release>.json``
  (extracted from each release's ``ServerArgs`` by ``pdstate.devtools.sglang_args``);
- ``command``: reading one launch (``VAR=value`` tokens, scripts with ``export`` lines, ``sglang
  serve`` / ``python -m sglang.launch_server`` and wrappers, ``@path``, SGLang's ``--config`` YAML,
  a running server's ``/get_server_info``); ``coverage``: which settings are modelled, layout-neutral
  or not modelled; ``model``: the model served and its ``config.json``; ``recipe``: both launches
  from one srt-slurm / Dynamo recipe YAML;
- ``prediction``: ``predict(role, launch)`` -> ``SGLangSide`` (``side``), what a release (a row of
  ``integrations.sglang.releases``) resolves the arguments to (its rules: ``rules``, reading the
  row's traits), and ``SGLangSide.pool_settings()`` for pdstate's own pool model (the row's ``pools``);
- ``comparison``: ``compare(prefill, decode)`` runs the handshake's checks on the two predicted
  layouts and ``render`` explains each differing factor: both values, what SGLang's own backend
  does at run time (``consequences``), and the flag to change on which side (``knobs``);
- ``backend``: what pdstate's own SGLang backend refuses at start (context and pipeline
  parallelism), in its words.
"""
