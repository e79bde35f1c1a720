"""The runner's own credential: read once, kept out of its environment, and out of reach of a
process of the same user (docs/runner.md#the-runners-credential)."""

import ctypes
import os
import sys
from pathlib import Path

PR_SET_DUMPABLE = 4  # <linux/prctl.h>


def read_credential(token_env: str, token_file: Path | None) -> str | None:
    """The credential from ``token_file`` (its first line) or the variable ``token_env``; either
    way the variable leaves ``os.environ``, so no child inherits it. None when empty or
    unreadable."""
    token = os.environ.pop(token_env, None)
    if token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as source:
                token = source.readline()
        except (OSError, UnicodeDecodeError):
            return None
    return (token or "").strip() or None


def make_undumpable() -> bool:
    """Linux: no core dumps, and ``/proc/<pid>/environ``, ``mem``, ``fd`` and ptrace closed to
    processes of the same user (the kernel shows /proc's initial environment, which removing
    the variable does not change). Reset by execve, so the agent is not affected. False
    elsewhere or when the call failed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
