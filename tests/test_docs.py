"""The front door and the docs stay true to the code they describe.

* README.md is short enough to read in five minutes and keeps the two commands CI and a
  newcomer type (`bash scripts/run`, `bash scripts/test`).
* Every relative link in README.md and docs/ resolves: the file, and for ``#anchor`` the heading
  (GitHub's anchor rules), so a page can move without leaving dead links behind; so does every
  ``docs/<page>.md#anchor`` the code cites.
* docs/configuration.md lists exactly the environment variables the settings modules read
  (found by parsing them, not by importing them), each with the default the code uses, and
  under "Traces" every ``OTEL_*`` variable the server's and the runner's tracing read.
* docs/commands.md documents every management command of ours with exactly the options its
  argparse parser accepts (what ``--help`` prints), and every choice an option offers.
* docs/operating.md lists every periodic sweep of switchboard/schedule.py at its cadence.
"""

import ast
import os
import re
from pathlib import Path

import pytest
from django.core.management import get_commands, load_command_class

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SETTINGS_FILES = sorted((ROOT / "switchboard").glob("settings*.py"))

# The front door's budget: read in five minutes.
README_MAX_LINES = 200


def markdown_files() -> list[Path]:
    return [README, ROOT / "runner" / "README.md", *sorted(DOCS.rglob("*.md"))]


def without_code(text: str) -> str:
    """Markdown with fenced blocks and inline code blanked: links and headings there are text."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "``", text)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    text = path.read_text()
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$",
                          re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text,
                                 flags=re.MULTILINE | re.DOTALL), flags=re.MULTILINE)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in headings:
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    anchors.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return anchors


def relative_links(path: Path) -> list[str]:
    text = without_code(path.read_text())
    targets = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    targets += re.findall(r"<(?:img|a)\s[^>]*?(?:src|href)=\"([^\"]+)\"", text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_readme_is_a_front_door_not_a_manual():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    text = README.read_text()
    # CI (.ci/run) and scripts/test's own header call these the README's commands.
    assert "\nbash scripts/run" in text and "\nbash scripts/test" in text


def test_the_link_checker_finds_what_it_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `code` title, with: punctuation\n## Twice\n## Twice\n"
                    "[ok](#a-code-title-with-punctuation) [ok](#twice-1) [file](other.md)\n"
                    "`[not a link](nowhere.md)`\n```\n[nor this](nowhere.md)\n```\n"
                    '<img src="pic.png" alt=""> [web](https://example.com/x.md)\n')
    assert anchors_of(page) == {"a-code-title-with-punctuation", "twice", "twice-1"}
    assert relative_links(page) == ["#a-code-title-with-punctuation", "#twice-1", "other.md",
                                    "pic.png"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for link in relative_links(path):
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link}: no file {resolved.relative_to(ROOT)}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
            broken.append(f"{link}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


def cited_docs() -> list[tuple[str, str]]:
    """(file, citation) for every ``docs/<page>.md[#anchor]`` the shipped code mentions: code
    comments cite the docs by anchor, so a renamed heading must not strand them."""
    cited = []
    for folder, subfolders, files in os.walk(ROOT):
        # Not shipped code: the virtualenv, run-time state, tests, dot-folders.
        subfolders[:] = [name for name in subfolders
                         if name not in {"var", "tests", "node_modules"} and not name.startswith(".")]
        for name in sorted(files):
            if name.endswith(".py"):
                path = Path(folder) / name
                for citation in re.findall(r"docs/[\w./-]+\.md(?:#[\w-]+)?", path.read_text()):
                    cited.append((str(path.relative_to(ROOT)), citation))
    return cited


def test_every_docs_citation_in_the_code_resolves():
    broken = []
    for where, citation in cited_docs():
        target, _, anchor = citation.partition("#")
        page = ROOT / target
        if not page.exists() or (anchor and anchor not in anchors_of(page)):
            broken.append(f"{where}: {citation}")
    assert not broken, broken


# -- configuration ---------------------------------------------------------------------------

# How the settings modules read the environment: django-environ's Env (``env.int(...)``,
# ``environ.Env().str(...)``), the module's own ``_typed(NAME, cast, default)`` and os.environ.
ENV_METHODS = {"str", "int", "bool", "float", "list", "tuple", "dict", "json", "url", "db",
               "db_url", "cache", "cache_url", "path", "get_value", "setdefault", "get"}


def _is_env_receiver(node) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "env"
    if isinstance(node, ast.Call):  # environ.Env()
        return isinstance(node.func, ast.Attribute) and node.func.attr == "Env"
    if isinstance(node, ast.Attribute):  # os.environ
        return node.attr == "environ"
    return False


_ARITHMETIC = {ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b,
               ast.Sub: lambda a, b: a - b, ast.Pow: lambda a, b: a ** b}


def _number(node):
    """The value of a literal, or arithmetic of number literals (``1024 * 1024``), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, float, str)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _number(node.left), _number(node.right)
        if isinstance(left, (int, float)) and isinstance(right, (int, float)):
            return _ARITHMETIC[type(node.op)](left, right)
    return None


