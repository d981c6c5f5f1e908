"""The page of a failure (``kvoffload replay FILE --html PAGE``, :mod:`kvoffload.testing.page`):
the lockstep's own verdict, call by call, each call applied once; the differing call marked
and every differing value highlighted; hostile values inert; the same bytes twice; and the
page as a real browser draws it (Debian's chromium, headless, where it is installed)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvoffload.impl import OffloadImpl
from kvoffload.model import OffloadConfig, StepResult
from kvoffload.testing import lockstep, page
from kvoffload.testing.adapters import Target
from kvoffload.testing.failure import Failure, validate
from kvoffload.testing.targets import adapters

FAULT = "no-final-flush"
# The shrunk counterexample of the fault (docs/bugs.md): a request finishes in the step that
# computes its only block, and the final flush that should store that block is never queued.
PROGRAM: list[list[object]] = [["add", "r1", [0, 1, 2, 3], 1], ["step", 8]]
CONFIG = {
    "gpu_blocks": 4,
    "cpu_blocks": 2,
    "group_block_sizes": [4],
    "hash_block_size": 4,
    "world_size": 1,
}
# The colour of ``.differs`` in the page's style, as the browser draws it.
HIGHLIGHT = (0xFF, 0xC4, 0x00)


def _failure(
    program: Sequence[Sequence[object]] = PROGRAM, adapter: str = f"fault:{FAULT}"
) -> Failure:
    return validate(
        {
            "adapter": adapter,
            "variant": "fixed",
            "config": CONFIG,
            "program": [list(call) for call in program],
            "disagreement": "call 1 ('step', 8): snapshots differ in ['pending_flushes']",
        }
    )


def _page(failure: Failure) -> tuple[page.Trace, str]:
    factory = adapters()[failure.adapter]
    trace = page.record(factory, failure.variant, failure.config, failure.program)
    return trace, page.render(trace, failure, failure.adapter)


@dataclass
class _Cell:
    table: str
    row: str  # the text of the row's first cell
    text: str
    differs: bool


class _Page(HTMLParser):
    """The page's cells by table, its tags and attributes, and its text, as a parser sees
    them."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[_Cell] = []
        self.tags: set[str] = set()
        self.attributes: set[str] = set()
        self.marked: list[str] = []  # the text of each element of class "at"
        self.text: list[str] = []
        self._table = ""
        self._row: list[_Cell] = []
        self._cell: _Cell | None = None
        self._at = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.tags.add(tag)
        self.attributes |= set(found)
        if self._at or "at" in (found.get("class") or "").split():
            self._at += 1
            if self._at == 1:
                self.marked.append("")
        if tag == "table":
            self._table = found.get("id") or ""
        elif tag == "tr":
            self._row = []
        elif tag == "td":
            differs = "differs" in (found.get("class") or "").split()
            self._cell = _Cell(self._table, "", "", differs)

    def handle_endtag(self, tag: str) -> None:
        if self._at:
            self._at -= 1
        if tag == "td" and self._cell is not None:
            self._cell.row = self._row[0].text if self._row else self._cell.text
            self._row.append(self._cell)
            self.cells.append(self._cell)
            self._cell = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell.text += data
        if self._at:
            self.marked[-1] += data

    def highlighted(self, table: str) -> list[tuple[str, str]]:
        return [(c.row, c.text) for c in self.cells if c.table == table and c.differs]


def _parse(text: str) -> _Page:
    parsed = _Page()
    parsed.feed(text)
    parsed.close()
    return parsed


