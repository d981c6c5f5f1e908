"""How much of vLLM's offload code the conformance machine reaches: line and branch
coverage of the files it drives, measured while ``kvoffload verify --target ... --coverage``
runs its checks.

coverage.py runs in the process of the checks (the release's environment, where ``kvoffload
install`` puts it; or the current one for ``--target vllm``) and starts before vLLM is
imported, so that a module's top-level lines count as what they are: run. It measures the
files of :data:`WATCHED` that the release has. The figures are coverage.py's: a statement is
covered when it ran, a branch (an arc from a line with two or more ways out) when it was
taken; :class:`FileReach` keeps each file's counts and its missed lines and arcs.

Some statements no run can reach: code no caller gets to (dead), and guards against calls
vLLM's own ``Scheduler`` never makes (it binds the GPU pool at construction, and looks up,
allocates and sends a request's load in one ``schedule()``). :data:`UNREACHABLE` lists them
with the reason, located by their text (:class:`Unreachable`), and
:attr:`FileReach.reachable_percent` is the share of the rest that ran: the figure issue 12's
target is stated in.

Invariants kept:

- the figures are of one process's whole run: every check of the target, the warm-up
  included (what it runs, the campaign would run in its first program);
- a watched file that the release does not have is absent from the report, never shown as
  0% (:func:`measured` lists what was there);
- a statement listed unreachable that ran is reported as such
  (:attr:`FileReach.ran_unreachable`), never counted out: every measurement checks the list.
"""

from __future__ import annotations

