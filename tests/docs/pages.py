"""Reading a Markdown page as the tests need it: its fenced code blocks, in order, each with the
prose that introduces it, and its tables, each under its heading."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
HEADING = re.compile(r"^#+ (?P<title>.+)$")


@dataclass(frozen=True)
class Block:
    """A fenced block: ``lang`` is ``sh``, ``python``, ...; ``""`` for shown output."""

    lang: str
    text: str
    line: int  # the opening fence's, from 1
    before: str  # the prose between the previous block and this one

    def where(self, page: Path) -> str:
        return f"{page.relative_to(REPO_ROOT)}:{self.line}"


@dataclass(frozen=True)
class Table:
    heading: str  # the title of the heading above it
    header: list[str]
    rows: list[list[str]]


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``; a block indented under a list item loses that indent."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    prose: list[str] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            prose.append(lines[i])
            i += 1
            continue
        start, indent, body = i, len(fence["indent"]), []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
            i += 1
        assert i < len(lines), f"{page.name}:{start + 1}: a code block that is never closed"
        found.append(Block(fence["lang"], "\n".join(body) + "\n", start + 1, "\n".join(prose)))
        prose = []
        i += 1
    return found


def tables(page: Path) -> list[Table]:
    """The tables of ``page`` outside code blocks, cells stripped (backticks kept)."""
    found: list[Table] = []
    heading, in_code = "", False
    rows: list[list[str]] = []
    for line in [*page.read_text().splitlines(), ""]:
        if FENCE.match(line):
            in_code = not in_code
        if not in_code and line.startswith("|"):
            cells = row(line)
            if not all(set(cell) <= set("-: ") for cell in cells):  # not the |---| line
                rows.append(cells)
            continue
        if rows:
            found.append(Table(heading, rows[0], rows[1:]))
            rows = []
        title = HEADING.match(line)
        if title and not in_code:
            heading = title["title"]
    return found


def row(line: str) -> list[str]:
    """The cells of a table row, split on each "|" that is neither escaped nor inside `code`."""
    cells, cell, in_code, previous = [], "", False, ""
    for char in line.strip().removeprefix("|").removesuffix("|"):
        in_code ^= char == "`"
        if char == "|" and not in_code and previous != "\\":
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
        previous = char
    return [*cells, cell.strip()]


def code(text: str) -> list[str]:
    """The `code` spans of ``text``, without their backticks."""
    return re.findall(r"`([^`]+)`", text)
