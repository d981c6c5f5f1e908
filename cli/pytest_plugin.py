"""The conformance campaign as pytest tests: ``pytest --kvoffload-target=TARGET``.

Installed as a pytest plugin (entry point ``pytest11``), inert unless ``--kvoffload-target``
is given: then each target becomes one test item whose outcome is the campaign's verdict, so
that pytest's own reporting applies (``-v``, ``--junitxml``, exit status). The other options
are checked whenever they are given.

Targets: ``impl``, ``impl-cuda``, ``fault:NAME`` (run in this process), and vLLM's forms of
``kvoffload verify --target`` (``vllm==X.Y.Z``, ``vllm@PATH``, ``vllm``), run as that
command runs them (:func:`kvoffload.upstream.check.check_release`: a release or a tree in
the cache's environment), one item per target whose verdict is that command's.

Options: ``--kvoffload-profile`` (fast, ci, nightly), ``--kvoffload-seconds``,
``--kvoffload-seed``, ``--kvoffload-only`` (collect no test files, only the campaigns: for a
vLLM checkout, whose own tests are not wanted here).

Three outcomes, kept apart:

- bad usage (a number of seconds that is not finite, > 0 and at most
  :data:`~kvoffload.model.limits.MAX_SECONDS`; a seed outside 0 to
  :data:`~kvoffload.model.limits.MAX_SEED`; a target of no known form, a fault not in the
  catalogue, a target given twice) is a ``pytest.UsageError`` at configure time: exit
  status 4, one line naming the option, nothing collected or run;
- a target known but not available here (``impl-cuda`` without CUDA, a release not in the
  cache, a tree or ``vllm`` without its environment, a target that cannot be built even on
  the smallest configuration) is an ERROR of the item's setup, one line saying what is
  missing and how to get it; a :class:`SetupError` of the campaign itself is an ERROR too
  (at call), its text starting with ``broken setup:``;
- a disagreement FAILS the item with the first difference, the shrunk reproducer and the
  file the failure was saved to.

Invariants kept: importing this module imports neither torch nor Hypothesis, so that pytest
starts in any environment where kvoffload is installed (every kvoffload module it needs is
imported inside the hook that needs it; the fault catalogue, which imports torch, only when
a ``fault:`` target is given); and every value an error shows is cut
(:func:`~kvoffload.model.limits.brief`, :func:`~kvoffload.model.limits.cut`), so that an
error stays one short line.
"""

from __future__ import annotations

import argparse
import io
import warnings
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvoffload.model.errors import ConfigError, SetupError
from kvoffload.model.limits import brief, cut

if TYPE_CHECKING:
    from kvoffload.vllm_target.forms import VllmTarget

# How the text of a campaign that could not run starts (never "DISAGREES").
BROKEN = "broken setup: "


@dataclass(frozen=True)
class Campaigns:
    """The options, checked at configure time: what every item runs."""

    targets: tuple[str, ...] = ()
    profile: str | None = None
    seconds: float | None = None
    seed: int | None = None
    # vLLM's targets, as parsed when checked (a tree's digest taken then)
    vllm: dict[str, VllmTarget] = field(default_factory=dict)


CAMPAIGNS = pytest.StashKey[Campaigns]()


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
    # Read as text and checked in pytest_configure: a type here would report a bad value
    # with pytest's whole usage text, not in one line.
    group.addoption(
        "--kvoffload-seconds",
        metavar="SECONDS",
        help="run each campaign for this many seconds (finite, > 0, at most a week)",
    )
    group.addoption(
        "--kvoffload-seed",
        metavar="SEED",
        help="the seed of a random profile (a whole number from 0 to 2**64 - 1)",
    )
    group.addoption(
        "--kvoffload-only",
        action="store_true",
        help="collect no test files: run the kvoffload campaigns alone",
    )


def pytest_configure(config: pytest.Config) -> None:
    # torch warns at import where NumPy is absent, which the campaigns never need.
    config.addinivalue_line("filterwarnings", "ignore:Failed to initialize NumPy:UserWarning")
    config.stash[CAMPAIGNS] = checked(config)


