"""README's set-up commands are CI's, and its diagram is linked."""
from __future__ import annotations

import re

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()


def shell_lines(text: str) -> list[str]:
    """The lines of a page's bash blocks: continuations joined, comments cut."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            line = re.split(r"\s+#\s", " " + line)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_setup_commands_are_the_ones_ci_runs():
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = [line.split("#")[0].strip() for line in re.findall(r"```bash\n(.*?)```", quick, re.S)[0].splitlines()]
    assert commands == ["make train-local", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^(timed )?make test$", ci, re.M)


def test_a_diagram_of_the_launch_and_the_stop_is_linked_from_the_readme():
    """One picture a reader scans instead of reading: a mermaid flowchart on a page the README links, with the
    launcher, torchrun, the ranks, the markers and each exit code."""
    pages = {ROOT / m for m in re.findall(r"\]\((docs/[^)#]+\.md)", README)}
    diagrams = [d for p in pages for d in re.findall(r"```mermaid\n(.*?)```", p.read_text(), re.S)]
    assert diagrams, "no mermaid diagram on a page the README links"
    assert any(all(w in d for w in ("train.launch", "torchrun", "rank", "STOPPED", '"75', '"2', '"0', '"1'))
               for d in diagrams), diagrams
