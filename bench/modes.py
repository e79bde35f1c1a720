"""The two ways switchboard runs, side by side in one bench run (bench/push.py,
bench/write_back.py): each mode measured in a child process of its own, started with that
mode's environment.

* embedded: no DATABASE_URL, REDIS_URL or SECRET_KEY, so the child and the server it starts use
  SQLite in a fresh temporary ``SWITCHBOARD_VAR_DIR`` and the in-process scheduler;
* the server mode: the caller's environment as it is (PostgreSQL and Redis).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_children(script: str, server_mode: str, child_args: list[str]) -> dict:
    """Run ``script --child MODE *child_args`` for ``embedded`` and then ``server_mode``, each
    in its environment; returns mode -> the JSON its last stdout line printed. Exits with the
    child's output when one fails."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-embedded-") as var_dir:
        embedded_env = {k: v for k, v in os.environ.items()
                        if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")}
        embedded_env["SWITCHBOARD_VAR_DIR"] = var_dir
        for mode, env in (("embedded", embedded_env), (server_mode, dict(os.environ))):
            out = subprocess.run([sys.executable, script, "--child", mode, *child_args],
                                 env=env, cwd=ROOT, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.exit(f"{mode} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]
