"""The resume table (RESUME_CASES) names real tests."""
from __future__ import annotations

from tests.conftest import (
    ROOT,
)
from train.checkpoint import resume


def test_the_resume_table_names_real_tests():
    """checkpoint.RESUME_CASES is the one list of what a start does with the checkpoints it finds: every case
    names the tests that show it, and each of those exists (a renamed or deleted test breaks the table)."""
    import ast

    defined: dict[str, set[str]] = {}
    for _, (outcome, tests) in resume.RESUME_CASES.items():
        assert outcome and tests
        for test in tests:
            file, name = test.split("::")
            if file not in defined:
                tree = ast.parse((ROOT / "tests" / file).read_text())
                defined[file] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert name in defined[file], f"RESUME_CASES names {test}, which does not exist"
