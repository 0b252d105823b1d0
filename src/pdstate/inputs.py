"""Reading the files an operator names (configs, launch scripts, SGLang's YAML and JSON, tokens go
through ``settings.auth``), bounded: a regular file of at most ``MAX_INPUT_BYTES``, never a FIFO,
a device or a directory, each refused with one line before anything blocks or grows.

The file is ``stat``-ed first (a FIFO or a device is never opened), then opened ``O_NONBLOCK`` and
``fstat``-ed again (what was opened is what was checked), and read up to the limit.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from pdstate.errors import ConfigError

MAX_INPUT_BYTES = 16 << 20  # 16 MiB: a config, a launch script or a model's config.json is a few KiB


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (``a FIFO``, ``a directory``...)."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_input_file(
    path: str | os.PathLike,
    *,
    unreadable: Callable[[str], str],
    directory: str | None = None,
    missing: str | None = None,
    max_bytes: int = MAX_INPUT_BYTES,
    error: type[ConfigError] = ConfigError,
) -> bytes:
    """The bytes of the regular file ``path``, or ``error`` of one line: ``directory`` when it is a
    directory, ``missing`` (when given) when it does not exist, else ``unreadable(why)`` (``why``:
    the system's reason, ``it is a FIFO, not a regular file``, ``it has N bytes, more than the
    limit of M``)."""

    def refuse(st: os.stat_result) -> None:
        if stat.S_ISDIR(st.st_mode) and directory is not None:
            raise error(directory)
        if not stat.S_ISREG(st.st_mode):
            raise error(unreadable(f"it is {file_kind(st.st_mode)}, not a regular file"))
        if st.st_size > max_bytes:
            raise error(unreadable(f"it has {st.st_size} bytes, more than the limit of {max_bytes}"))

    try:
        refuse(os.stat(path))
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        if missing is not None and isinstance(exc, FileNotFoundError):
            raise error(missing) from None
        raise error(unreadable(exc.strerror or str(exc))) from None
    try:
        refuse(os.fstat(fd))  # swapped since the stat
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise error(unreadable(exc.strerror or str(exc))) from None
    finally:
        os.close(fd)
    if size > max_bytes:  # it grew since the stat
        raise error(unreadable(f"it has more than the limit of {max_bytes} bytes"))
    return b"".join(chunks)
