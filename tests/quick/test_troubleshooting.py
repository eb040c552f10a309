"""docs/troubleshooting.md quotes, for each symptom, the line the user sees; the code still prints it.

An entry is a `## ` heading. It quotes its lines in a plain fenced block (no language after the backticks).
A quoted line is the code's when:
- one message of train/**/*.py (a string or an f-string, its `{...}` parts read as any text) starts it, every fixed
  part in order, with at least MIN_FIXED characters of fixed text (after a time, `[rank N]`, `INFO`, `error:`);
- and no three words in a row of it (up to the cause that Python or torch adds, `(OSError: ...`) are outside
  the fixed text of train/'s messages: a message inside another (`{advice}`) is checked too.
So a message reworded in the code and not on the page fails here. Values in the quoted line (paths, steps,
hosts) and a `...` in place of a value are free. A block right after a line that says "not the template's"
(Python's or torch's own line) is skipped."""
from __future__ import annotations

import ast
import re

import pytest

from tests.conftest import ROOT

PAGE = ROOT / "docs" / "troubleshooting.md"
MIN_FIXED = 24  # characters of fixed text of the message that starts a line: a few words, not a stray "error: "
MIN_PART = 8  # the least fixed text of a message that counts as covering words of a line
SKIP = "not the template's"
WRAPPER = re.compile(r"(\d\d:\d\d:\d\d )?(\[rank \d+\] )?(INFO |WARNING )?(error: |warning: )?")
CAUSE = re.compile(r"(?: \(|: )[A-Z]\w*(?:Error|Exception)\b")  # an exception's own words, from Python or torch
PROSE = re.compile(r"(?:(?<![\w./-])[A-Za-z][a-z'-]*[,;:]?\s+){2}[A-Za-z][a-z'-]*(?![\w./-])")  # three plain words

# Symptoms the page must cover (issue 67), each by a heading that holds these words.
REQUIRED = ["collective timed out", "A rank was killed", "already complete", "No module named 'torch'",
            "torch too old", "does not match the model", "disk is full"]


def templates(sources: dict[str, str], least: int = MIN_PART) -> list[tuple[str, re.Pattern, int]]:
    """(where, regex, fixed characters) of every string and f-string in `sources` (path -> text) with at least
    `least` characters of fixed text. An f-string's `{...}` parts, and a plain string's `{name}` (str.format's),
    match any text; each fixed part is a group of the regex. A string inside an f-string is read as part of it."""
    found = []
    for path, text in sources.items():
        tree = ast.parse(text)
        inner = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in ast.walk(node)
                 if v is not node}
        for node in ast.walk(tree):
            if id(node) in inner:
                continue
            if isinstance(node, ast.JoinedStr):
                parts = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # str.format's {name} too
                pieces = re.split(r"(\{\w*(?:[.:!][^{}]*)?\})", node.value)
                parts = [None if i % 2 else piece for i, piece in enumerate(pieces)]
            else:
                continue
            parts = [part for part in parts if part != ""]
            fixed = sum(len(part) for part in parts if part)
            if fixed >= least:
                # A message that starts with a value: that value is no sentence of another message (no ":", "(").
                regex = "".join(f"({re.escape(part)})" if part is not None else "[^:(]*?" if i == 0 else ".*?"
                                for i, part in enumerate(parts))
                found.append((f"{path}:{node.lineno}", re.compile(regex, re.S), fixed))
    return found


def source() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "train").rglob("*.py"))}


def quoted(page: str) -> list[tuple[str, str, bool]]:
    """(heading, line, checked) for each line of each plain fenced block of the page."""
    out, heading, before = [], "", ""
    blocks = re.split(r"^```(\w*)\n(.*?)^```\n", page, flags=re.M | re.S)
    # re.split with two groups: text, language, body, text, language, body, ...
    for i in range(0, len(blocks), 3):
        text = blocks[i]
        heading = (re.findall(r"^## (.+)$", text, re.M) or [heading])[-1]
        before = [line for line in text.splitlines() if line.strip()][-1:] or [""]
        if i + 2 < len(blocks) and blocks[i + 1] == "":
            for line in blocks[i + 2].splitlines():
                if line.strip():
                    out.append((heading, line.strip(), SKIP not in before[0]))
    return out


