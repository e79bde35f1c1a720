"""The layers of docs/architecture.md#the-layers hold: `lint-imports` (import-linter, the
contracts in .importlinter) finds no module importing a layer above its own and no plumbing
module importing an app, and every shipped module is in exactly one layer."""

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
# Packages whose sub-packages sit in different layers: their own __init__ is wiring only.
SPLIT_PACKAGES = frozenset({"switchboard", "channels_push"})


def lint_imports(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", *args], cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)},
                          capture_output=True, text=True, timeout=300)


def read_contracts(path: Path) -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(path)
    return config


def layer_modules(config: configparser.ConfigParser) -> list[str]:
    names = []
    for line in config["importlinter:contract:layers"]["layers"].split("\n"):
        names += [name.strip().strip("()") for name in line.replace("|", ":").split(":")
                  if name.strip()]
    return names


def shipped_modules(root: Path, packages) -> list[str]:
    modules = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "tests" in parts or "migrations" in parts or parts[-1] == "conftest":
                continue
            modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def layers_holding(module: str, layers: list[str]) -> list[str]:
    return [layer for layer in layers if module == layer or module.startswith(layer + ".")]


def misplaced_modules(root: Path, config: configparser.ConfigParser,
                      split_packages=SPLIT_PACKAGES) -> dict[str, list[str]]:
    """Every shipped module in no layer or in more than one, with the layers holding it."""
    layers = layer_modules(config)
    packages = config["importlinter"]["root_packages"].split()
    found = {}
    for module in shipped_modules(root, packages):
        holding = layers_holding(module, layers)
        if len(holding) != 1 and module not in split_packages:
            found[module] = holding
    return found


def unlayered_apps(root: Path, config: configparser.ConfigParser, installed_apps) -> list[str]:
    """Every installed app of this repository (a top-level folder of ``root``) that is not one
    of the root packages or has no module in any layer: the module scan above never reads it."""
    layers = layer_modules(config)
    packages = config["importlinter"]["root_packages"].split()
    found = []
    for app in installed_apps:
        package = app.split(".")[0]
        if not (root / package).is_dir():
            continue
        layered = any(layer == package or layer.startswith(package + ".") for layer in layers)
        if package not in packages or not layered:
            found.append(package)
    return found


def test_no_module_imports_a_layer_above_its_own_and_the_plumbing_imports_no_app():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 2 kept, 0 broken." in run.stdout, run.stdout


def test_every_shipped_module_is_in_exactly_one_layer():
    assert misplaced_modules(ROOT, read_contracts(ROOT / ".importlinter")) == {}


def test_every_installed_app_of_the_repository_is_layered(settings):
    config = read_contracts(ROOT / ".importlinter")
    assert unlayered_apps(ROOT, config, settings.INSTALLED_APPS) == []


def test_an_installed_app_outside_the_layers_is_found(tmp_path):
    for name in ("house/__init__.py", "house/top.py", "annex/__init__.py", "annex/views.py",
                 "loft/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_packages =\n    house\n    loft\n\n"
        "[importlinter:contract:layers]\nname = layers\ntype = layers\n"
        "layers =\n    house.top\n")
    config = read_contracts(tmp_path / ".importlinter")
    # The module scan reads only the root packages, so it misses both.
    assert misplaced_modules(tmp_path, config, split_packages={"house", "loft"}) == {}
    installed = ["django.contrib.admin", "house", "annex.apps.AnnexConfig", "loft"]
    assert unlayered_apps(tmp_path, config, installed) == ["annex", "loft"]


def test_a_module_in_no_layer_or_in_two_is_found(tmp_path):
    for name in ("house/__init__.py", "house/top.py", "house/bottom/__init__.py",
                 "house/bottom/deep.py", "house/stray.py", "house/tests/test_top.py",
                 "house/migrations/0001_initial.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_packages =\n    house\n\n"
        "[importlinter:contract:layers]\nname = layers\ntype = layers\n"
        "layers =\n    house.top | house.bottom\n    house.bottom.deep\n")
    found = misplaced_modules(tmp_path, read_contracts(tmp_path / ".importlinter"),
                              split_packages={"house"})
    assert found == {"house.stray": [], "house.bottom.deep": ["house.bottom", "house.bottom.deep"]}


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


def test_the_plumbing_importing_an_app_is_refused(tmp_path):
    # The repository's own contracts over a copy of its code in which the rate limiter reaches
    # up into todos.
    packages = read_contracts(ROOT / ".importlinter")["importlinter"]["root_packages"].split()
    for package in packages:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    ratelimit = tmp_path / "switchboard" / "ratelimit.py"
    ratelimit.write_text("from todos import transitions  # reaching up\n" + ratelimit.read_text())
    run = lint_imports(tmp_path)
    assert run.returncode != 0
    assert "Contracts: 0 kept, 2 broken." in run.stdout, run.stdout
    assert "switchboard.ratelimit is not allowed to import todos" in run.stdout, run.stdout
