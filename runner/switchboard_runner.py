#!/usr/bin/env python3
"""Run the switchboard runner from a checkout, without installing it:
``python runner/switchboard_runner.py --url … -- agent …`` is ``switchboard-runner --url …``.
The code is the ``switchboard_runner`` package under ``src/`` (``pip install ./runner``
installs the same package and the ``switchboard-runner`` command)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))

from switchboard_runner.cli import main  # noqa: E402 (the path above makes it importable)

if __name__ == "__main__":
    sys.exit(main())
