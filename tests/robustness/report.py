"""Run the fault-injection matrix and print its counts table.

Usage::

    .venv/bin/python -m tests.robustness.report            # every case (a few minutes)
    .venv/bin/python -m tests.robustness.report --fast     # the fast suite's subset
    .venv/bin/python -m tests.robustness.report -k glmm -v # cases whose id contains "glmm", each outcome

The table counts the inputs tried and their outcomes (:mod:`tests.robustness.classify`);
the bad outcomes are listed under it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

__all__ = ["counts_table", "main"]


def counts_table(outcomes) -> str:
    """The counts of ``outcomes`` (:class:`~tests.robustness.classify.Outcome`) as a table."""
    from tests.robustness.classify import BAD, GOOD

    counts = Counter(o.kind for o in outcomes)
    warned = sum(o.kind == "fit" and o.warned for o in outcomes)
    rows = [("inputs tried", len(outcomes))]
    rows += [(kind, counts.get(kind, 0)) for kind in GOOD]
    rows.insert(3, ("  of which with a warning", warned))
    rows += [(kind, counts.get(kind, 0)) for kind in BAD]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v:>5}" for k, v in rows]
    lines.insert(len(GOOD) + 2, "-" * (width + 7))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="only the fast suite's subset")
    parser.add_argument("-k", default="", help="only cases whose id contains this")
    parser.add_argument("-v", action="store_true", help="print every outcome")
    args = parser.parse_args(argv)

    import pytensor

    pytensor.config.mode = "FAST_COMPILE"  # as the test suite (tests/conftest.py)
    from tests.robustness.cases import all_cases, fast_cases
    from tests.robustness.classify import run

    cases = fast_cases() if args.fast else all_cases()
    cases = [c for c in cases if args.k in c.id]
    outcomes = []
    t0 = time.perf_counter()
    for case in cases:
        outcome = run(case)
        outcomes.append(outcome)
        if args.v:
            print(outcome, flush=True)
    print(counts_table(outcomes))
    bad = [o for o in outcomes if o.bad]
    if bad:
        print("\nbad outcomes:")
        for o in bad:
            print(f"  {o}")
    print(f"\n{len(outcomes)} inputs in {time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