import ast
import functools
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
# data parallelism); then the worker side the worker machine drives (issue 33): the worker,
# its copy backend, batch copies and host buffer, the disk backend, and the model runner's
# connector glue.
WATCHED = (
    "v1/simple_kv_offload/manager.py",
    "v1/simple_kv_offload/metadata.py",
    "v1/core/block_pool.py",
    "v1/core/kv_cache_coordinator.py",
    "v1/core/single_type_kv_cache_manager.py",
    "distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py",
    "v1/core/kv_cache_manager.py",
    "v1/core/sched/scheduler.py",
    "v1/simple_kv_offload/worker.py",
    "v1/simple_kv_offload/copy_backend.py",
    "v1/simple_kv_offload/cuda_mem_ops.py",
    "v1/simple_kv_offload/host_buffer.py",
    "v1/simple_kv_offload/disk_backend.py",
    "v1/worker/gpu/kv_connector.py",
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
    # Missed statements UNREACHABLE counts out, with their kind; statements it lists that
    # ran; its entries for this file that the release's source lacks.
    unreachable: tuple[tuple[int, str], ...] = ()
    ran_unreachable: tuple[int, ...] = ()
    unlocated: int = 0

    @property
    def reachable_statements(self) -> int:
        return self.statements - len(self.unreachable)

    @property
    def reachable_percent(self) -> float:
        """Of the statements a run can reach, the share that ran."""
        total = self.reachable_statements
        return 100.0 * self.covered_statements / total if total else 100.0

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
            "reachable_statements": self.reachable_statements,
            "reachable_percent": round(self.reachable_percent, 1),
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
        rel = str(path.relative_to(root))
        missing, executed = data["missing_lines"], data["executed_lines"]
        unreachable, ran, unlocated = counted_out(
            rel, path.read_text(), set(missing), set(executed)
        )
        reaches.append(
            FileReach(
                path=rel,
                statements=summary["num_statements"],
                covered_statements=summary["covered_lines"],
                branches=summary.get("num_branches", 0),
                covered_branches=summary.get("covered_branches", 0),
                missing_lines=tuple(missing),
                missing_branches=tuple((a, b) for a, b in data.get("missing_branches", ())),
                executed_lines=tuple(executed),
                unreachable=unreachable,
                ran_unreachable=ran,
                unlocated=unlocated,
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
        fields["unreachable"] = tuple((n, kind) for n, kind in fields.get("unreachable", ()))
        fields["ran_unreachable"] = tuple(fields.get("ran_unreachable", ()))
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


@dataclass(frozen=True)
class Unreachable:
    """Statements of ``path`` that no run reaches, and why. Located by text, so that one
    entry holds for every release whose code there is the same: in the function
    ``function``, the one line whose text (stripped) is ``anchor``; then ``count`` lines
    from ``offset`` lines below it (0: the anchor itself)."""

    path: str  # relative to the vllm package, as in WATCHED
    function: str
    anchor: str
    offset: int
    count: int
    kind: str  # DEAD or SCHEDULER
    what: str  # the case, in a few words

    def lines(self, source: str) -> range | None:
        """The entry's lines in ``source``, or None where the function or its anchor line is
        absent (or not unique): a release whose code differs there."""
        spans = _function_spans(source).get(self.function, [])
        if len(spans) != 1:
            return None
        start, end = spans[0]
        text = source.splitlines()
        found = [n for n in range(start, end + 1) if text[n - 1].strip() == self.anchor]
        if len(found) != 1:
            return None
        first = found[0] + self.offset
        return range(first, first + self.count)


@functools.lru_cache(maxsize=4)
def _function_spans(source: str) -> dict[str, list[tuple[int, int]]]:
    """Each function of ``source`` by name: its first and last lines (one parse per file,
    however many entries locate themselves in it)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            spans.setdefault(node.name, []).append((node.lineno, node.end_lineno or node.lineno))
    return spans


# The reasons; the reasoning of each entry is in docs/upstream.md ("What is reached,
# measured"). The last three are the worker side's: hardware or a platform a CPU run does not
# have, a failure the emulated device and host never make (only a bug of vLLM's would make
# one), a call vLLM's worker or model runner never makes.
DEAD = "dead code"
SCHEDULER = "a call vLLM's scheduler never makes"
PLATFORM = "another platform (ROCm, HugeTLB pages, O_DIRECT, no pinned memory)"
FAILURE = "a failure of the device, the driver or the host"
WORKER = "a call vLLM's worker never makes"
_MANAGER = HEADLINE
_WORKER, _COPY, _OPS = (
    "v1/simple_kv_offload/worker.py",
    "v1/simple_kv_offload/copy_backend.py",
    "v1/simple_kv_offload/cuda_mem_ops.py",
)
_HOST, _DISK = "v1/simple_kv_offload/host_buffer.py", "v1/simple_kv_offload/disk_backend.py"
UNREACHABLE = (
    Unreachable(
        _MANAGER,
        "get_num_new_matched_tokens",
        "if num_computed_tokens % self.block_size != 0:",
        6,  # past the comment
        7,
        # Its one caller, Scheduler.schedule, passes the local hit rounded down to the
        # scheduler block (the same size: both come from resolve_kv_cache_block_sizes).
        SCHEDULER,
        "a lookup after a local hit off a scheduler-block boundary",
    ),
    # Not listed: the allocation of no external tokens after a lookup that found some (the
    # lines before this entry's). vLLM's scheduler makes it where a fine-grained local hit
    # keeps its sub-block tail, where an auxiliary connector caps the hit, and under
    # DeepSeek-V4.1's bounded replay.
    Unreachable(
        _MANAGER,
        "update_state_after_alloc",
        "if pending is None:",
        1,
        8,
        # The scheduler passes at most what the lookup returned, and the lookup records a
        # pending hit whenever it returns more than 0.
        SCHEDULER,
        "external tokens allocated without a lookup that found them",
    ),
    Unreachable(
        _MANAGER,
        "_prepare_lazy_store_specs",
        "if gpu_pool is None or self._target_free <= 0:",
        1,
        1,
        # Scheduler.__init__ binds the pool (bind_kv_cache_manager); the lazy target is at
        # least twice the blocks of one step's budget.
        SCHEDULER,
        "a store selection before the GPU pool is bound",
    ),
    Unreachable(
        _MANAGER,
        "_prepare_eager_store_specs",
        "if gpu_block_pool is None:",
        1,
        1,
        SCHEDULER,
        "a store selection before the GPU pool is bound",
    ),
    Unreachable(
        _MANAGER,
        "_prepare_eager_store_specs",
        "if admission is _StoreAdmission.NULL_BLOCK:",
        1,
        2,
        # The Mamba manager offers cached blocks and copy-on-write copies, never the null
        # block.
        SCHEDULER,
        "a null block offered",
    ),
    Unreachable(
        _MANAGER,
        "_classify_store_candidate",
        "if gpu_block.is_null:",
        1,
        1,
        # Its callers: the hand-offs (no null block offered) and the lazy scan of the free
        # queue (the null block is never free).
        SCHEDULER,
        "a null block offered",
    ),
    Unreachable(
        _MANAGER,
        "_prepare_eager_store_specs",
        "if num_new_tokens == 0:",
        1,
        1,
        SCHEDULER,
        "a request in the step's output with no token scheduled",
    ),
    Unreachable(
        _MANAGER,
        "_find_fa_partial_tail_source",
        "if block_idx >= len(fa_block_ids):",
        1,
        1,
        # request_finished_all_groups gets the blocks of the computed tokens
        # (get_block_ids_for_computed_tokens: cdiv(num_computed_tokens, block_size) of them),
        # and the boundary, at most the computed tokens and inside a block, is among them.
        SCHEDULER,
        "a finishing request's table that ends before its prompt tail's block",
    ),
    Unreachable(
        _MANAGER,
        "_find_fa_partial_tail_source",
        "if hash_idx >= len(request.block_hashes):",
        1,
        1,
        DEAD,
        "the prompt tail's boundary is at most the request's hashed tokens, so its hash "
        "index is within them",
    ),
    Unreachable(
        _MANAGER,
        "_prepare_eager_store_specs",
        "if not block_ids_by_group:",
        1,
        1,
        DEAD,
        "a table has one list per KV cache group, so it is never empty",
    ),
    Unreachable(
        _MANAGER,
        "_process_store_event",
        "return  # guard stale events from before a reset() call",
        0,
        1,
        # Each worker reports an event once; the event stays in one of the two maps until
        # the last report completes it.
        SCHEDULER,
        "a store event reported after it completed",
    ),
    Unreachable(
        _MANAGER,
        "_process_store_event",
        "if state is None:",
        1,
        1,
        # Only a request with a store state is listed under an event, and its cleanup
        # takes it off every event it lists.
        DEAD,
        "an event lists only requests whose store state is there",
    ),
    Unreachable(
        _MANAGER,
        "request_finished",
        "self._cleanup_load_request(req_id)",
        0,
        1,
        # The load state made by update_state_after_alloc gets its event in the same
        # schedule() (build_connector_meta): no finish falls between.
        SCHEDULER,
        "a finish between a load's allocation and its sending",
    ),
    Unreachable(
        _MANAGER,
        "_cleanup_load_request",
        "state = self._abandoned_reqs_to_load.pop(req_id, None)",
        2,
        1,
        SCHEDULER,
        "a load reported done for a request with no load",
    ),
    Unreachable(
        _MANAGER,
        "_cleanup_load_request",
        "if state.load_event is None:",
        1,
        1,
        SCHEDULER,
        "a load cleaned up before it was sent",
    ),
    Unreachable(
        _MANAGER,
        "_cleanup_store_request",
        "if state is None:",
        1,
        1,
        DEAD,
        "both callers hold the request's store state",
    ),
    Unreachable(
        _MANAGER,
        "_cleanup_store_request",
        "for event_idx in list(state.store_events):",
        1,
        5,
        DEAD,
        "both callers clean up only once no store is in flight",
    ),
    Unreachable(
        _MANAGER,
        "reset",
        "if state.load_event is None:",
        1,
        2,
        SCHEDULER,
        "a reset between a load's allocation and its sending",
    ),
    # The worker side (issue 33), driven by the worker machine on the emulated device.
    Unreachable(
        _WORKER,
        "register_kv_caches",
        "if not kv_caches:",
        1,
        2,
        WORKER,
        "a model runner that registers no KV cache",
    ),
    Unreachable(
        _WORKER,
        "_init_cpu_mode",
        "if not pin_memory:",
        1,
        3,
        PLATFORM,
        "a platform without pinned memory",
    ),
    Unreachable(
        _WORKER,
        "_alloc_cpu_caches",
        "except Exception:",
        0,
        4,
        FAILURE,
        "a host registration refused part way",
    ),
    Unreachable(
        _OPS,
        "_resolve_max_batch_descriptors",
        "if override > 0:",
        1,
        1,
        PLATFORM,
        "a cap on batch descriptors asked for (ROCm's need)",
    ),
    Unreachable(
        _OPS,
        "_resolve_batch_memcpy",
        "if current_platform.is_rocm():",
        1,
        21,
        PLATFORM,
        "ROCm's hipMemcpyBatchAsync",
    ),
    Unreachable(
        _OPS,
        "_resolve_batch_memcpy",
        'raise RuntimeError(f"cuGetProcAddress(cuMemcpyBatchAsync) failed: {err}")',
        0,
        1,
        FAILURE,
        "a driver without cuMemcpyBatchAsync",
    ),
    Unreachable(_OPS, "_load_hip_runtime", "errors = []", 0, 7, PLATFORM, "ROCm's runtime"),
    Unreachable(_OPS, "_rocm_num_attrs", "ver = ctypes.c_int(0)", 0, 7, PLATFORM, "ROCm's version"),
    Unreachable(
        _OPS,
        "_num_attrs_for_hip_version",
        "major, minor = version // 10_000_000, (version // 100_000) % 100",
        0,
        2,
        PLATFORM,
        "ROCm's version",
    ),
    Unreachable(
        _OPS,
        "copy_blocks",
        "if n == 0:",
        1,
        1,
        # Both backends launch a copy only for a transfer with blocks, and copy block by
        # block through their staging buffers.
        WORKER,
        "a copy of no blocks",
    ),
    Unreachable(
        _OPS,
        "copy_blocks",
        "if err != 0:",
        1,
        3,
        # The emulated device refuses a descriptor outside its memory as CUDA does; only an
        # address vLLM computed wrong would reach it (a difference, then, not coverage).
        FAILURE,
        "a batch copy the device refuses",
    ),
    Unreachable(_COPY, "shutdown", "if self._shutdown:", 1, 1, WORKER, "a second shutdown"),
    Unreachable(
        _HOST,
        "parse_hugepage_size",
        "if key not in HUGEPAGE_SIZES:",
        0,
        6,
        PLATFORM,
        "HugeTLB pages for the host buffer",
    ),
    Unreachable(
        _HOST,
        "alloc_host_buffer",
        "if hugepage_size:",
        1,
        1,
        PLATFORM,
        "HugeTLB pages for the host buffer",
    ),
    Unreachable(
        _HOST,
        "alloc_host_buffer",
        "buf = mmap.mmap(-1, nbytes, flags=flags)",
        1,
        5,
        FAILURE,
        "a mapping refused",
    ),
    Unreachable(
        _HOST,
        "alloc_host_buffer",
        'if not hugepage_size and os.environ.get("THP_MEM_ALLOC_ENABLE") == "1":',
        1,
        4,
        PLATFORM,
        "transparent huge pages asked for",
    ),
    Unreachable(
        _HOST,
        "alloc_host_buffer",
        "populate(buf, 0, nbytes)",
        1,
        5,
        FAILURE,
        "a mapping the host cannot populate",
    ),
    Unreachable(
        _DISK,
        "init",
        "assert total_block_bytes % _ALIGNMENT == 0, (",
        0,
        3,
        # The temporary folder's file system may refuse O_DIRECT, and the blocks drawn are
        # smaller than its 4 KiB alignment: the page cache is on.
        PLATFORM,
        "O_DIRECT files",
    ),
    Unreachable(_DISK, "init", "flags |= O_DIRECT", 0, 1, PLATFORM, "O_DIRECT files"),
    Unreachable(_DISK, "shutdown", "if self._shutdown:", 1, 1, WORKER, "a second shutdown"),
    Unreachable(_DISK, "shutdown", "if self._fd < 0:", 1, 1, WORKER, "a second shutdown"),
    Unreachable(
        _DISK,
        "shutdown",
        "for t in (self._store_thread, self._load_thread)",
        2,
        5,
        FAILURE,
        "an IO thread hung past its join",
    ),
    Unreachable(
        _DISK,
        "_writev_slot",
        "if written < self._total_block_bytes:",
        1,
        4,
        FAILURE,
        "a short write",
    ),
    Unreachable(
        _DISK,
        "_readv_slot",
        "if bytes_read < self._total_block_bytes:",
        1,
        4,
        FAILURE,
        "a short read",
    ),
    Unreachable(
        _DISK,
        "_load_loop",
        "if wait_event is not None:",
        1,
        1,
        # The worker passes a wait event with its stores only.
        WORKER,
        "a load that waits for an event",
    ),
)


def counted_out(
    path: str,
    source: str,
    missing: set[int],
    executed: set[int],
    entries: tuple[Unreachable, ...] = UNREACHABLE,
) -> tuple[tuple[tuple[int, str], ...], tuple[int, ...], int]:
    """For the file ``path`` whose text is ``source``: each missed statement that ``entries``
    place there, with its kind; the statements they place there that ran (the list is wrong
    there); and how many of the entries for the file the source lacks."""
    out: dict[int, str] = {}
    ran: set[int] = set()
    unlocated = 0
    for entry in entries:
        if entry.path != path:
            continue
        lines = entry.lines(source)
        if lines is None:
            unlocated += 1
            continue
        out.update((n, entry.kind) for n in lines if n in missing)
        ran.update(n for n in lines if n in executed)
    return tuple(sorted(out.items())), tuple(sorted(ran)), unlocated


def reachable_summary(reach: FileReach) -> str:
    """The line ``verify --coverage`` prints under its table for a file with statements
    counted out."""
    kinds: dict[str, int] = {}
    for _, kind in reach.unreachable:
        kinds[kind] = kinds.get(kind, 0) + 1
    line = (
        f"{reach.path}: {reach.covered_statements} of the {reach.reachable_statements} "
        f"statements a run can reach ran ({reach.reachable_percent:.1f}%); counted out: "
        + ", ".join(f"{n} of {kind}" for kind, n in sorted(kinds.items()))
    )
    if reach.ran_unreachable:
        line += f"; LISTED UNREACHABLE BUT RAN: {', '.join(map(str, reach.ran_unreachable))}"
    if reach.unlocated:
        line += f"; {reach.unlocated} of the list's entries are not in this release's source"
    return line
