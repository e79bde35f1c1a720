"""Production settings, but write-back may go to plain http on a loopback address: the system
suite's worker writes back to the GitHub stand-in its test runs (tests/system/test_write_back_outage.py)."""

from switchboard.settings import *  # noqa: F401,F403

SWITCHBOARD_WRITE_BACK_LOOPBACK_HTTP = True
