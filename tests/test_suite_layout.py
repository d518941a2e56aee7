"""Where a maintainer looks for a module's tests: tests/README.md's table "Every module's fast tests" names, for each
module of the package, the test files in which the fast tier checks it. This holds the table to the package and
the suite: every module has a row, every row a module, and every file a row names exists and has a fast test."""

import re
import subprocess
import sys

from conftest import ROOT

TESTS = ROOT / "tests"
ROW = re.compile(r"^\| `(rnnlab/[^`]+\.py)` \| (.+) \|$")


def table() -> dict[str, list[str]]:
    """module path -> test files (relative to tests/), from tests/README.md."""
    text = (TESTS / "README.md").read_text()
    section = text.split("## Every module's fast tests", 1)[1]
    rows = {}
    for line in section.splitlines():
        found = ROW.match(line.strip())
        if found:
            assert found.group(1) not in rows, f"two rows for {found.group(1)}"
            rows[found.group(1)] = re.findall(r"`([^`]+\.py)`", found.group(2))
    return rows


def fast_test_files(session) -> set[str]:
    """The test files (relative to tests/) with at least one test in the fast tier: this session's own collection
    where it collected the whole fast tier, else `pytest --collect-only` of it in a fresh process."""
    files = {item.nodeid.split("::")[0] for item in session.items}
    on_disk = {str(p.relative_to(ROOT)) for p in TESTS.rglob("test_*.py")}
    if session.config.getoption("markexpr") or session.config.getoption("--full") or len(files) < len(on_disk) // 2:
        listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p",
                                 "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
        files = {line.split("::")[0] for line in listed.stdout.splitlines() if "::" in line}
    return {f.removeprefix("tests/") for f in files}


def test_every_package_module_has_a_row_naming_files_with_fast_tests(request):
    rows = table()
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "rnnlab").rglob("*.py") if p.name != "__init__.py"}
    assert sorted(modules - set(rows)) == [], "modules without a row in tests/README.md's table"
    assert sorted(set(rows) - modules) == [], "rows of tests/README.md's table for no module"
    named = {f for files in rows.values() for f in files}
    assert all(rows.values()), [m for m, files in rows.items() if not files]
    assert sorted(f for f in named if not (TESTS / f).is_file()) == [], "files named in the table that do not exist"
    fast = fast_test_files(request.session)
    assert sorted(named - fast) == [], "files named in the table without a fast test"
