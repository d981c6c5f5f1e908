"""How much of vLLM's offload code the conformance machine reaches: line and branch
coverage of the files it drives, measured while ``kvoffload verify --target ... --coverage``
runs its checks.

coverage.py runs in the process of the checks (the release's environment, where ``kvoffload
install`` puts it; or the current one for ``--target vllm``) and starts before vLLM is
imported, so that a module's top-level lines count as what they are: run. It measures the
files of :data:`WATCHED` that the release has. The figures are coverage.py's: a statement is
covered when it ran, a branch (an arc from a line with two or more ways out) when it was
taken; :class:`FileReach` keeps each file's counts and its missed lines and arcs.

Invariants kept:

- the figures are of one process's whole run: every check of the target, the warm-up
  included (what it runs, the campaign would run in its first program);
- a watched file that the release does not have is absent from the report, never shown as
  0% (:func:`measured` lists what was there).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# vLLM's files the machine drives, relative to the vllm package: the connector's scheduler
# side, and what it calls in the KV cache manager (issue 11's yardstick); then what the
# machine over vLLM's own scheduler drives besides: the connector's scheduler-side facade,
# the KV cache manager and the scheduler (most of whose lines serve what no offload
# configuration reaches: speculative decoding, encoders, structured output, pipeline and
# data parallelism).
WATCHED = (
    "v1/simple_kv_offload/manager.py",
    "v1/simple_kv_offload/metadata.py",
    "v1/core/block_pool.py",
    "v1/core/kv_cache_coordinator.py",
    "v1/core/single_type_kv_cache_manager.py",
    "distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py",
    "v1/core/kv_cache_manager.py",
    "v1/core/sched/scheduler.py",
)
# The file the issues' targets are stated for.
HEADLINE = "v1/simple_kv_offload/manager.py"
INSTALL = "coverage"  # what ``kvoffload install`` adds to a release environment


@dataclass(frozen=True)
class FileReach:
    """One file's coverage: counts, and what was missed (line numbers; arcs as pairs of
    line numbers, a negative end meaning "leaves the function")."""

    path: str  # relative to the vllm package, as in WATCHED
    statements: int
    covered_statements: int
    branches: int
    covered_branches: int
    missing_lines: tuple[int, ...]
    missing_branches: tuple[tuple[int, int], ...]
    executed_lines: tuple[int, ...]

    @property
    def statement_percent(self) -> float:
        return 100.0 * self.covered_statements / self.statements if self.statements else 100.0

    @property
    def branch_percent(self) -> float:
        return 100.0 * self.covered_branches / self.branches if self.branches else 100.0

    @property
    def percent(self) -> float:
        """Statements and branches together, as coverage.py's own total counts them."""
        total = self.statements + self.branches
        covered = self.covered_statements + self.covered_branches
        return 100.0 * covered / total if total else 100.0

    def as_json(self) -> dict[str, Any]:
        return asdict(self) | {
            "statement_percent": round(self.statement_percent, 1),
            "branch_percent": round(self.branch_percent, 1),
            "percent": round(self.percent, 1),
        }


def vllm_root() -> Path:
    """The vllm package this process would import, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("no vllm package on this interpreter's path")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def measured(root: Path) -> list[Path]:
    """The watched files this vLLM has."""
    return [root / rel for rel in WATCHED if (root / rel).is_file()]


class Recorder:
    """coverage.py over the watched files of the vLLM on this interpreter's path. Start it
    before vLLM is imported; :meth:`finish` writes the figures (and the annotated source)."""

    def __init__(self) -> None:
        import coverage  # the release environment's, installed by `kvoffload install`

        self.root = vllm_root()
        self.coverage = coverage.Coverage(
            data_file=None,
            branch=True,
            include=[str(p) for p in measured(self.root)],
            config_file=False,
        )

    def start(self) -> None:
        self.coverage.start()

    def finish(self, json_file: Path, html_dir: Path | None = None) -> list[FileReach]:
        """Stop measuring; write each file's figures to ``json_file`` (and coverage.py's
        annotated source into ``html_dir``); return them."""
        self.coverage.stop()
        raw = json_file.with_suffix(".raw.json")
        self.coverage.json_report(outfile=str(raw), show_contexts=False)
        reaches = from_report(json.loads(raw.read_text()), self.root)
        raw.unlink()
        if html_dir is not None:
            self.coverage.html_report(directory=str(html_dir), title="vLLM reached by kvoffload")
        json_file.write_text(json.dumps([r.as_json() for r in reaches]))
        return reaches


def from_report(report: dict[str, Any], root: Path) -> list[FileReach]:
    """The watched files' figures from coverage.py's JSON report, in WATCHED's order. A
    watched file never imported is in no report: it counts as present and not run."""
    files = {str(Path(name).resolve()): data for name, data in report["files"].items()}
    reaches = []
    for path in measured(root):
        data = files.get(str(path.resolve()))
        if data is None:
            continue
        summary = data["summary"]
        reaches.append(
            FileReach(
                path=str(path.relative_to(root)),
                statements=summary["num_statements"],
                covered_statements=summary["covered_lines"],
                branches=summary.get("num_branches", 0),
                covered_branches=summary.get("covered_branches", 0),
                missing_lines=tuple(data["missing_lines"]),
                missing_branches=tuple((a, b) for a, b in data.get("missing_branches", ())),
                executed_lines=tuple(data["executed_lines"]),
            )
        )
    return reaches


def load(json_file: Path) -> list[FileReach]:
    """Figures written by :meth:`Recorder.finish`."""
    out = []
    for item in json.loads(json_file.read_text()):
        fields = {k: v for k, v in item.items() if k in FileReach.__dataclass_fields__}
        fields["missing_lines"] = tuple(fields["missing_lines"])
        fields["missing_branches"] = tuple((a, b) for a, b in fields["missing_branches"])
        fields["executed_lines"] = tuple(fields["executed_lines"])
        out.append(FileReach(**fields))
    return out


def table(reaches: list[FileReach]) -> list[str]:
    """The per-file table ``verify --coverage`` prints."""
    lines = [
        "| vLLM file | statements | covered | branches | covered | statements % | "
        "branches % | both % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reaches:
        lines.append(
            f"| {r.path} | {r.statements} | {r.covered_statements} | {r.branches} | "
            f"{r.covered_branches} | {r.statement_percent:.1f} | {r.branch_percent:.1f} | "
            f"{r.percent:.1f} |"
        )
    return lines


def missed_ranges(reach: FileReach) -> list[tuple[int, int]]:
    """The missed statements as ranges of lines: two missed statements are in one range
    when no statement between them ran (comments and blank lines do not split a range)."""
    ran = sorted(reach.executed_lines)
    ranges: list[list[int]] = []
    for n in sorted(reach.missing_lines):
        if ranges and not any(ranges[-1][1] < r < n for r in ran):
            ranges[-1][1] = n
        else:
            ranges.append([n, n])
    return [(a, b) for a, b in ranges]


def missed_lines(reach: FileReach) -> str:
    """:func:`missed_ranges` written out: ``12-15, 40, 88-90``."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in missed_ranges(reach))
