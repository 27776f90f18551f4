"""Comparing the output a page shows with what its commands printed, line by line, once what
changes from run to run is written the same way on both sides."""

from __future__ import annotations

import difflib
import re

from tests.docs.pages import Block

JOB_ID = re.compile(r"\b[0-9a-f]{32}\b")
VARYING = (
    (re.compile(r"\d+\.\d+(?=/?s\b)"), "<n>"),  # run times, retry delays, rates: 0.000s, 1.1s, 2.1/s
    (re.compile(r"\bprocess \d+"), "process <pid>"),
)


class Normaliser:
    """Job ids become ``<id 1>``, ``<id 2>``, ... in the order they first appear, so a line still
    says which job it is about; durations and rates become ``<n>``, process ids ``<pid>``."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}

    def __call__(self, text: str) -> list[str]:
        text = JOB_ID.sub(lambda found: self.ids.setdefault(found[0], f"<id {len(self.ids) + 1}>"), text)
        for pattern, replacement in VARYING:
            text = pattern.sub(replacement, text)
        lines = [line.rstrip() for line in text.splitlines()]
        while lines and not lines[-1]:
            lines.pop()
        return lines


class OutputCheck:
    """Checks a page's output blocks in page order and collects every difference. Job ids are
    numbered over the whole page on each side, so an id the page shows twice must be one job
    printed twice."""

    def __init__(self) -> None:
        self.shown, self.printed = Normaliser(), Normaliser()
        self.drifts: list[str] = []

    def __call__(self, block: Block, where: str, printed: str) -> None:
        shown, real = self.shown(block.text), self.printed(printed)
        if shown != real:
            self.drifts.append("\n".join(difflib.unified_diff(shown, real, f"{where} (shown)", "printed", lineterm="")))

    def assert_none(self) -> None:
        assert not self.drifts, "the output shown is not what the commands print:\n" + "\n".join(self.drifts)