def checked(config: pytest.Config) -> Campaigns:
    """The ``--kvoffload-*`` options, checked in full before anything is collected; a
    ``pytest.UsageError`` (exit status 4) names the option and the problem in one line."""
    seconds_text: str | None = config.getoption("kvoffload_seconds")
    seed_text: str | None = config.getoption("kvoffload_seed")
    targets: list[str] = config.getoption("kvoffload_target")
    if seconds_text is None and seed_text is None and not targets:
        return Campaigns(profile=config.getoption("kvoffload_profile"))  # inert
    # The command line's own option types: the same bounds, the same words.
    from kvoffload.main import seconds, seed

    found_seconds: float | None = None
    found_seed: int | None = None
    option = "--kvoffload-seconds"
    try:
        if seconds_text is not None:
            found_seconds = seconds(seconds_text)
        option = "--kvoffload-seed"
        if seed_text is not None:
            found_seed = seed(seed_text)
    except argparse.ArgumentTypeError as error:
        raise pytest.UsageError(_line(f"{option}: {error}")) from None
    vllm: dict[str, VllmTarget] = {}
    for n, target in enumerate(targets):
        if target in targets[:n]:
            raise pytest.UsageError(f"--kvoffload-target: {brief(target)} is given twice")
        parsed = checked_target(target)
        if parsed is not None:
            vllm[target] = parsed
    return Campaigns(
        tuple(targets), config.getoption("kvoffload_profile"), found_seconds, found_seed, vllm
    )


def checked_target(target: str) -> VllmTarget | None:
    """A vLLM target as parsed, or None for a target run here; a ``pytest.UsageError`` for
    a target of no known form, or a fault the catalogue lacks."""
    from kvoffload.main import TARGETS
    from kvoffload.testing.targets import FAULT, UnknownTargetError, spec
    from kvoffload.vllm_target.forms import is_vllm_target, parse

    if not is_vllm_target(target):
        try:
            with warnings.catch_warnings():
                # (torch warns at import where NumPy is absent, which the campaigns never need)
                warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
                spec(target)
        except UnknownTargetError as error:
            # a fault the catalogue lacks is named with the catalogue, any other name with
            # the forms a target takes
            if target.startswith(FAULT):  # (the name in it cut, the catalogue whole)
                raise pytest.UsageError(f"--kvoffload-target: {error}") from None
            raise pytest.UsageError(
                _line(
                    f"--kvoffload-target: unknown target {brief(target)}; the targets: "
                    f"{TARGETS}, or one registered"
                )
            ) from None
        except ModuleNotFoundError:
            pass  # the fault catalogue without torch: the item's setup says what is missing
        return None
    try:
        return parse(target)
    except (ConfigError, OSError) as error:  # OSError: a tree whose sources cannot be read
        raise pytest.UsageError(_line(f"--kvoffload-target: {error}")) from None


def _line(text: str) -> str:
    """``text`` as one short line: a value given on the command line may hold newlines."""
    return cut(text.replace("\r", "\\r").replace("\n", "\\n"))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("kvoffload_only") and config.getoption("kvoffload_target"):
        return True
    return None


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    campaigns = config.stash[CAMPAIGNS]
    for target in campaigns.targets:
        items.append(
            CampaignItem.from_parent(
                session,
                name=f"kvoffload[{target}]",
                target=target,
                vllm=campaigns.vllm.get(target),
            )
        )


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(
    report: pytest.TestReport | pytest.CollectReport, config: pytest.Config
) -> tuple[str, str, str] | None:
    """A campaign that could not run (its text starts with ``broken setup:``) counts as an
    error, as pytest counts a failed setup: never as a failed test, which is a verdict."""
    if (
        report.when == "call"
        and report.failed
        and report.nodeid.startswith("::kvoffload[")  # (a CampaignItem: the session's child)
        and isinstance(report.longrepr, str)
        and report.longrepr.startswith(BROKEN)
    ):
        return "error", "E", "ERROR"
    return None


class Disagreement(Exception):
    """The campaign found a disagreement: the text says what differed and how to reproduce."""


