"""The package's folders form layers: every import, at a module's top or inside a function, and
every module a process is started with (``python -m kvoffload...``), goes to the folder's own
layer or one below it. No folder circles, no arrow that runs back up (issue 37)."""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# From the bottom up: a folder may import its own layer's modules and those below it. The
# specification; the targets beside each other (the implementation, vLLM's code) and the
# proofs of the specification; the machines; the campaigns over vLLM's releases; the
# command line with the pytest plugin.
LAYERS: list[tuple[str, ...]] = [
    ("model",),
    ("impl", "vllm_target", "proofs"),
    ("testing",),
    ("upstream",),
    ("cli",),
]
_MODULE = re.compile(r"kvoffload(\.[a-z_]+)+")


@functools.cache
def _folders() -> dict[str, str]:
    """Package -> folder, as pyproject.toml installs them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = project["tool"]["setuptools"]["package-dir"]
    return mapping


def _folder_of(module: str, folders: dict[str, str]) -> str | None:
    """The folder ``module`` lives in (its longest package), or None if not kvoffload's."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        package = ".".join(parts[:n])
        if package in folders:
            return folders[package]
    return None


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module of the package (a file of one of its folders)."""
    package, _, stem = name.rpartition(".")
    folder = _folders().get(package)
    return folder is not None and (ROOT / folder / f"{stem}.py").is_file()


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """Every kvoffload module ``path`` imports or starts a process with, by line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from kvoffload.x import y`: y may be a module of x
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _MODULE.fullmatch(node.value)
            and _is_module(node.value)
        ):
            # a module a process is started with (an entry point group's name is none)
            found.append((node.lineno, node.value))
    return [(line, name) for line, name in found if name.split(".")[0] == "kvoffload"]


def _arrows() -> dict[tuple[str, str], list[str]]:
    folders = _folders()
    arrows: dict[tuple[str, str], list[str]] = defaultdict(list)
    for package, folder in folders.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            own = package if path.stem == "__init__" else f"{package}.{path.stem}"
            for line, name in _imports(path, own):
                target = _folder_of(name, folders)
                if target is not None and target != folder:
                    arrows[(folder, target)].append(f"{folder}/{path.name}:{line} -> {name}")
    return arrows


def _layer(folder: str) -> int:
    for n, layer in enumerate(LAYERS):
        if folder in layer:
            return n
    raise AssertionError(f"the folder {folder} is in no layer: add it to LAYERS")


def test_every_folder_of_the_package_has_a_layer() -> None:
    assert sorted(_folders().values()) == sorted(f for layer in LAYERS for f in layer)


def test_no_import_runs_back_up_and_no_folders_import_each_other() -> None:
    upward = [
        where
        for (source, target), places in _arrows().items()
        if _layer(target) > _layer(source)
        or (_layer(target) == _layer(source) and source != target)
        for where in places
    ]
    assert not upward, "imports that run back up or sideways:\n" + "\n".join(upward)


@pytest.mark.parametrize(
    ("source", "text", "wanted"),
    [
        ("testing", "from kvoffload.upstream.install import Cache\n", "upstream"),
        ("testing", "def f():\n    from kvoffload import main\n", "cli"),
        ("model", "import kvoffload.impl.driver\n", "impl"),
        ("testing", 'WORKER = "kvoffload.fuzz"\n', "cli"),
        ("vllm_target", 'command = ["-m", "kvoffload.upstream.check"]\n', "upstream"),
    ],
)
def test_the_drawing_sees_every_kind_of_arrow(
    source: str, text: str, wanted: str, tmp_path: Path
) -> None:
    # (the check above cannot fail silently: each way a module names another is seen)
    path = tmp_path / "planted.py"
    path.write_text(text)
    folders = _folders()
    seen = {_folder_of(name, folders) for _, name in _imports(path, f"kvoffload.{source}")}
    assert wanted in seen
    assert _layer(wanted) > _layer(source)
