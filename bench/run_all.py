"""Run every benchmark in bench/ one after another and write bench/RESULTS.md.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/sb_bench REDIS_URL=redis://127.0.0.1:6379/0 \\
        python bench/run_all.py [--quick] [--only ingest,mcp] [--results bench/RESULTS.md]

A benchmark is any ``bench/*.py`` with a ``__main__`` block but ``mcp_reference_server.py`` (the
server ``mcp.py`` starts) (``bare_asgi.py`` and ``bare_sql_asgi.py`` are the floor apps
that ``ingest.py`` serves, not benchmarks). Each runs with its own defaults, or with small
arguments under ``--quick`` (a smoke run: the numbers are then not worth quoting). ``queue.py``
compares against Procrastinate, so it runs in ``bench/.venv`` (created from
bench/requirements.txt when missing); the others run with this interpreter.

RESULTS.md records the machine (CPU, cores, memory, PostgreSQL and Redis versions, Python), the
date and commit, each script's command, exit code, duration and full output, and a summary of
every line that states a ratio. Scripts run sequentially: they are measured side by side inside
each script, and running two at once would only measure the contention.
"""

import sys
from pathlib import Path

# Run as a script, this folder is sys.path[0], and bench/queue.py and bench/mcp.py would shadow
# the standard library's queue module (psycopg imports it) and the mcp SDK.
sys.path[:] = [entry for entry in sys.path
               if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
VENV_PYTHON = BENCH / ".venv" / "bin" / "python"
NEEDS_BENCH_VENV = {"queue"}
# Small arguments for --quick (a smoke run of the harness, not a measurement).
QUICK_ARGS = {
    "ingest": ["--deliveries", "200", "--rounds", "1", "--warmup", "50", "--max-seconds", "10"],
    "mcp": ["--todos", "200", "--clients", "2"],
    "metrics_scrape": ["--rows", "2000"],
    "push": ["--deliveries", "30", "--warmup", "5", "--waiters", "50"],
    "queue": ["--todos", "200", "--workers", "1,2", "--rounds", "1", "--history", "1000",
              "--samples", "100", "--breakdown-workers", "2", "--budget-blocks", "2",
              "--write-back-blocks", "2", "--block-cycles", "20"],
    "retention": ["--done", "20000", "--pending", "400"],
    "write_back": ["--deliveries", "10", "--warmup", "2"],
    "streams": ["--streams", "50", "--per-endpoint", "10", "--idle-seconds", "5",
                "--deliveries", "10", "--boards", "10"],
}
SCRIPT_TIMEOUT_SECONDS = 3600


def find_benchmarks() -> list[str]:
    names = []
    for path in sorted(BENCH.glob("*.py")):
        # Not benchmarks: this runner, and the servers that benchmarks start themselves.
        if path.name in ("__init__.py", "run_all.py", "mcp_reference_server.py"):
            continue
        if 'if __name__ == "__main__"' in path.read_text():
            names.append(path.stem)
    return names


def ensure_bench_venv():
    if VENV_PYTHON.exists():
        return
    print("creating bench/.venv (bench/requirements.txt)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(BENCH / ".venv")], check=True)
    subprocess.run([str(VENV_PYTHON), "-m", "pip", "install", "--quiet",
                    "--disable-pip-version-check", "-r", str(BENCH / "requirements.txt")],
                   cwd=BENCH, check=True)


def ensure_database(database_url: str):
    """bench/mcp.py migrates the database DATABASE_URL names but does not create it."""
    import psycopg

    server, name = database_url.rsplit("/", 1)
    with psycopg.connect(f"{server}/postgres", autocommit=True, connect_timeout=10) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def command_output(argv) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def describe_machine(env) -> list[tuple[str, str]]:
    cpu = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M)
        cpu = match.group(1) if match else cpu
    memory = "unknown"
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        match = re.search(r"^MemTotal:\s*(\d+) kB", meminfo.read_text(), re.M)
        memory = f"{int(match.group(1)) / 1024 / 1024:.1f} GiB" if match else memory
    pg_version = "unknown"
    try:
        import psycopg

        with psycopg.connect(env["DATABASE_URL"], connect_timeout=5) as conn:
            pg_version = conn.execute("SHOW server_version").fetchone()[0]
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        pg_version = f"unreachable ({type(exc).__name__})"
    return [
        ("Host", platform.node()),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("CPU", f"{cpu} × {os.cpu_count()} logical"),
        ("Memory", memory),
        ("Load average at start", " ".join(f"{x:.2f}" for x in os.getloadavg())),
        ("Python", platform.python_version()),
        ("PostgreSQL", pg_version),
        ("Redis", command_output(["redis-server", "--version"])),
        ("Commit", command_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])),
    ]


