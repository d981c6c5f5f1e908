"""The processes kvoffload starts, isolated from the folder and the environment they are
started from.

A user runs kvoffload where the files are: a CI artifact unpacked in a folder, a colleague's
failure file. Python puts the folder of a ``-m`` or ``-c`` command first on ``sys.path``, so
a ``kvoffload/`` package or a ``json.py`` planted beside a failure file would run in a plain
``python -m kvoffload ...`` subprocess; and the caller's ``PYTHON*`` variables would bring
their own packages in before the release environment's.

Invariants kept, for every Python process started through :func:`python_command` with
:func:`environment` (the vLLM checks, the replay of a vLLM failure, ``fuzz``'s workers,
the release environment's pip) and for the mutation matrix's spawned workers
(:func:`spawning_safely`):

- ISOLATED: the interpreter runs with ``-P`` (no folder of the command first on
  ``sys.path``), and no ``PYTHON*`` variable of the caller reaches it but those set here
  (and, in the caller's own environment, its ``PYTHONPATH``);
- OWN FOLDER: it runs in a new empty folder of its own (:func:`own_folder`), so that a file
  opened by a relative name is never the caller's; every path it is given is absolute, and
  what it saves (failures, the example database) goes to the caller's folders
  (:func:`saved_in`), named absolute in its environment;
- EXACT PATH: in another environment (a release's), what it imports beyond that
  interpreter's own site-packages is exactly the folders given (a release, a tree,
  the link to this kvoffload), in that order, and no user site-packages.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# Where kvoffload saves failures and Hypothesis's examples, relative to the working folder
# unless these variables name them (as they do, absolute, for every isolated subprocess).
FAILURES_VARIABLE, FAILURES = "KVOFFLOAD_FAILURES", ".hypothesis/kvoffload-failures"
DATABASE_VARIABLE, DATABASE = "KVOFFLOAD_DATABASE", ".hypothesis/examples"

# -P: neither the script's folder nor the working folder first on sys.path.
FLAGS = ("-P",)


def python_command(python: str | Path, module: str, *args: str) -> list[str]:
    """``python -P -m module args``: a module run with nothing of its folder on the path."""
    return [str(python), *FLAGS, "-m", module, *args]


def environment(
    paths: Sequence[Path] | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The caller's environment without its ``PYTHON*`` variables, then ``extra``. With
    ``paths`` (another interpreter's environment: a release's), they are the only
    ``PYTHONPATH`` and the user's site-packages are off; without (this environment again,
    ``fuzz``'s workers), the caller's own ``PYTHONPATH`` is kept, since it is how this
    kvoffload was found."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONSAFEPATH"] = "1"  # what -P says, for any interpreter it starts in turn
    if paths is None:
        if "PYTHONPATH" in os.environ:
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    else:
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(str(Path(p).absolute()) for p in paths)
        env["PYTHONNOUSERSITE"] = "1"
    return env | saved_in() | dict(extra or {})


def saved_in() -> dict[str, str]:
    """The folders this process saves failures and examples to, absolute, as variables."""
    return {
        name: str(Path(os.environ.get(name) or default).absolute())
        for name, default in ((FAILURES_VARIABLE, FAILURES), (DATABASE_VARIABLE, DATABASE))
    }


def failures_folder() -> Path:
    """Where failures are saved: ``.hypothesis/kvoffload-failures`` of the working folder,
    or of the caller's folder for an isolated subprocess."""
    return Path(os.environ.get(FAILURES_VARIABLE) or FAILURES)


def database_folder() -> Path:
    """Where Hypothesis's example database is, as :func:`failures_folder`."""
    return Path(os.environ.get(DATABASE_VARIABLE) or DATABASE)


@contextlib.contextmanager
def own_folder() -> Iterator[Path]:
    """A new empty folder for a subprocess to run in, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-") as folder:
        yield Path(folder)


def run(
    command: Sequence[str], env: Mapping[str, str], cwd: Path, **options: Any
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` of ``command`` in ``cwd`` (a folder of :func:`own_folder`)."""
    return subprocess.run(list(command), env=dict(env), cwd=cwd, check=False, **options)


@contextlib.contextmanager
def spawning_safely() -> Iterator[None]:
    """While open, processes spawned by ``multiprocessing`` start with ``-P``:
    its ``spawn`` start method runs ``python -c ...`` in the caller's folder, which would
    put that folder first on the child's path before it reads the parent's."""
    saved = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = saved
