"""The documentation site: it builds strictly, its generated references match the code, and every
`pimm` command shown in it (and in the README) parses with pimm's own argument parser."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pimm import docs_reference
from pimm.cli import build_parser
from pimm.config import flatten_keys, load_config, parse_overrides

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
TEXTS = [REPO / "README.md", *PAGES]
SHELL_FENCES = ("bash", "console", "sh", "shell")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`(pimm [^`]+)`(?!`)")


def test_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: no broken link, no page missing from the navigation, no warning."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    site = tmp_path / "site"
    assert (site / "reference" / "config.html").is_file()
    # opened from the file system (site/index.html), a link to a folder would open a directory listing
    links = [(page, href) for page in site.rglob("*.html") if page.name != "404.html"  # 404: for servers
             for href in re.findall(r'<a\s[^>]*?href="([^"#?]+)', page.read_text()) if "://" not in href]
    assert len(links) > 100, "the built pages should link to each other"
    assert [(str(p.relative_to(site)), h) for p, h in links if not (p.parent / h).is_file()] == []


def test_generated_references_are_current():
    for path, text in docs_reference.pages().items():
        assert path.is_file(), f"{path} is missing: run `python -m pimm.docs_reference`"
        assert path.read_text() == text, f"{path.relative_to(REPO)} is not current: run `python -m pimm.docs_reference`"


def test_every_config_key_is_in_the_reference():
    page = docs_reference.CONFIG_PAGE.read_text()
    keys = flatten_keys(load_config(docs_reference.BASE_CONFIG))
    assert keys
    missing = [key for key in keys if f"| `{key}` |" not in page]
    assert not missing, f"config keys missing from {docs_reference.CONFIG_PAGE.name}: {missing}"


def test_every_cli_flag_is_in_the_reference():
    page = docs_reference.CLI_PAGE.read_text()
    flags = docs_reference.cli_flags()
    assert "pimm launch" in flags and "pimm submit" in flags
    for command, options in flags.items():
        assert f"## {command}\n" in page, f"{command} has no section in the CLI reference"
        missing = [flag for flag in options if f"`{flag}" not in page]
        assert not missing, f"{command}: flags missing from the CLI reference: {missing}"


def test_every_base_key_has_a_validation_rule():
    rows = docs_reference.config_rows()
    assert all(row["rule"] for row in rows)


def _shell_lines(text: str) -> list[str]:
    """Lines of the shell code blocks, `\\` continuations joined."""
    lines: list[str] = []
    for block in FENCE.finditer(text):
        if block["lang"] not in SHELL_FENCES:
            continue
        body = re.sub(r"\\\n\s*", " ", block["body"])
        lines += [line.strip() for line in body.splitlines()]
    return lines


def pimm_commands() -> list[tuple[str, str, bool]]:
    """(where, command line, complete) of every `pimm ...` command in the shell blocks (complete
    commands) and in inline code of the hand-written pages (often a command's name and one flag)."""
    found = []
    for path in TEXTS:
        text = path.read_text()
        name = str(path.relative_to(REPO))
        for line in _shell_lines(text):
            line = line.removeprefix("$ ")
            if line.startswith("#"):
                continue
            tokens = shlex.split(line, comments=True)
            at = next((i for i, t in enumerate(tokens) if t == "pimm" or t.endswith("bin/pimm")), None)
            if at is not None:
                found.append((name, shlex.join(tokens[at:]), True))
        if path.parent.name == "reference":
            continue  # generated from the parsers themselves
        for span in INLINE.findall(FENCE.sub("", text)):
            if not any(c in span for c in "[]|*<>"):
                found.append((name, span, False))
    return found


def _parse(command: str, complete: bool = True) -> str | None:
    """None when `command` parses with pimm's parser, else argparse's message. `$VAR` stands for a
    number; an incomplete command (inline text) may leave out required arguments."""
    tokens = ["1" if t.startswith("$") else t for t in shlex.split(command)[1:] if t not in ("...", "…")]
    overrides: list[str] = []
    if "--" in tokens:
        cut = tokens.index("--")
        tokens, overrides = tokens[:cut], tokens[cut + 1:]
    if not complete:  # a command's name and some of its flags: each flag must exist
        flags = docs_reference.cli_flags()
        words = [t for t in tokens if not t.startswith("-")]
        command = next((c for n in range(len(words), 0, -1) if (c := " ".join(["pimm", *words[:n]])) in flags), None)
        if command is None:
            return f"no such command: {command!r}"
        unknown = [t for t in tokens if t.startswith("--") and t.split("=")[0] not in flags[command]]
        return f"{command} has no flag {unknown[0]}" if unknown else None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(tokens)
        parse_overrides(overrides)
    except SystemExit as exc:
        return f"exit {exc.code}: {err.getvalue().strip()}"
    except Exception as exc:  # an override pimm refuses
        return f"{type(exc).__name__}: {exc}"
    return None


def test_every_pimm_command_in_the_docs_parses():
    commands = pimm_commands()
    assert len(commands) > 40, "the command extraction found too little; is the fence pattern right?"
    bad = [f"{where}: {cmd}\n    {why}" for where, cmd, complete in commands if (why := _parse(cmd, complete))]
    assert not bad, "commands in the docs that pimm's parser refuses:\n" + "\n".join(bad)


def test_a_wrong_flag_is_caught():
    assert _parse("pimm launch --train.config demo/semseg --no-such-flag")
    assert _parse("pimm launch --train.config demo/semseg --dry-run") is None
    assert _parse("pimm test --no-such-flag", complete=False)
    assert _parse("pimm test", complete=False) is None


DEVLOG = re.compile(r"this round|re-measured|seed page|\bissues?\b|\bsession\b|\bfiled\b", re.I)
TAG = re.compile(r"(?<![.\w])\[[a-z0-9-]+\](?![(\[:])")  # [robust], [evaluate]: not a link, not a YAML list
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: str(p.relative_to(REPO)))
def test_written_for_users(path):
    """No development-log wording (rounds, issue tags, commit hashes) in the pages or the README."""
    text = path.read_text()
    for pattern in (DEVLOG, TAG, COMMIT):
        hits = [m.group(0) for m in pattern.finditer(FENCE.sub("", text))]
        assert not hits, f"{pattern.pattern}: {hits}"


def test_readme_fits_on_two_screens():
    assert len((REPO / "README.md").read_text().splitlines()) <= 150


def test_check_mode_reports_current_pages(capsys):
    assert docs_reference.main(["--check"]) == 0
