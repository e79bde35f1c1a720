"""switchboard runner: turn any agent CLI into a switchboard worker.

A client of a vended MCP endpoint and nothing more: it needs the ``mcp`` SDK and the standard
library, never the server's code, so it installs alone on the agent's machine
(``pip install ./runner``). The modules:

* ``session`` — one MCP session with its notification stream, reopened when it breaks.
* ``agent`` — what one agent process gets: its arguments, prompt, environment, and the text
  kept of its output.
* ``work`` — the worker: claim, run, heartbeat, settle; and ``--dry-run``.
* ``watch`` — ``switchboard-runner watch``: one line per todo that becomes ready.
* ``cli`` — the command line.
"""

__version__ = "1.1.0"