def best(line: str, found: list[tuple[str, re.Pattern, int]]) -> tuple[int, str]:
    """The message of the code that prints `line`, as (its fixed characters, where it is); (0, "") for none. The
    message starts the line, after what every line of its kind starts with (a time, `[rank N]`, `INFO`, `error:`),
    so that a message quoted only in part (its tail lost) is not taken for one that another message holds."""
    lead = WRAPPER.match(line)
    starts = {0} | {lead.end(g) for g in range(1, 5) if lead.group(g)}
    return max(((fixed, where) for where, regex, fixed in found
                if fixed >= MIN_FIXED and any(regex.match(line, pos) for pos in starts)), default=(0, ""))


def uncovered(line: str, found: list[tuple[str, re.Pattern, int]]) -> list[str]:
    """Runs of three words or more of `line`, before the cause Python or torch adds, that no message's fixed
    text covers."""
    covered = [False] * len(line)
    for _, regex, _ in found:
        for m in regex.finditer(line):
            for g in range(1, (m.lastindex or 0) + 1):
                covered[m.start(g):m.end(g)] = [True] * (m.end(g) - m.start(g))
    cause = CAUSE.search(line)
    text = "".join("|" if covered[i] else ch for i, ch in enumerate(line[:cause.start() if cause else len(line)]))
    return PROSE.findall(text)


PAGE_TEXT = PAGE.read_text()
LINES = quoted(PAGE_TEXT)
TEMPLATES = templates(source())


@pytest.mark.parametrize("heading,line", [(h, x) for h, x, checked in LINES if checked],
                         ids=[f"{h[:40]}:{x[:30]}" for h, x, checked in LINES if checked])
def test_each_quoted_line_is_still_printed_by_the_code(heading, line):
    fixed, where = best(line, TEMPLATES)
    assert fixed >= MIN_FIXED, (f"docs/troubleshooting.md, '{heading}': no message of train/ prints\n  {line}\n"
                                "reword the page with the code (or mark a line that is not the template's)")
    assert not (words := uncovered(line, TEMPLATES)), (
        f"docs/troubleshooting.md, '{heading}': {words} of\n  {line}\nare in no message of train/ "
        f"(the line's own is {where}): reword the page with the code")


def test_the_page_covers_the_symptoms_users_hit_most():
    headings = re.findall(r"^## (.+)$", PAGE_TEXT, re.M)
    for words in REQUIRED:
        entry = [h for h in headings if words in h]
        assert entry, f"no entry for {words!r} in {headings}"
        assert any(h == entry[0] for h, _, _ in LINES), f"'{entry[0]}' quotes no line in a plain block"
    assert "(fault-tolerance.md#common-failures)" in PAGE_TEXT


def test_a_message_reworded_in_the_code_alone_fails():
    """The check itself, on train/ reworded in memory: the already-complete line's message, then the full disk's
    advice (a message inside another)."""
    line = next(x for h, x, _ in LINES if "already complete" in h and "already complete" in x)
    assert best(line, TEMPLATES)[0] >= MIN_FIXED
    reworded = {p: t.replace("is already complete at step", "has already finished at step")
                for p, t in source().items()}
    assert best(line, templates(reworded))[0] < MIN_FIXED
    # a message inside another: the full disk's advice
    line = next(x for h, x, _ in LINES if "disk is full" in h)
    assert not uncovered(line, TEMPLATES)
    reworded = {p: t.replace("make room (the disk", "free some space (the disk") for p, t in source().items()}
    assert uncovered(line, templates(reworded))  # the page's "the disk or a quota of", no longer the code's
