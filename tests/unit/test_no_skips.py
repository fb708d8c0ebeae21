"""ECHO_SWARM_NO_SKIPS (set by `make test`) fails every skip, wherever it is raised: at run time (a test's
``pytest.skip``, a ``skipif`` mark) and at collection time (a module-level ``pytest.skip(allow_module_level=True)``
or ``pytest.importorskip``), which no test report carries — so a package CI lacks cannot pass unnoticed.

pytest runs in a subprocess on a temporary folder of tiny test files, with tests/conftest.py as a plugin and on two
xdist workers as `make test` runs it; the same folder without the variable is the control (skips pass there)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.conftest import NO_SKIPS_ENV

REPO = Path(__file__).resolve().parents[2]

FILES = {
    "test_module_skip.py": "import pytest\npytest.skip('no frobnicator on this machine', allow_module_level=True)\n\n"
                           "def test_never_collected():\n    pass\n",
    "test_importorskip.py": "import pytest\npytest.importorskip('echo_swarm_no_such_package')\n\n"
                            "def test_never_collected():\n    pass\n",
    "test_skipif.py": "import pytest\n\n@pytest.mark.skipif(True, reason='a skipif mark')\n"
                      "def test_marked():\n    pass\n",
    "test_fine.py": "def test_runs():\n    pass\n",
}
REASONS = {"test_module_skip.py": "no frobnicator on this machine",
           "test_importorskip.py": "could not import 'echo_swarm_no_such_package'",
           "test_skipif.py": "a skipif mark"}


def _pytest(folder: Path, no_skips: bool, *args: str) -> tuple[int, dict[str, tuple[str, str]], str]:
    """Exit code, {file: (outcome, message)} from the JUnit report (outcome: passed, or the report's failure, error
    or skipped element), and the output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", NO_SKIPS_ENV))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if no_skips:
        env[NO_SKIPS_ENV] = "1"
    junit = folder.parent / f"junit-{no_skips}.xml"
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-ra",
                          f"--junitxml={junit}", *args, str(folder)], cwd=folder, env=env, capture_output=True,
                         text=True, timeout=300)
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).iter("testcase"):
        module = (case.get("classname") or case.get("name") or "").split(".")[0]  # a module skipped: no class
        found = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[f"{module}.py"] = (found[0].tag, found[0].get("message") or "") if found else ("passed", "")
    return res.returncode, outcomes, res.stdout + res.stderr


def test_a_skip_at_collection_fails_the_run_like_a_skip_at_run_time(tmp_path: Path) -> None:
    folder = tmp_path / "suite"
    folder.mkdir()
    for name, text in FILES.items():
        (folder / name).write_text(text)

    rc, outcomes, output = _pytest(folder, True, "-n", "2", "--dist", "loadgroup")
    assert rc == 1, output  # tests failed (not 2, interrupted: the rest of the suite ran)
    assert outcomes["test_fine.py"] == ("passed", ""), (outcomes, output)
    for name, reason in REASONS.items():
        outcome, message = outcomes[name]
        assert outcome in ("failure", "error") and f"{NO_SKIPS_ENV} allows no skip" in message and reason in message, (
            name, outcomes[name], output)
    assert "skipped at collection" in outcomes["test_module_skip.py"][1]
    assert "skipped at collection" in outcomes["test_importorskip.py"][1]

    # the control: without the variable the same files pass, the three skips reported as skips
    rc, outcomes, output = _pytest(folder, False)
    assert rc == 0, output
    assert sorted(outcome for outcome, _ in outcomes.values()) == ["passed", "skipped", "skipped", "skipped"], outcomes