def environment_reads() -> dict[str, set]:
    """{variable: the defaults the code gives it} for every read in switchboard/settings*.py.
    A read whose name the parse cannot work out fails the test: teach it, don't skip it."""
    reads: dict[str, set] = {}
    for path in SETTINGS_FILES:
        tree = ast.parse(path.read_text())
        tuples = {target.id: [elt.value for elt in node.value.elts]
                  for node in ast.walk(tree) if isinstance(node, ast.Assign)
                  and isinstance(node.value, (ast.Tuple, ast.List))
                  and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                          for e in node.value.elts)
                  for target in node.targets if isinstance(target, ast.Name)}
        loop_names = {}
        for node in ast.walk(tree):
            for loop in ([node] if isinstance(node, ast.For) else getattr(node, "generators", [])):
                if isinstance(loop.target, ast.Name) and isinstance(loop.iter, ast.Name):
                    loop_names[loop.target.id] = tuples.get(loop.iter.id)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            typed = isinstance(func, ast.Name) and func.id == "_typed"
            env_call = (isinstance(func, ast.Attribute) and func.attr in ENV_METHODS
                        and _is_env_receiver(func.value))
            if not (typed or env_call):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names = [first.value]
            elif isinstance(first, ast.Name) and loop_names.get(first.id):
                names = loop_names[first.id]
            else:
                raise AssertionError(f"{path.name}:{node.lineno}: an environment read whose "
                                     "name this test cannot work out")
            default = None
            if typed and len(node.args) >= 3:
                default = _number(node.args[2])
            for keyword in node.keywords:
                if keyword.arg == "default":
                    default = _number(keyword.value)
            if env_call and func.attr == "setdefault" and len(node.args) >= 2:
                default = None  # the test settings' own values, not the product's default
            for name in names:
                reads.setdefault(name, set())
                if default not in (None, ""):
                    reads[name].add(default)
    return reads


def documented_variables() -> dict[str, str]:
    """{variable: its table row} from docs/configuration.md's tables whose first column is
    `variable` (a row may name several variables that share one meaning)."""
    rows, in_table = {}, False
    for line in (DOCS / "configuration.md").read_text().splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if cells[0] == "variable":
                in_table = True
            elif in_table and not set(cells[0]) <= set("-: "):
                for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[0]):
                    rows[name] = line
        else:
            in_table = False
    return rows


