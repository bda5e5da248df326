"""A pytest plugin: with CI=true, a skipped test or module fails instead.

On a developer's machine a missing optional extra (torch, transformers) skips the tests that
need it; in CI, where `.ci/run` installs every test extra, such a skip would hide a broken
install or a broken eqllm import. Skips a test declares for its platform (`skipif`) stay skips.
"""

import os

import pytest

STRICT = os.environ.get("CI", "").lower() == "true"


def _fail(report, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"{what} skipped with CI=true: {report.longrepr}. CI installs every test extra "
        '(pip install -e ".[test]"), so nothing may skip there'
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        if item.get_closest_marker("skipif") is None:
            _fail(report, "test")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if STRICT and report.skipped:
        _fail(report, "module")