def test_the_page_marks_the_call_that_differs_and_the_missing_flush() -> None:
    failure = _failure()
    trace, text = _page(failure)
    assert trace.differs_at == 1 and len(trace.steps) == 2
    last = trace.steps[-1]
    assert last.model_snapshot is not None and last.target_snapshot is not None
    assert last.model_snapshot.pending_flushes and not last.target_snapshot.pending_flushes
    parsed = _parse(text)
    assert any("('step', 8)" in marked and "differs here" in marked for marked in parsed.marked)
    assert not any("('add'" in marked for marked in parsed.marked)
    # the model's flush, and the target's lack of one, highlighted side by side
    assert ("pending flush #0", "pending flush #0") in parsed.highlighted("call-1-transfers-model")
    assert ("pending flush #0", "absent") in parsed.highlighted("call-1-transfers-target")
    # the GPU block the flush holds: pinned by the model, freed to the queue by the target
    assert ("1", "1") in parsed.highlighted("call-1-gpu-model")
    assert ("1", "0") in parsed.highlighted("call-1-gpu-target")
    assert ("has pending stores", "yes") in parsed.highlighted("call-1-other-model")
    # the call before agrees: nothing of it is highlighted
    assert not [c for c in parsed.cells if c.table.startswith("call-0-") and c.differs]
    # the first difference at the top, exactly the lockstep's; one colour, declared once
    # a bug by the spec's own words (the implementation's state breaks FLUSH-COMPLETE), and
    # how it differs from the model
    assert trace.difference is not None and trace.difference.startswith(
        "the target breaks FLUSH-COMPLETE at call 1 ('step', 8): "
    )
    assert (
        "It differs from the model: call 1 ('step', 8): snapshots differ in ['gpu', 'cpu', "
        "'pending_flushes'" in trace.difference
    )
    words = "".join(parsed.text)
    assert words.index(trace.difference) < words.index("The program")
    assert text.count(".differs{") == 1


def test_record_gives_the_lockstep_verdict_and_applies_each_call_once() -> None:
    steps: list[int] = []

    class Counting(OffloadImpl):
        def step(self, token_budget: int) -> StepResult:
            steps.append(token_budget)
            return super().step(token_budget)

    def factory(config: OffloadConfig) -> Target:
        return Counting(config, faults=[FAULT], device="cpu", lockstep=True)

    failure = _failure()
    trace = page.record(factory, "fixed", failure.config, failure.program)
    assert steps == [8]
    assert trace.difference == lockstep.disagreement(
        adapters()[failure.adapter], "fixed", failure.config, failure.program
    )
    add, step = trace.steps
    assert add.model_outcome is None and add.target_outcome is None and add.difference is None
    assert isinstance(step.model_outcome, StepResult) and step.model_outcome == step.target_outcome


def test_a_program_that_no_longer_differs_runs_to_its_end_and_says_so() -> None:
    program: list[list[object]] = [
        *PROGRAM,
        ["drain"],
        ["add", "r2", [0, 1, 2, 3, 4], 1],
        ["step", 8],
    ]
    failure = _failure(program, adapter="impl")
    trace, text = _page(failure)
    assert trace.difference is None and trace.differs_at is None
    assert [s.n for s in trace.steps] == [0, 1, 2, 3, 4]
    parsed = _parse(text)
    assert "No longer differs" in "".join(parsed.text)
    assert not [c for c in parsed.cells if c.differs] and not parsed.marked
    # the failure file's own words are kept beside the verdict of now
    assert failure.disagreement in "".join(parsed.text)


def test_the_model_breaking_an_invariant_is_its_verdict_and_the_target_is_not_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The variant with vLLM #53498's missing flush breaks FLUSH-COMPLETE by design; held to
    # its invariants all the same, the model itself breaks on the program.
    for module in (page, lockstep):
        monkeypatch.setattr(module, "keeps_invariants", lambda variant: True)
    failure = _failure(adapter="impl")
    variant = "no-final-flush"
    trace = page.record(adapters()["impl"], variant, failure.config, failure.program)
    expected = lockstep.disagreement(adapters()["impl"], variant, failure.config, failure.program)
    assert trace.difference == expected and expected is not None
    assert expected.startswith("the model broke FLUSH-COMPLETE at call 1")
    broke = trace.steps[-1]
    assert not broke.target_asked and broke.target_snapshot is None
    assert str(broke.model_outcome).startswith("InvariantViolation: FLUSH-COMPLETE")
    text = "".join(_parse(page.render(trace, failure, "impl")).text)
    assert "The model broke its invariant FLUSH-COMPLETE at call 1." in text
    assert "not asked: the model broke an invariant on this call" in text


HOSTILE = '</td></table><script>alert(1)</script><img src=x onerror="alert(2)">'


