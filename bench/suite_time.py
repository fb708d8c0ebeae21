"""The test suite's own time, per directory, from the JUnit report `make test` writes.

    python bench/suite_time.py [--junit test-artifacts/junit-parallel.xml test-artifacts/junit-serial.xml]
        [--write-docs]

`make test` runs pytest on two workers (pytest-xdist), then the `serial` tests alone, and writes a JUnit report
of each phase to test-artifacts/. This prints, per test
directory, how many tests ran, their summed time and the slowest one, and the run's wall time; with
``--write-docs`` it replaces the table in docs/operations.md §6 (between the ``suite-time`` markers), which is
rerun whenever a directory's time moves by more than 10 %. Summed test time is what a directory costs the two
workers together; the wall time is what CI waits.
"""

from __future__ import annotations

import argparse
import os
import platform
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "operations.md"
BEGIN, END = "<!-- suite-time:begin (bench/suite_time.py --write-docs) -->", "<!-- suite-time:end -->"


@dataclass
class Directory:
    tests: int = 0
    seconds: float = 0.0
    slowest: tuple[float, str] = (0.0, "")
    failed: int = 0
    skipped: int = 0


def read(junits: list[Path]) -> tuple[dict[str, Directory], float]:
    """Per directory (tests/<dir>), and the runs' wall time (the sum of each report's testsuite ``time``)."""
    dirs: dict[str, Directory] = defaultdict(Directory)
    wall = 0.0
    for junit in junits:
        if junit.exists():
            wall += _read_one(junit, dirs)
        else:
            print(f"(no {junit}: that phase did not run)")
    return dict(dirs), wall


def _read_one(junit: Path, dirs: dict[str, Directory]) -> float:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for case in root.iter("testcase"):
        module = case.get("classname", "")  # tests.unit.test_store (pytest's dotted module path)
        parts = module.split(".")
        where = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
        d, t = dirs[where], float(case.get("time", 0.0))
        d.tests += 1
        d.seconds += t
        d.failed += any(c.tag in ("failure", "error") for c in case)
        d.skipped += any(c.tag == "skipped" for c in case)
        if t > d.slowest[0]:
            d.slowest = (t, f"{parts[-1]}::{case.get('name', '')}")
    return sum(float(s.get("time", 0.0)) for s in suites)


def table(dirs: dict[str, Directory], wall: float) -> str:
    rows = ["| directory | tests | summed test time | slowest test |", "|---|---:|---:|---|"]
    for name in sorted(dirs, key=lambda n: -dirs[n].seconds):
        d = dirs[name]
        rows.append(f"| tests/{name} | {d.tests} | {d.seconds / 60:.1f} min | {d.slowest[1]} ({d.slowest[0]:.0f} s) |")
    total = sum(d.tests for d in dirs.values())
    summed = sum(d.seconds for d in dirs.values())
    bad = sum(d.failed for d in dirs.values()) + sum(d.skipped for d in dirs.values())
    rows.append(f"| **all** | **{total}** | **{summed / 60:.1f} min** | wall **{wall / 60:.1f} min** (two workers, then "
                f"the serial tests: {summed / wall if wall else 0:.2f}× parallel); {bad} failed or skipped |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--junit", type=Path, nargs="+", default=[REPO / "test-artifacts" / f"junit-{phase}.xml"
                                                              for phase in ("parallel", "serial")])
    ap.add_argument("--write-docs", action="store_true", help=f"replace the table between the markers in {DOC}")
    args = ap.parse_args()
    dirs, wall = read(args.junit)
    text = table(dirs, wall)
    print(text)
    if args.write_docs:
        doc = DOC.read_text()
        if BEGIN not in doc or END not in doc:
            raise SystemExit(f"{DOC} has no suite-time markers ({BEGIN} … {END}): add them to §6 first")
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        stamp = (f"Measured {date.today().isoformat()} on {os.cpu_count()} cores ({platform.machine()}, Python "
                 f"{platform.python_version()}):")
        DOC.write_text(f"{head}{BEGIN}\n{stamp}\n\n{text}\n{END}{tail}")
        print(f"wrote the table into {DOC}")


if __name__ == "__main__":
    main()
