"""The fault-injection suite's session summary: the counts of its outcomes
(:func:`tests.robustness.report.counts_table`).

Each test records its outcome as a user property, which the test reports carry
to ``pytest-xdist``'s controller. The controller loads this file when
``tests/robustness`` (or a file in it) is on the command line; a distributed run
of all of ``tests`` collects it in the workers only, and prints no summary:
``python -m tests.robustness.report`` prints the table in any case."""

from collections import Counter

from tests.robustness.classify import BAD, GOOD
from tests.robustness.report import counts_table

_OUTCOMES: list = []


class _Recorded:
    """An outcome as the report carries it (its kind, whether the fit warned)."""

    def __init__(self, case, kind, warned):
        self.case, self.kind, self.warned = case, kind, warned
        self.bad = kind in BAD


def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    props = dict(report.user_properties)
    if "fault_outcome" in props:
        _OUTCOMES.append(_Recorded(report.nodeid, props["fault_outcome"], props["fault_warned"]))


def pytest_terminal_summary(terminalreporter):
    if not _OUTCOMES:
        return
    terminalreporter.section("fault injection")
    counts = Counter(o.kind for o in _OUTCOMES)
    unknown = set(counts) - set(GOOD) - set(BAD)
    assert not unknown, unknown
    terminalreporter.write_line(counts_table(_OUTCOMES))
