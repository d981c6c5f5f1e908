"""Targets as data (issue 37): the registry's rows say what each target takes, a user's own
target is registered the same way the built-in ones are, and a name no row has is a clear
error naming the known ones, never a bare KeyError."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from kvoffload.impl import FAULTS, OffloadImpl
from kvoffload.main import main
from kvoffload.model import OffloadConfig
from kvoffload.model.errors import ConfigError
from kvoffload.testing import targets
from kvoffload.testing.campaign import run_campaign
from kvoffload.testing.failure import FailureFileError, validate
from kvoffload.testing.stateful import machine_for
from kvoffload.testing.targets import TargetSpec, UnknownTargetError, register, spec

from helpers import registered

SMALL = settings(max_examples=60, stateful_step_count=20, deadline=None, database=None)


def _mine(config: OffloadConfig) -> OffloadImpl:
    return OffloadImpl(config, device="cpu", lockstep=True)


def _forgets_final_flush(config: OffloadConfig) -> OffloadImpl:
    return OffloadImpl(config, faults=["no-final-flush"], device="cpu", lockstep=True)


def test_the_built_in_rows_say_what_each_target_takes() -> None:
    impl, vllm = spec("impl"), spec("vllm")
    assert impl.device == "cpu" and impl.injects and impl.faults == () and not impl.elsewhere
    assert spec("impl-cuda").device == "cuda"
    for name in FAULTS:
        row = spec(f"fault:{name}")
        assert row.faults == (name,) and row.device == "cpu" and row.variant() == "fixed"
    # vLLM's offload code takes no injected faults, replays in its own environment, and
    # has a scheduler of its own for the scheduler machine
    assert not vllm.injects and vllm.elsewhere and vllm.scheduler is not None
    assert impl.scheduler is None
    assert {"impl", "impl-cuda", "vllm", *(f"fault:{n}" for n in FAULTS)} <= set(targets.names())


def test_an_unknown_target_is_a_clear_error_naming_the_known_ones() -> None:
    for call in (lambda: spec("mine"), lambda: machine_for("mine")):
        with pytest.raises(UnknownTargetError) as caught:
            call()
        assert isinstance(caught.value, ConfigError)
        message = str(caught.value)
        assert message.startswith("unknown target 'mine'; known: impl, impl-cuda")
        assert "fault:NAME (a fault of the catalogue)" in message
    with pytest.raises(UnknownTargetError) as caught:
        spec("fault:no-such-fault")
    assert str(caught.value) == (
        "'fault:no-such-fault' names no fault of the catalogue; known: " + ", ".join(sorted(FAULTS))
    )


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        (TargetSpec("impl", _mine, "a second impl"), "already registered"),
        (TargetSpec("fault:mine", _mine, "a fault of no catalogue"), "already registered"),
        (TargetSpec("", _mine, "no name"), "must be a letter"),
        (TargetSpec("a b", _mine, "a space"), "must be a letter"),
        (TargetSpec("x" * 65, _mine, "too long"), "must be a letter"),
        (TargetSpec("not-callable", "build", "no builder"), "build must be callable"),  # type: ignore[arg-type]
        ({"name": "mine"}, "registered as a TargetSpec"),
    ],
)
def test_a_bad_registration_is_refused_and_changes_nothing(row: Any, problem: str) -> None:
    before = targets.names()
    with pytest.raises(ConfigError, match=problem):
        register(row)
    assert targets.names() == before


def test_a_users_target_is_registered_and_driven_like_the_built_in_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    with registered(TargetSpec("mine", _mine, "my implementation")):
        assert "mine" in targets.adapters()
        assert run_campaign("mine", SMALL, seed=1).conforms
        with pytest.raises(ConfigError, match="already registered"):
            register(TargetSpec("mine", _mine, "again"))
    assert "mine" not in targets.names()
    with registered(TargetSpec("mine-broken", _forgets_final_flush, "mine, with a bug")):
        result = run_campaign("mine-broken", SMALL, seed=1)
        assert not result.conforms and result.saved is not None
        # its failure is a failure file like any other: it names the target, validates
        # while the target is registered, and replays on it
        saved = json.loads(result.saved.read_text())
        assert saved["adapter"] == "mine-broken" and saved["machine"] == "offload"
        assert main(["replay", "--run", str(result.saved)]) == 1
    with pytest.raises(FailureFileError, match="unknown adapter 'mine-broken'"):
        validate(saved)


def test_a_target_that_cannot_run_here_says_why() -> None:
    with registered(
        TargetSpec("elsewhere", _mine, "not here", unavailable=lambda: "no such device here")
    ):
        assert "elsewhere" not in targets.adapters() and "elsewhere" in targets.names()
        assert main(["verify", "--target", "elsewhere", "--no-mutants"]) == 2


class _EntryPoint:
    """An installed package's entry point of the group ``kvoffload.targets``."""

    def __init__(self, name: str, value: object) -> None:
        self.name, self.value, self._value = name, f"plugin:{name}", value

    def load(self) -> object:
        if isinstance(self._value, Exception):
            raise self._value
        return self._value


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> list[_EntryPoint]:
    found: list[_EntryPoint] = []
    monkeypatch.setattr(targets, "_plugins_loaded", False)
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda group: found if group == targets.ENTRY_POINTS else [],
    )
    return found


def test_an_installed_package_registers_its_target_by_an_entry_point(
    plugins: list[_EntryPoint],
) -> None:
    plugins.append(_EntryPoint("theirs", TargetSpec("theirs", _mine, "a plugin's target")))
    try:
        assert spec("theirs").summary == "a plugin's target"
        assert "theirs" in targets.names()
    finally:
        targets.unregister("theirs")


@pytest.mark.parametrize(
    ("value", "problem"),
    [(ImportError("no module"), "cannot be loaded: no module"), (42, "is not a TargetSpec")],
)
def test_a_broken_plugin_is_an_error_naming_it(
    plugins: list[_EntryPoint], value: object, problem: str
) -> None:
    plugins.append(_EntryPoint("broken", value))
    with pytest.raises(ConfigError, match=f"the target plugin 'broken' .*{problem}"):
        spec("not-built-in")


def test_a_plugin_under_a_name_already_taken_is_an_error_naming_both(
    plugins: list[_EntryPoint],
) -> None:
    plugins.append(_EntryPoint("first", TargetSpec("first", _mine, "a plugin's target")))
    plugins.append(_EntryPoint("clash", TargetSpec("impl", _mine, "not the implementation")))
    for _ in range(2):  # said again on the next lookup, and nothing was added
        with pytest.raises(ConfigError, match=r"'clash' .* the target 'impl', which kvoffload"):
            spec("not-built-in")
        assert "first" not in targets._registered
    plugins.append(_EntryPoint("again", TargetSpec("twice", _mine, "one")))
    plugins.append(_EntryPoint("again2", TargetSpec("twice", _mine, "two")))
    plugins.remove(plugins[1])
    with pytest.raises(ConfigError, match=r"'again2' .* the target 'twice', which another"):
        spec("not-built-in")


def test_a_plugin_that_registered_its_row_on_import_is_taken_once(
    plugins: list[_EntryPoint],
) -> None:
    row = TargetSpec("self-registered", _mine, "registered on import")
    targets.register(row)
    plugins.append(_EntryPoint("self-registered", row))
    try:
        assert spec("self-registered") is row and targets.names().count("self-registered") == 1
    finally:
        targets.unregister("self-registered")