def run_benchmark(name: str, extra: list[str], env) -> dict:
    python = str(VENV_PYTHON) if name in NEEDS_BENCH_VENV else sys.executable
    argv = [python, str(BENCH / f"{name}.py"), *extra]
    shown = " ".join(["python" if python == sys.executable else "bench/.venv/bin/python",
                      f"bench/{name}.py", *extra])
    print(f"== {shown}", file=sys.stderr, flush=True)
    started = time.monotonic()
    stderr_tail = ""
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=SCRIPT_TIMEOUT_SECONDS)
        code, stdout = done.returncode, done.stdout
        if done.returncode:
            stderr_tail = "\n".join(done.stderr.splitlines()[-40:])
    except subprocess.TimeoutExpired as exc:
        code = "timeout"
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
    seconds = time.monotonic() - started
    output = stdout + (f"\n--- stderr (last 40 lines) ---\n{stderr_tail}" if stderr_tail else "")
    print(output, file=sys.stderr, flush=True)
    return {"name": name, "command": shown, "code": code, "seconds": seconds, "output": output,
            "stdout": stdout}


def ratio_lines(stdout: str) -> list[str]:
    """The lines that state a ratio, a goal/target or a CPU cost per operation, and the rows of
    any Markdown table (queue.py prints its a/b, a/c ratios as table columns; streams.py states
    its numbers against goals rather than as ratios)."""
    summary = r"\bratio\b|\bgoal\b|\btarget|\bcpu per\b|\d(?:\.\d+)?x\b"
    if not re.search(r"\bratio\b", stdout, re.I):
        # No ratio at all (push.py: latencies against a target): its headline latency lines too.
        summary += r"|\bp(50|99)\b"
    return [line.strip() for line in stdout.splitlines()
            if re.search(summary, line, re.I) or (line.startswith("|") and "---" not in line)]


def render(machine, results, *, quick: bool, started_at: datetime) -> str:
    lines = ["# Benchmark results", "",
             f"Written by `bench/run_all.py` on {started_at:%Y-%m-%d %H:%M} UTC"
             + (" — **quick smoke run: small arguments, numbers not meaningful**" if quick
                else "") + ".", "",
             "Every ratio is measured side by side inside one script run, so machine noise hits "
             "both sides alike; absolute numbers depend on this machine.", "",
             "## Machine", "", "| | |", "| --- | --- |"]
    lines += [f"| {key} | {value} |" for key, value in machine]
    lines += ["", "## Ratios (and headline numbers where a script prints no ratio)", ""]
    for result in results:
        found = ratio_lines(result["stdout"])
        status = "" if result["code"] == 0 else f" (exit {result['code']})"
        lines.append(f"* `{result['name']}`{status}:" + ("" if found
                                                       else " no summary line printed"))
        lines += [f"  * `{line}`" for line in found]
    lines.append("")
    for result in results:
        lines += [f"## {result['name']}", "",
                  f"`{result['command']}` — exit {result['code']}, {result['seconds']:.0f} s", "",
                  "```", result["output"].rstrip(), "```", ""]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small arguments (smoke run)")
    parser.add_argument("--only", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--results", default=str(BENCH / "RESULTS.md"))
    args = parser.parse_args()

    env = dict(os.environ)
    env.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/sb_bench")
    env.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
    # Production settings need a secrets key of their own; a bench-only one.
    env.setdefault("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtYmVuY2gtb25seS1zZWNyZXRzISE=")
    # queue.py names its server with BENCH_PG (it creates its own databases there).
    env.setdefault("BENCH_PG", env["DATABASE_URL"].rsplit("/", 1)[0])
    if not env["DATABASE_URL"].startswith("postgres"):
        sys.exit("bench/run_all.py measures PostgreSQL: set DATABASE_URL=postgres://…")

    ensure_database(env["DATABASE_URL"])
    names = find_benchmarks()
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - set(names)
        if unknown:
            sys.exit(f"no such benchmark: {sorted(unknown)} (have {names})")
        names = [name for name in names if name in wanted]
    if NEEDS_BENCH_VENV & set(names):
        ensure_bench_venv()

    started_at = datetime.now(timezone.utc)
    machine = describe_machine(env)
    results = [run_benchmark(name, QUICK_ARGS.get(name, []) if args.quick else [], env)
               for name in names]
    Path(args.results).write_text(render(machine, results, quick=args.quick,
                                         started_at=started_at))
    print(f"wrote {args.results}", file=sys.stderr)
    sys.exit(0 if all(result["code"] == 0 for result in results) else 1)


if __name__ == "__main__":
    main()
