"""Write tests/durations.json from a full run's JUnit XML: each test module's seconds (setup, calls and teardown of
its tests), which tests/conftest.py orders the modules by (longest first within the CPU and the vLLM phase), so that
the last module to start on a worker is a short one.

    python -m pytest --junitxml=/tmp/junit.xml && python dev/durations.py /tmp/junit.xml
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def module_seconds(junit: Path) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is "tests.dir.test_module" (or "...test_module.Class"): keep the path up to the test_ module
        cut = next(i for i, part in enumerate(module) if part.startswith("test_")) + 1
        path = "/".join(module[1:cut]) + ".py"
        seconds[path] = seconds.get(path, 0.0) + float(case.get("time", 0.0))
    return dict(sorted((path, round(s, 1)) for path, s in seconds.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--out", type=Path, default=TESTS / "durations.json")
    args = parser.parse_args()
    seconds = module_seconds(args.junit)
    args.out.write_text(json.dumps(seconds, indent=1) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(seconds)} modules, {sum(seconds.values()) / 60:.1f} min of work")


if __name__ == "__main__":
    main()
