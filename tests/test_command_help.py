"""Every switchboard management command has --help (§9), and every one that prints takes
--json (§11). Commands added later are picked up by themselves."""

import pytest
from django.core.management import get_commands, load_command_class

from switchboard.commands import JsonCommand
from tests.cli import run_manage

OUR_APPS = ("endpoints", "todos", "ingest", "channels_push")
# Commands that run until stopped and print no result (§11: "—").
NO_JSON = {"serve"}

OUR_COMMANDS = sorted(name for name, app in get_commands().items() if app in OUR_APPS)


def test_the_contract_commands_exist():
    assert {"serve", "seed_demo", "vend_endpoint", "rotate_credential", "add_webhook",
            "add_webhook_route", "requeue", "reap"} <= set(OUR_COMMANDS)


@pytest.mark.parametrize("name", OUR_COMMANDS)
def test_command_has_help_and_json(capsys, name):
    command = load_command_class(get_commands()[name], name)
    assert command.help, f"{name} has no help text"
    run = run_manage(capsys, name, "--help")
    assert run.code == 0 and "usage:" in run.out
    if name not in NO_JSON:
        assert isinstance(command, JsonCommand), f"{name} should accept --json (a JsonCommand)"
        assert "--json" in run.out