def test_a_hostile_request_id_is_rendered_inert() -> None:
    program = [["add", HOSTILE, [0, 1, 2, 3], 1], ["step", 8]]
    failure = validate(_failure(program).to_dict() | {"disagreement": HOSTILE})
    trace, text = _page(failure)
    assert trace.differs_at == 1
    requests = trace.steps[0].model_snapshot
    assert requests is not None and requests.requests[0].request_id == HOSTILE
    parsed = _parse(page.render(trace, failure, f"{HOSTILE} label"))
    assert not parsed.tags & {"script", "img", "iframe", "object", "embed", "link", "base"}
    assert not [name for name in parsed.attributes if name.startswith("on") or name == "src"]
    # the id is text: in the program, the requests of both sides, the outcomes, the reproducer
    assert ("call-0-requests-model", HOSTILE) in [(c.table, c.text) for c in parsed.cells]
    assert ("call-0-requests-target", HOSTILE) in [(c.table, c.text) for c in parsed.cells]
    assert sum(HOSTILE in chunk for chunk in parsed.text) >= 5
    assert "<script" not in text and "&lt;script&gt;" in text


def test_the_page_is_the_same_bytes_for_the_same_failure(tmp_path: Path) -> None:
    failure = _failure()
    first = tmp_path / "first.html"
    trace = page.write_page(first, failure, adapters()[failure.adapter], "fixed", "the target")
    assert trace.differs_at == 1
    again = page.render(
        page.record(adapters()[failure.adapter], "fixed", failure.config, failure.program),
        failure,
        "the target",
    )
    assert first.read_bytes() == again.encode("utf-8")


# -- in a browser -----------------------------------------------------------------------


def _browser(tmp_path: Path, *arguments: str) -> str:
    """Run Debian's chromium headless on the arguments, with nothing that reaches out."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed here (apt-get install chromium)")
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    profile.mkdir()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ]
    done = subprocess.run(
        [chromium, *flags, *arguments], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout


@dataclass(frozen=True)
class _Image:
    width: int
    height: int
    pixels: list[bytes]  # a row of RGB triples per line

    def rgb(self, x: int, y: int) -> tuple[int, int, int]:
        row = self.pixels[y]
        return row[3 * x], row[3 * x + 1], row[3 * x + 2]


def _unfilter(kind: int, line: bytes, prior: bytes, bpp: int) -> bytes:
    """One scanline of a PNG without its filter (the five types of the PNG specification)."""
    if kind == 0:
        return line
    if kind == 2:
        # bytewise addition of two rows at once: the low seven bits add, the top bit is xored
        size = len(line)
        low, top = int.from_bytes(b"\x7f" * size, "big"), int.from_bytes(b"\x80" * size, "big")
        a, b = int.from_bytes(line, "big"), int.from_bytes(prior, "big")
        return (((a & low) + (b & low)) ^ ((a ^ b) & top)).to_bytes(size, "big")
    out = bytearray(line)
    for i in range(len(out)):
        left = out[i - bpp] if i >= bpp else 0
        up = prior[i]
        if kind == 1:
            out[i] = (out[i] + left) & 0xFF
        elif kind == 3:
            out[i] = (out[i] + ((left + up) >> 1)) & 0xFF
        elif kind == 4:
            corner = prior[i - bpp] if i >= bpp else 0
            guess = left + up - corner
            da, db, dc = abs(guess - left), abs(guess - up), abs(guess - corner)
            near = left if da <= db and da <= dc else up if db <= dc else corner
            out[i] = (out[i] + near) & 0xFF
        else:
            raise ValueError(f"PNG filter type {kind} does not exist")
    return bytes(out)


def _decode_png(data: bytes) -> _Image:
    """An 8-bit RGB or RGBA PNG, not interlaced, as RGB rows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, header, compressed = 8, b"", bytearray()
    while pos < len(data):
        (size,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + size]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            compressed += body
        pos += 12 + size
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(bytes(compressed))
    stride = width * bpp
    rows, prior = [], bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        prior = _unfilter(raw[start], raw[start + 1 : start + 1 + stride], prior, bpp)
        rows.append(prior if bpp == 3 else bytes(b for i, b in enumerate(prior) if i % 4 != 3))
    return _Image(width, height, rows)


