"""The project's documents stay inside the repository: no link or path points outside it."""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs_blocks import blocks

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    p
    for p in ROOT.rglob("*.md")
    if not {".venv", "node_modules", ".git", ".pytest_cache"} & set(p.relative_to(ROOT).parts)
]
LINK = re.compile(r"\]\(([^)#\s]+)")


def test_documents_were_found() -> None:
    assert ROOT / "README.md" in DOCS
    assert ROOT / "docs" / "api.md" in DOCS


def test_no_document_points_outside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        assert "../shared" not in text, doc
        assert "DESIGN.md" not in text, doc
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # a URL, not a file
                continue
            resolved = (doc.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{doc}: {target} is outside the repository"


# A secret on a command line: the token expanded into curl's arguments (`Bearer $(cat FILE)`,
# `Bearer $TOKEN`, `Bearer "${TOKEN}"`) or given to --oauth2-bearer. Every local user reads a
# process's arguments (/proc/PID/cmdline); the documented ways are `curl -H @FILE` and the CLI.
SECRET_IN_ARGV = re.compile(r"""Bearer\s+["']?\$|--oauth2-bearer""")
DEPLOY_TEXT = [
    p
    for p in (ROOT / "deploy").rglob("*")
    if p.is_file()
    and (p.suffix in {".yml", ".yaml", ".sh", ".py"} or p.name.startswith("Dockerfile"))
]


def secrets_in_argv(name: str, text: str, markdown: bool) -> list[str]:
    """``name:line`` of each line that puts a token on a command line: in a Markdown file, the
    lines of its fenced blocks (prose may name the mistake); elsewhere, every line."""
    if markdown:
        lines = [
            (b.line + i + 1, line)
            for b in blocks(name, text)
            for i, line in enumerate(b.body.splitlines())
        ]
    else:
        lines = list(enumerate(text.splitlines(), start=1))
    return [f"{name}:{n}: {line.strip()}" for n, line in lines if SECRET_IN_ARGV.search(line)]


def test_no_document_puts_a_token_on_a_command_line() -> None:
    found = []
    for doc in DOCS:
        found += secrets_in_argv(str(doc.relative_to(ROOT)), doc.read_text(encoding="utf-8"), True)
    for path in DEPLOY_TEXT:
        text = path.read_text(encoding="utf-8")
        found += secrets_in_argv(str(path.relative_to(ROOT)), text, False)
    assert not found, "tokens in a command's arguments (use curl -H @FILE or the CLI): " + str(
        found
    )


def test_the_argv_rule_sees_each_form_and_only_in_commands() -> None:
    page = (
        'Never `curl -H "Authorization: Bearer $(cat FILE)"` in prose.\n\n'
        '```\ncurl -H "Authorization: Bearer $(cat t)" URL\n'
        "A=1 curl -H 'Authorization: Bearer $T' URL\n"
        'curl -H "Authorization: Bearer ${T}" URL\ncurl --oauth2-bearer "$T" URL\n'
        "curl -H @deploy/secrets/admin.header URL\n```\n"
    )
    found = secrets_in_argv("page.md", page, True)
    assert [f.split(":")[1] for f in found] == ["4", "5", "6", "7"]
