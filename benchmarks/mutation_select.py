"""Replace `[tool.mutmut] pytest_add_cli_args_test_selection` in a scratch
copy's pyproject.toml (mutation_test.sh with MUTATION_TESTS).

    python mutation_select.py PYPROJECT TEST_FILE...
"""
from __future__ import annotations

import re
import sys

SELECTION = re.compile(r"^pytest_add_cli_args_test_selection = \[.*?^\]", re.M | re.S)


def main(path: str, tests: list[str]) -> None:
    if not tests:
        raise SystemExit("name at least one test file")
    text = open(path, encoding="utf-8").read()
    listed = ", ".join(f'"{t}"' for t in tests)
    new, count = SELECTION.subn(f"pytest_add_cli_args_test_selection = [{listed}]", text)
    if count != 1:
        raise SystemExit(f"{path}: expected one pytest_add_cli_args_test_selection, found {count}")
    open(path, "w", encoding="utf-8").write(new)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