def _lit(row: bytes, colour: bytes) -> set[int]:
    """The pixels of a row of exactly ``colour`` (a solid fill is drawn in its own colour)."""
    found, at = set(), row.find(colour)
    while at >= 0:
        if at % 3 == 0:
            found.add(at // 3)
        at = row.find(colour, at + 1)
    return found


def _highlight_blocks(image: _Image, wide: int = 30, tall: int = 8) -> list[tuple[int, int]]:
    """The top-left corner of an area of the highlight colour at least ``wide`` by ``tall``
    pixels in each band of rows that has one (a band: rows with the colour, between rows
    without)."""
    lit = [_lit(row, bytes(HIGHLIGHT)) for row in image.pixels]
    found: list[tuple[int, int]] = []
    y = 0
    while y < image.height:
        band = y
        while y < image.height and lit[y]:
            y += 1
        for top in range(band, y - tall + 1):
            # every pixel of the area lit: its rows' lit sets all hold the whole run
            area = set.intersection(*lit[top : top + tall])
            corners = [x for x in sorted(area) if all(x + d in area for d in range(wide))]
            if corners:
                found.append((corners[0], top))
                break
        y += 1
    return found


def test_a_browser_draws_the_page_with_the_difference_highlighted(tmp_path: Path) -> None:
    failure = _failure()
    where = tmp_path / "failure.html"
    page.write_page(where, failure, adapters()[failure.adapter], "fixed", failure.adapter)
    dom = _parse(_browser(tmp_path, "--dump-dom", where.as_uri()))
    assert any("('step', 8)" in marked and "differs here" in marked for marked in dom.marked)
    assert ("pending flush #0", "absent") in dom.highlighted("call-1-transfers-target")
    assert ("pending flush #0", "pending flush #0") in dom.highlighted("call-1-transfers-model")

    shot = tmp_path / "failure.png"
    _browser(tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", where.as_uri())
    image = _decode_png(shot.read_bytes())
    assert (image.width, image.height) == (1400, 2000)
    sample = [image.rgb(x, y) for y in range(0, image.height, 7) for x in range(0, image.width, 7)]
    white = sum(colour == (255, 255, 255) for colour in sample)
    assert len(set(sample)) > 20, "the page is blank or flat"
    assert 0.02 < 1 - white / len(sample) < 0.9, "hardly anything (or everything) drawn"
    # the highlighted cells of the call that differs, solid blocks the size of a table cell
    # in several bands of rows (the legend's swatch, around its word, makes no such block),
    # and far less than the whole page
    blocks = _highlight_blocks(image)
    assert len(blocks) >= 3, blocks
    lit = sum(colour == HIGHLIGHT for colour in sample)
    assert 0 < lit < 0.1 * len(sample)


def test_the_page_of_53498_on_vllm_0_29_shows_the_missing_flush(tmp_path: Path) -> None:
    """vLLM issue #53498's missing final flush, as the machine shrinks it on 0.29.0 itself
    (docs/upstream.md): `kvoffload replay --html` replays it in the release's own process and
    the browser draws the flush the model queues and vLLM does not."""
    import json

    from kvoffload.main import main
    from kvoffload.upstream.install import Cache, default_cache

    if not Cache(default_cache()).installed("0.29.0"):
        pytest.skip("vllm==0.29.0 is not installed: kvoffload install vllm==0.29.0")
    source = tmp_path / "vllm-0.29.0-bug-53498-primary-only.json"
    source.write_text(
        json.dumps(
            {
                "adapter": "vllm",
                "release": "0.29.0",
                # the fixed model with 0.29.0's other bug of #53498, so that the flush shows
                "variant": "primary-only",
                "config": CONFIG,
                "program": [["add", "r0", [0, 1, 2], 2], ["step", 8], ["drain"], ["step", 8]],
                "disagreement": "call 3 ('step', 8): snapshots differ in ['pending_flushes']",
            }
        )
    )
    where = tmp_path / "53498.html"
    assert main(["replay", str(source), "--html", str(where)]) == 1
    dom = _parse(_browser(tmp_path, "--dump-dom", where.as_uri()))
    assert any("('step', 8)" in marked and "differs here" in marked for marked in dom.marked)
    assert ("pending flush #0", "absent") in dom.highlighted("call-3-transfers-target")
    assert ("pending flush #0", "pending flush #0") in dom.highlighted("call-3-transfers-model")
    text = where.read_text()
    assert "vllm==0.29.0" in text and "pending_flushes" in text
    shot = tmp_path / "53498.png"
    _browser(tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", where.as_uri())
    assert len(_highlight_blocks(_decode_png(shot.read_bytes()))) >= 3
