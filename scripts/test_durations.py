"""Where a test run's time went, from its JUnit XML (scripts/test.sh writes one): the
modules by their summed test time (setup, call and teardown: a module fixture's run is
in its first test's setup), then the slowest tests. Printed last in CI's log, whose tail
is what a reader sees, to say where the suite's minutes go.

    python scripts/test_durations.py results.xml [--modules 25] [--tests 25]
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml")
    parser.add_argument("--modules", type=int, default=25)
    parser.add_argument("--tests", type=int, default=25)
    args = parser.parse_args()
    cases = [(case.get("classname", ""), case.get("name", ""), float(case.get("time", 0)))
             for case in ET.parse(args.xml).getroot().iter("testcase")]
    by_module: dict[str, list[float]] = defaultdict(list)
    for classname, _, seconds in cases:
        by_module[classname.replace(".", "/") + ".py"].append(seconds)
    total = sum(seconds for _, _, seconds in cases)
    print(f"test time by module ({len(cases)} tests, {total:,.0f} s of worker time):")
    for module, times in sorted(by_module.items(), key=lambda item: -sum(item[1]))[:args.modules]:
        print(f"  {sum(times):8.1f} s  {len(times):4d} tests  {module}")
    print("slowest tests:")
    for classname, name, seconds in sorted(cases, key=lambda case: -case[2])[:args.tests]:
        print(f"  {seconds:8.1f} s  {classname.replace('.', '/')}.py::{name}")


if __name__ == "__main__":
    main()
