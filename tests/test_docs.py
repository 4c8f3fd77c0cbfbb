"""The docs stand alone and stay true: no engine, no network.

- Every flag a service binary's `--help` lists is in that binary's table under
  "Flags per binary" in docs/services.md, and the table lists no flag the binary lacks.
- Every option of every `areal` command's `--help` is in that command's section of
  docs/cli.md.
- No tracked file cites a path outside the repository: a sibling checkout's `shared`
  folder, a machine path (under `work`, `root` or `home` at the file system's root), or a
  Markdown file the repository does not have.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICES_MD = ROOT / "docs/services.md"
BINARIES = (
    "areal-gateway",
    "areal-router",
    "areal-proxy",
    "areal-agent-proxy",
    "areal-agent-worker",
)

_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def _binary(name: str) -> Path:
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable}")
    return path


def help_flags(name: str) -> set[str]:
    out = subprocess.run(
        [str(_binary(name)), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    # Only the option lines, not flags mentioned inside a help text.
    flags: set[str] = set()
    for line in out.splitlines():
        stripped = line.strip()
        if stripped.startswith("--"):
            head = re.split(r"\s{2,}", stripped, maxsplit=1)[0]
            flags.update(_FLAG.findall(head))
    flags.discard("--help")
    return flags


def documented_flags() -> dict[str, set[str]]:
    """Binary -> flags named in the first column of its table in docs/services.md."""
    text = SERVICES_MD.read_text()
    start = text.index("\n## Flags per binary")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    tables: dict[str, set[str]] = {}
    current = None
    for line in section.splitlines():
        if m := re.match(r"^### `([a-z-]+)`", line):
            current = tables.setdefault(m.group(1), set())
        elif current is not None and line.startswith("|"):
            first = line.strip("|").split("|", 1)[0]
            current.update(_FLAG.findall(first))
    return tables


@pytest.mark.parametrize("binary", BINARIES)
def test_every_flag_is_in_services_md(binary: str) -> None:
    tables = documented_flags()
    assert binary in tables, f"docs/services.md has no '### `{binary}`' table"
    actual = help_flags(binary)
    missing = sorted(actual - tables[binary])
    stale = sorted(tables[binary] - actual)
    assert not missing, f"{binary} flags missing from docs/services.md: {missing}"
    assert not stale, f"docs/services.md lists flags {binary} does not have: {stale}"


# --- docs/cli.md --------------------------------------------------------------------

CLI_MD = ROOT / "docs/cli.md"
CLI_COMMANDS = [
    (),
    ("train", "run"),
    ("inf",),
    *[
        ("inf", c)
        for c in (
            "run",
            "register",
            "deregister",
            "models",
            "trace",
            "ps",
            "status",
            "logs",
            "stop",
        )
    ],
    ("agent",),
    *[("agent", c) for c in ("run", "ps", "status", "logs", "stop")],
]
_CLI_OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")


def cli_help_flags(words: tuple[str, ...]) -> set[str]:
    out = subprocess.run(
        [str(_binary("areal")), *words, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "200", "TYPER_USE_RICH": "0"},
    ).stdout
    flags: set[str] = set()
    in_options = False
    for line in out.splitlines():
        if line.startswith("Options:"):
            in_options = True
        elif line and not line.startswith(" "):
            in_options = False
        elif in_options and line.strip().startswith("-"):
            head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            flags.update(_CLI_OPTION.findall(head))
    flags.discard("--help")
    return flags


def cli_section(words: tuple[str, ...]) -> str:
    """The text of the docs/cli.md section about `areal <words>` (the whole page for `areal`)."""
    text = CLI_MD.read_text()
    if not words:
        return text
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.MULTILINE)
    name = "`areal " + " ".join(words) + "`"
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in heading or (
            len(words) == 2 and f"`areal {words[0]} " in heading and f"`{words[1]}`" in heading
        ):
            return body
    raise AssertionError(f"docs/cli.md has no section for {name}")


@pytest.mark.parametrize("words", CLI_COMMANDS, ids=lambda w: " ".join(("areal", *w)))
def test_every_cli_flag_is_in_cli_md(words: tuple[str, ...]) -> None:
    section = set(_CLI_OPTION.findall(cli_section(words)))
    missing = sorted(cli_help_flags(words) - section)
    assert not missing, f"areal {' '.join(words)}: flags missing from docs/cli.md: {missing}"


# --- citations --------------------------------------------------------------------

# Files whose content is data, not prose a reader follows.
_SKIP = re.compile(r"(^uv\.lock$|^models/|_pb2(_grpc)?\.pyi?$|\.(json|safetensors|sqlite)$)")
_OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.~$}-])/(?:work|root|home)/")
_MD = re.compile(r"(?<![\w/.-])((?:\.{1,2}/)?[\w][\w./-]*\.md)\b")
_URL = re.compile(r"\w+://\S+")


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [p for p in out.decode().split("\0") if p and not _SKIP.search(p)]


def _text(rel: str) -> str | None:
    path = ROOT / rel
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None  # deleted in the working tree, or a submodule
    if b"\0" in data[:4096]:
        return None
    return data.decode("utf-8", errors="replace")


def test_no_tracked_file_cites_a_path_outside_the_repository() -> None:
    problems: list[str] = []
    for rel in _tracked_files():
        text = _text(rel)
        if text is None:
            continue
        here = (ROOT / rel).parent
        for n, line in enumerate(text.splitlines(), 1):
            if m := _OUTSIDE.search(line):
                problems.append(f"{rel}:{n}: path outside the repository: {m.group(0)!r}")
            for name in _MD.findall(_URL.sub("", line)):
                if not ((here / name).exists() or (ROOT / name).exists()):
                    problems.append(f"{rel}:{n}: cites {name}, which is not in the repository")
    assert not problems, "\n".join(problems)


def _table_params(section: str) -> set[str]:
    """The backticked names in the first column of the tables under `## {section}`."""
    text = (ROOT / "docs/openai-api.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in body.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([a-z_]+)`", line.split(" | ")[0]))
    return names


def test_openai_api_doc_lists_exactly_what_the_proxy_honours():
    from areal_runtime.openai import fields as oa

    assert _table_params("Chat completions") == oa.CHAT_FIELDS
    assert _table_params("Completions") == oa.COMPLETION_FIELDS
    accepted = _table_params("Accepted, changing nothing")
    assert accepted == oa.INFORMATIONAL | set(oa._ONLY_DEFAULT)


# --- package READMEs: the module table is the package's files ----------------------------

# Generated code only, its table is scripts/gen_proto.py's output (checked for drift there).
_NO_MODULE_TABLE = {"areal-proto"}
_TICKED = re.compile(r"`([^`]+)`")


def _packages() -> list[Path]:
    return sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


def _module_table(readme: Path) -> list[str]:
    """The first-column cells of the README's table headed `| Module |`."""
    cells: list[str] = []
    in_table = False
    for line in readme.read_text().splitlines():
        if re.match(r"^\| Module( |$)", line):
            in_table = True
        elif in_table and line.startswith("|"):
            if not line.startswith("| ---"):
                cells.append(line.strip("|").split(" | ", 1)[0])
        elif in_table:
            break
    return cells


