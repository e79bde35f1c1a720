"""manage.py serve: its --help (the server itself runs in tests/test_board_browser.py's way)."""

from tests.cli import run_manage


def test_serve_help(capsys):
    run = run_manage(capsys, "serve", "--help")
    assert run.code == 0
    for option in ("--host", "--port", "--sweeps"):
        assert option in run.out


def test_serve_rejects_a_bad_port(capsys):
    run = run_manage(capsys, "serve", "--port", "eighty")
    assert run.code != 0 and "invalid int value" in run.err
