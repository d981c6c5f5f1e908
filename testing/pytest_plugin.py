"""The conformance campaign as pytest tests: ``pytest --kvoffload-target=TARGET``.

Installed as a pytest plugin (entry point ``pytest11``), inert unless
``--kvoffload-target`` is given: then each target becomes one test item whose outcome is the
campaign's verdict, so that pytest's own reporting applies (``-v``, ``--junitxml``, exit
status). A disagreement fails the item with the first difference, the shrunk reproducer and
the file the failure was saved to; a target that cannot be built is an error, not a failure.

Targets: ``impl``, ``impl-cuda``, ``fault:NAME`` (run in this process), and vLLM's forms of
``kvoffload verify --target`` (``vllm==X.Y.Z``...), run by ``kvoffload verify`` in the
release's environment, one item per target whose verdict is that command's.

Options: ``--kvoffload-profile`` (fast, ci, nightly), ``--kvoffload-seconds``,
``--kvoffload-seed``, ``--kvoffload-only`` (collect no test files, only the campaigns: for a
vLLM checkout, whose own tests are not wanted here).

Invariant kept: importing this module imports neither torch nor Hypothesis, so that pytest
starts in any environment where kvoffload is installed.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from kvoffload.model.errors import SetupError


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvoffload", "kvoffload conformance campaigns")
    group.addoption(
        "--kvoffload-target",
        action="append",
        default=[],
        metavar="TARGET",
        help="run the conformance campaign on TARGET as a test (repeatable): impl, "
        "impl-cuda, fault:NAME, or a vLLM target of `kvoffload verify --target`",
    )
    group.addoption(
        "--kvoffload-profile",
        choices=["fast", "ci", "nightly"],
        help="the campaign's Hypothesis profile (default: ci with CI set, else fast)",
    )
    group.addoption(
        "--kvoffload-seconds", type=float, help="run each campaign for this many seconds"
    )
    group.addoption("--kvoffload-seed", type=int, help="the seed of a random profile")
    group.addoption(
        "--kvoffload-only",
        action="store_true",
        help="collect no test files: run the kvoffload campaigns alone",
    )


def pytest_configure(config: pytest.Config) -> None:
    # torch warns at import where NumPy is absent, which the campaigns never need.
    config.addinivalue_line("filterwarnings", "ignore:Failed to initialize NumPy:UserWarning")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("kvoffload_only") and config.getoption("kvoffload_target"):
        return True
    return None


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    for target in config.getoption("kvoffload_target"):
        items.append(CampaignItem.from_parent(session, name=f"kvoffload[{target}]", target=target))


class Disagreement(Exception):
    """The campaign found a disagreement: the text says what differed and how to reproduce."""


class CampaignItem(pytest.Item):
    def __init__(self, *, target: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target

    def runtest(self) -> None:
        config = self.config
        profile = config.getoption("kvoffload_profile")
        seconds = config.getoption("kvoffload_seconds")
        if self.target.startswith("vllm"):
            self._run_vllm(profile, seconds)
            return
        from kvoffload.testing import campaign, profiles
        from kvoffload.testing.adapters import adapters

        if self.target not in adapters():
            raise SetupError(f"unknown target {self.target!r}; known: {sorted(adapters())}")
        result = campaign.run_campaign(
            self.target,
            profiles.get(profile or profiles.chosen()),
            seconds=seconds,
            seed=config.getoption("kvoffload_seed"),
        )
        if not result.conforms:
            text = io.StringIO()
            with redirect_stdout(text):
                campaign.print_result(result, f"conformance of {self.target}: ")
            raise Disagreement(text.getvalue())

    def _run_vllm(self, profile: str | None, seconds: float | None) -> None:
        """vLLM's targets run in their release's environment, through ``kvoffload verify``
        (its own process), whose exit status is the verdict."""
        from kvoffload.main import main

        args = ["verify", "--target", self.target]
        if profile:
            args += ["--profile", profile]
        if seconds:
            args += ["--seconds", str(seconds)]
        text = io.StringIO()
        with redirect_stdout(text):
            status = main(args)
        if status == 1:
            raise Disagreement(text.getvalue())
        if status != 0:
            raise SetupError(f"kvoffload verify --target {self.target} exited {status}")

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> str:
        if isinstance(excinfo.value, Disagreement):
            return str(excinfo.value)
        return f"{type(excinfo.value).__name__}: {excinfo.value}"

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "kvoffload", None, f"conformance of {self.target}"