def _named_paths(cells: list[str], src: Path) -> set[str]:
    """Paths (relative to the import package `src`) a table's first column names: `x.py`,
    `dir/x.py`, `dir/` (all of it), `pkg.module`; a bare `y.py` after `dir/x.py` in one cell
    is `dir/y.py` when that file exists."""
    named: set[str] = set()
    for cell in cells:
        folder = ""
        for token in _TICKED.findall(cell):
            if token.startswith(f"{src.name}."):
                named.add(token.removeprefix(f"{src.name}.").replace(".", "/") + ".py")
                continue
            if "/" in token:
                folder = token.rsplit("/", 1)[0] + "/" if not token.endswith("/") else token
                named.add(token)
            else:
                named.add(folder + token if (src / folder / token).exists() else token)
    return named


@pytest.mark.parametrize(
    "pkg", [p for p in _packages() if p.name not in _NO_MODULE_TABLE], ids=lambda p: p.name
)
def test_readme_module_table_matches_the_files(pkg: Path) -> None:
    [src] = [d for d in (pkg / "src").iterdir() if d.is_dir() and not d.name.endswith("-info")]
    cells = _module_table(pkg / "README.md")
    assert cells, f"{pkg.name}/README.md has no '| Module | ... |' table"
    named = _named_paths(cells, src)
    files = {
        p.relative_to(src).as_posix()
        for p in src.rglob("*")
        if p.is_file()
        and p.suffix in (".py", ".c")
        and p.name != "__init__.py"
        and "__pycache__" not in p.parts
        and "_pb2" not in p.name
    }
    folders = {n for n in named if n.endswith("/")}
    missing = sorted(f for f in files if f not in named and not f.startswith(tuple(folders)))
    stale = sorted(n for n in named if not (src / n).exists())
    assert not missing, f"{pkg.name}/README.md's module table leaves out {missing}"
    assert not stale, f"{pkg.name}/README.md's module table names what is not there: {stale}"


