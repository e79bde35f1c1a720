"""The layers of docs/architecture.md#the-layers hold: `lint-imports` (import-linter, the
contract in .importlinter) finds no module importing a layer above its own."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", *args], cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)},
                          capture_output=True, text=True, timeout=120)


def test_no_module_imports_a_layer_above_its_own():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 1 kept, 0 broken." in run.stdout, run.stdout


def test_the_contract_fails_on_a_lower_layer_importing_a_higher_one(tmp_path):
    # The same kind of contract over a two-module package whose bottom imports its top: the
    # check above could pass for nothing if lint-imports never reported a broken layer.
    package = tmp_path / "house"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "top.py").write_text("")
    (package / "bottom.py").write_text("from house import top  # reaching up\n")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_packages =\n    house\n\n"
        "[importlinter:contract:layers]\nname = layers\ntype = layers\n"
        "layers =\n    house.top\n    house.bottom\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0
    assert "house.bottom is not allowed to import house.top" in run.stdout, run.stdout