class CampaignItem(pytest.Item):
    def __init__(self, *, target: str, vllm: VllmTarget | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target
        self.vllm = vllm

    def setup(self) -> None:
        """Whether the target can run here; if not, an ERROR at setup in one line: what is
        missing and how to get it."""
        try:
            if self.vllm is not None:
                available(self.vllm)
            else:
                buildable(self.target)
        except SetupError as error:
            missing = str(error)
        else:
            return
        # pytrace=False: pytest shows the message alone, not this plugin's traceback (and
        # raised outside the handler, without the SetupError shown as its context).
        pytest.fail(BROKEN + cut(missing), pytrace=False)

    def runtest(self) -> None:
        campaigns = self.config.stash[CAMPAIGNS]
        if self.vllm is not None:
            self._run_vllm(campaigns)
            return
        from kvoffload.testing import campaign, profiles

        result = campaign.run_campaign(
            self.target,
            profiles.get(campaigns.profile or profiles.chosen()),
            seconds=campaigns.seconds,
            seed=campaigns.seed,
        )
        # The verdict's class as a property of the test case (JUnit XML carries it): conforms,
        # breaks ID (a bug) or differs (a change to review), as `verify --json` says it.
        self.user_properties.append(("kvoffload-verdict", result.verdict_class))
        if not result.conforms:
            text = io.StringIO()
            with redirect_stdout(text):
                campaign.print_result(result, f"conformance of {self.target}: ")
            raise Disagreement(text.getvalue())

    def _run_vllm(self, campaigns: Campaigns) -> None:
        """vLLM's targets run as ``kvoffload verify --target`` runs them (a release or a tree
        in its environment's process), whose exit status is the verdict."""
        from kvoffload.upstream.check import check_release

        text = io.StringIO()
        try:
            with redirect_stdout(text):
                status = check_release(
                    self.target, campaigns.profile, campaigns.seconds, False, seed=campaigns.seed
                )
        except ConfigError as error:
            # Checked at setup; still possible if the cache changed since (a release removed).
            raise SetupError(str(error)) from error
        if status != 0:
            # 1: a check did not reach its verdict; 3: the model broke its own invariant on a
            # program, which the text says (the verify command's "a bug of the specification").
            raise Disagreement(text.getvalue())

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> str:
        if isinstance(excinfo.value, Disagreement):
            return str(excinfo.value)
        if isinstance(excinfo.value, SetupError):
            # pytest shows only what fails in setup or teardown as an error, and the campaign
            # is the test, so it runs in the call phase: there a SetupError (a release's
            # environment that fails, a target that breaks past its first build) is no verdict.
            # Its text starts with "broken setup:" (the command line's words, exit status 3
            # there), and pytest_report_teststatus above counts it as an error, not a failure.
            return BROKEN + cut(str(excinfo.value))
        return f"{type(excinfo.value).__name__}: {excinfo.value}"

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "kvoffload", None, f"conformance of {self.target}"


def buildable(target: str) -> None:
    """A :class:`SetupError` unless ``target`` (run in this process) is there and builds on
    the smallest configuration."""
    from kvoffload.main import INSTALL

    try:
        from kvoffload.model.config import OffloadConfig
        from kvoffload.testing.targets import UnknownTargetError, spec
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if missing not in INSTALL:
            raise
        raise SetupError(f"{target} needs the package {missing!r}: {INSTALL[missing]}") from None
    try:
        row = spec(target)
    except UnknownTargetError as error:
        raise SetupError(str(error)) from None
    why = row.unavailable()
    if why is not None:
        raise SetupError(_no_cuda() if row.device == "cuda" else f"{target}: {why}")
    # The smallest configuration: 4 GPU and 2 CPU blocks of 4 tokens, each pool with its null
    # block (the one the vLLM check's warm-up builds, kvoffload.upstream.check.warm_up).
    config = OffloadConfig(4, 2, (4,), 4)
    try:
        built = row.build(config)
    except Exception as error:
        raise SetupError(f"{target} cannot be built here, even on {config}: {error!r}") from error
    close = getattr(built, "close", None)
    if callable(close):
        close()  # (the implementation's copy threads, if it started any)


def _no_cuda() -> str:
    import torch

    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is built without CUDA"
        get = "install torch's CUDA build on a machine with an NVIDIA GPU"
    else:
        why = f"torch (CUDA {torch.version.cuda}) finds no GPU here"
        get = "run it on a machine with an NVIDIA GPU"
    return f"impl-cuda needs CUDA, and {why}: {get}, or run --kvoffload-target=impl"


def available(target: VllmTarget) -> None:
    """A :class:`SetupError` unless the environment ``target`` runs in is there: a release
    installed in the cache, the cache's shared environment for a tree, a vLLM importable
    here for ``vllm``."""
    from kvoffload.upstream.install import Cache, default_cache

    cache = Cache(default_cache())
    if target.kind == "release":
        if not cache.installed(str(target.version)):
            raise SetupError(
                f"{target.spec} is not installed in {cache.root}: run "
                f"`kvoffload install {target.spec}`"
            )
    elif target.kind == "tree":
        if not cache.ready():
            raise SetupError(
                f"a vLLM tree runs in the shared environment of {cache.root}, which is not "
                "there: run `kvoffload install vllm==X.Y.Z` (any release) once"
            )
    elif target.version is None:
        raise SetupError(
            "no vLLM is installed in this environment (--kvoffload-target=vllm): install "
            "vLLM here, or name a release of the cache, vllm==X.Y.Z "
            "(`kvoffload install vllm==X.Y.Z`)"
        )