def _written(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_the_settings_parse_finds_every_kind_of_read():
    reads = environment_reads()
    assert {"DATABASE_URL", "SWITCHBOARD_VAR_DIR", "SWITCHBOARD_SIGNIN_FAILURE_LIMIT",
            "OIDC_OP_TOKEN_ENDPOINT", "CHANNEL_PREFIX"} <= set(reads)
    assert reads["SWITCHBOARD_MAX_BODY_BYTES"] == {1024 * 1024}


def test_configuration_documents_every_variable_the_settings_read():
    reads, documented = environment_reads(), documented_variables()
    undocumented = sorted(set(reads) - set(documented))
    gone = sorted(set(documented) - set(reads))
    assert not undocumented, f"read by settings, missing from docs/configuration.md: {undocumented}"
    assert not gone, f"in docs/configuration.md, no longer read by settings: {gone}"
    wrong = [f"{name}: default {_written(default)} not in its row"
             for name, defaults in reads.items() for default in defaults
             if f"`{_written(default)}`" not in documented[name]]
    assert not wrong, wrong


def test_configuration_lists_every_otel_variable_the_tracing_code_reads():
    text = (DOCS / "configuration.md").read_text()
    section = text[text.index("\n## Traces\n"):]
    section = section[:section.index("\n## ", 1)]
    listed = set(re.findall(r"`(OTEL_[A-Z_]+)`", section))
    sources = [ROOT / "switchboard" / "tracing.py",
               ROOT / "runner" / "src" / "switchboard_runner" / "traces.py"]
    read = {name for source in sources
            for name in re.findall(r'"(OTEL_[A-Z_]+)', source.read_text())}
    assert read and read <= listed, sorted(read - listed)


# -- commands --------------------------------------------------------------------------------

OUR_APPS = ("endpoints", "todos", "ingest", "channels_push", "accounts")
OUR_COMMANDS = sorted(name for name, app in get_commands().items() if app in OUR_APPS)
# What every Django command accepts; docs/commands.md says so once instead of per command.
DJANGO_OPTIONS = {"--help", "--version", "--verbosity", "--settings", "--pythonpath",
                  "--traceback", "--no-color", "--force-color", "--skip-checks"}
OPTION_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def command_sections() -> dict[str, str]:
    text = (DOCS / "commands.md").read_text()
    parts = re.split(r"^### `([a-z_]+)`\s*$", text, flags=re.MULTILINE)
    return {name: re.split(r"^#{1,3} ", body, flags=re.MULTILINE)[0]
            for name, body in zip(parts[1::2], parts[2::2])}


def test_commands_doc_has_a_section_per_command():
    assert sorted(command_sections()) == OUR_COMMANDS


@pytest.mark.parametrize("name", OUR_COMMANDS)
def test_commands_doc_lists_exactly_the_parsers_options(name):
    parser = load_command_class(get_commands()[name], name).create_parser("manage.py", name)
    section = command_sections().get(name, "")
    options, choices, positionals = set(), set(), []
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if set(longs) & DJANGO_OPTIONS:
            continue
        if action.option_strings:
            options.add(longs[0])
        elif not action.choices:  # a positional with choices is documented by its choices
            positionals.append((action.metavar or action.dest).upper())
        choices.update(str(choice) for choice in action.choices or ())
    written = set(OPTION_RE.findall(section)) - DJANGO_OPTIONS
    assert written == options, (f"{name}: documented {sorted(written - options)} not in the "
                                f"parser; parser's {sorted(options - written)} not documented")
    undocumented = sorted(choice for choice in choices
                          if not re.search(rf"(?<![\w-]){re.escape(choice)}(?![\w-])", section))
    assert not undocumented, f"{name}: choices {undocumented} not documented"
    missing = [p for p in positionals if p not in section]
    assert not missing, f"{name}: positional arguments {missing} not in its synopsis"


# -- the sweeps ------------------------------------------------------------------------------


def _cadence(every) -> str:
    seconds = int(every.total_seconds())
    return f"{seconds // 3600} h" if seconds >= 3600 and seconds % 3600 == 0 else f"{seconds} s"


def test_operating_lists_every_periodic_sweep_at_its_cadence():
    """docs/operating.md's table of sweeps is switchboard/schedule.py's, entry for entry."""
    from switchboard import schedule

    section = (DOCS / "operating.md").read_text().split("### The sweeps", 1)[1].split("\n## ", 1)[0]
    written = dict(re.findall(r"^\| `([a-z-]+)` \| ([^|]+?) \|", section, flags=re.MULTILINE))
    assert written == {entry.name: _cadence(entry.every) for entry in schedule.SWEEPS}