# --- docs/architecture.md: the package table's "depends on" is each pyproject's ---------

_ARCH = ROOT / "docs/architecture.md"


def _internal_deps(pkg: Path) -> set[str]:
    import tomllib

    names = {p.name for p in _packages()}
    project = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
    deps = set()
    for req in project.get("dependencies", []):
        name = re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0]
        if name in names:
            deps.add(name)
    return deps


def test_architecture_package_table_matches_the_pyprojects() -> None:
    rows: dict[str, set[str]] = {}
    for line in _ARCH.read_text().splitlines():
        if m := re.match(r"^\| `packages/(areal-[a-z-]+)` \|", line):
            last = line.strip().strip("|").split(" | ")[-1]
            rows[m.group(1)] = {f"areal-{d}" for d in re.findall(r"[a-z-]+", last)}
    assert set(rows) == {p.name for p in _packages()}, "one row per package"
    for pkg in _packages():
        assert rows[pkg.name] == _internal_deps(pkg), (
            f"docs/architecture.md says {pkg.name} depends on {sorted(rows[pkg.name])}; "
            f"its pyproject.toml says {sorted(_internal_deps(pkg))}"
        )


# --- docs/request-path.md: every function it names exists --------------------------------

_NAMED = re.compile(r"`(areal_[a-z_]+(?:\.[a-z_]+)*):([A-Za-z_][\w.]*)`")


def test_request_path_names_real_functions() -> None:
    import importlib

    text = (ROOT / "docs/request-path.md").read_text()
    named = _NAMED.findall(text)
    assert len(named) >= 30, "the walk names each function it passes through"
    problems = []
    for module, qualname in sorted(set(named)):
        try:
            obj: object = importlib.import_module(module)
        except ImportError as e:
            problems.append(f"{module}: cannot import ({e})")
            continue
        for part in qualname.split("."):
            if not hasattr(obj, part):
                problems.append(f"{module}:{qualname}: no {part!r}")
                break
            obj = getattr(obj, part)
        else:
            if not callable(obj):
                problems.append(f"{module}:{qualname} is not a function")
    assert not problems, "docs/request-path.md names what the code does not have:\n" + "\n".join(
        problems
    )


# --- no references to numbered tracker issues ---------------------------------------------

# The word issue followed by a number (with or without its hash sign), or a hash sign and a
# number on their own: a reader of the repository cannot open the tracker, so the text says
# what the thing is instead.
_TRACKER = re.compile(r"\b[Ii]ssues? #?\d+\b|(?<![\w&/#'\"=:])#\d+\b")


def test_no_tracked_file_refers_to_a_numbered_tracker_issue() -> None:
    problems = []
    for rel in _tracked_files():
        text = _text(rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if m := _TRACKER.search(line):
                problems.append(f"{rel}:{n}: {m.group(0)!r}")
    assert not problems, "say what the thing is instead of naming a tracker issue:\n" + "\n".join(
        problems
    )
