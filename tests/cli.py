"""Run a management command the way ``manage.py`` does — argv parsing, exit status, stderr —
inside the test process (so it sees the test database). Use with pytest's ``capsys``.

This is ``BaseCommand.run_from_argv`` without its final ``connections.close_all()``, which
would close the test's own database connection."""

import json
from dataclasses import dataclass

from django.core.management import ManagementUtility
from django.core.management.base import CommandError


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self):
        lines = [line for line in self.out.splitlines() if line.strip()]
        assert len(lines) == 1, f"--json must print exactly one line, got {self.out!r}"
        return json.loads(lines[0])


def run_manage(capsys, name, *argv) -> Run:
    capsys.readouterr()  # drop anything printed before
    command = ManagementUtility(["manage.py", name]).fetch_command(name)
    command._called_from_command_line = True
    code = 0
    try:
        options = vars(command.create_parser("manage.py", name).parse_args(list(argv)))
        args = options.pop("args", ())
        command.execute(*args, **options)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2)
        code = exit_.code if isinstance(exit_.code, int) else 1
    except CommandError as error:
        command.stderr.write(f"{error.__class__.__name__}: {error}")
        code = error.returncode
    captured = capsys.readouterr()
    return Run(code, captured.out, captured.err)


def json_printed_after(text: str, marker: str):
    """The first JSON object printed after ``marker`` in a command's human output."""
    rest = text.split(marker, 1)[1]
    return json.JSONDecoder().raw_decode(rest[rest.index("{"):])[0]
