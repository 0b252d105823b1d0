"""Importing this module runs ``boot.install()``: child processes import it before any SGLang module."""

from __future__ import annotations

from pdstate.devtools.sglang_pair import boot

boot.install()
