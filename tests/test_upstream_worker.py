"""vLLM 0.34.0's own offload worker under the machine (issue 33): its SimpleCPUOffloadWorker on
every rank, unmodified, beside vLLM's own scheduler, on the emulated device
(kvoffload.vllm_target.device), KV caches planned and allocated by vLLM's own code, every
block's bytes and every forward's reads checked (kvoffload.vllm_target.worker).

The programs run where vLLM 0.34.0 is installed, in its release environment. The faults are
planted in the running vLLM's worker code (its functions replaced in the release's process),
each a class of bug the worker can have: the machine must find every one by itself."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from test_upstream_scheduler import CPU_HIT, SHARED

from kvoffload.testing.failure import WORKER, load, validate
from kvoffload.vllm_target.worker import LAYOUTS, WorkerLayout

from helpers import found_in_release

VARIANT = "inclusive-cpu+window-stale-ids+reset-gpu-only"  # 0.34.0's row

# (configuration, program, layout): stores, a CPU hit loaded back and read by the forward,
# over every physical layout vLLM's planner has, heads split across regions, several ranks,
# two groups of other block sizes, the disk backend.
CASES = [
    ("OffloadConfig(6, 16, (4,), 4, 2)", CPU_HIT, WorkerLayout(2, 2, 4, "LHBNC", "disk")),
    ("OffloadConfig(12, 16, (4, 8), 4)", CPU_HIT, WorkerLayout(1, 1, 4, "BLHNC", "disk")),
    ("OffloadConfig(6, 16, (4,), 4)", CPU_HIT, WorkerLayout()),
    ("OffloadConfig(6, 16, (4,), 4, 2)", CPU_HIT, WorkerLayout(2, 2, 4, "LHBNC")),
    ("OffloadConfig(6, 16, (4,), 4, 3, lazy=True)", CPU_HIT, WorkerLayout(3, 2, 2, "BLHNC")),
    ("OffloadConfig(12, 16, (4, 8), 4, 2)", CPU_HIT, WorkerLayout(2, 1, 4, "BLNHC")),
    ("OffloadConfig(16, 16, (4, 8), 4)", SHARED, WorkerLayout(1, 2, 4, "BLHNC")),
    *[
        ("OffloadConfig(6, 16, (8,), 8, 2)", CPU_HIT, WorkerLayout(2, 2, 2, name))
        for name in LAYOUTS
    ],
]

# Faults planted in vLLM's worker (name -> the Python that plants it in the release's
# process), each found by a short campaign of the worker machine.
PLANTED = {
    # a worker that reports its transfers without asking whether they are done
    "poll-ignores-query": """
        def poll(self, is_store):
            events = self._store_events if is_store else self._load_events
            hwm = self._store_hwm if is_store else self._load_hwm
            while events:
                hwm = events.pop(0)[0]
            setattr(self, "_store_hwm" if is_store else "_load_hwm", hwm)
            return hwm
        worker.SimpleCPUOffloadWorker._poll_stream_events = poll
    """,
    # a copy that reads the destination's blocks for its source
    "copy-reads-the-wrong-blocks": """
        copy = cuda_mem_ops.copy_blocks
        copy_backend.copy_blocks = lambda src, dst, params: copy(dst, dst, params)
    """,
    # a block stride of half a block: half of every page is never copied (S17's class)
    "half-a-block-copied": """
        build = cuda_mem_ops.build_params
        def half(*args, **kwargs):
            params = build(*args, **kwargs)
            return params._replace(bpb=params.bpb // 2)
        copy_backend.build_params = half
    """,
    # loads reported done as soon as they are sent
    "loads-reported-early": """
        finished = worker.SimpleCPUOffloadWorker.get_finished
        def early(self, ids):
            meta = self._connector_metadata
            sending, receiving = finished(self, ids)
            receiving = set(receiving or ())
            for event in list(self._pending_load_event_indices):
                self._pending_load_event_indices.discard(event)
                receiving.update(meta.load_event_to_reqs.get(event, ()) if meta else ())
            return sending, receiving or None
        worker.SimpleCPUOffloadWorker.get_finished = early
    """,
    # the disk backend writing a staging buffer before its copy from the GPU ran (S18's
    # class: staged DMA and file I/O out of order)
    "disk-writes-before-its-copy": """
        def store(self, gpu_blocks, disk_slots, stream):
            staged = [None] * self._num_buffer_slots
            for i, (gpu_block, disk_slot) in enumerate(zip(gpu_blocks, disk_slots)):
                slot = i % self._num_buffer_slots
                if staged[slot] is not None:
                    self._writev_slot(slot, staged[slot])
                disk_backend.copy_blocks([gpu_block], [slot], self._store_params)
                staged[slot] = disk_slot * self._total_block_bytes
            for slot, offset in enumerate(staged):
                if offset is not None:
                    self._writev_slot(slot, offset)
        disk_backend.DiskBackend._do_store = store
    """,
    # a preempting step that does not wait for the transfers in flight (need_flush ignored)
    "no-flush-at-preemption": """
        worker.SimpleCPUOffloadWorker.handle_preemptions = lambda self, metadata: None
    """,
    # a step without a forward that drops its stores (S16's class: the save skipped)
    "no-forward-drops-stores": """
        post = kv_connector.ActiveKVConnector.post_forward
        def no_forward(self, scheduler_output):
            self.pre_forward(scheduler_output)
            self.finish_forward()
            out = post(self, scheduler_output.finished_req_ids, defer_finalize=True)
            self.kv_connector.clear_connector_metadata()
            return ModelRunnerOutput.with_kv_conn_output_only(out)
        kv_connector.ActiveKVConnector.no_forward = no_forward
    """,
}
IMPORTS = """
    import vllm.v1.simple_kv_offload.copy_backend as copy_backend
    import vllm.v1.simple_kv_offload.cuda_mem_ops as cuda_mem_ops
    import vllm.v1.simple_kv_offload.disk_backend as disk_backend
    import vllm.v1.simple_kv_offload.worker as worker
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu import kv_connector
"""


def test_vllms_worker_moves_every_byte_as_the_model_says() -> None:
    """Each call's result, the snapshot and every KV byte agree on every layout."""
    script = textwrap.dedent(
        f"""
        import json
        from kvoffload.model import OffloadConfig
        from kvoffload.testing.scheduler_lockstep import first_difference
        from kvoffload.vllm_target.worker import WorkerLayout
        for config, program, layout in {[(c, p, tuple(w)) for c, p, w in CASES]!r}:
            found = first_difference(
                eval(config), program, {VARIANT!r}, workers=WorkerLayout(*layout)
            )
            print(json.dumps({{"found": found}}))
        """
    )
    found = found_in_release("0.34.0", script)
    assert found == [None] * len(CASES), found


# What the faults replace, put back after each (one process for them all: vLLM imports once).
PLANTED_ON = [
    ("worker.SimpleCPUOffloadWorker", "_poll_stream_events"),
    ("worker.SimpleCPUOffloadWorker", "get_finished"),
    ("worker.SimpleCPUOffloadWorker", "handle_preemptions"),
    ("copy_backend", "copy_blocks"),
    ("copy_backend", "build_params"),
    ("kv_connector.ActiveKVConnector", "no_forward"),
    ("disk_backend.DiskBackend", "_do_store"),
]


def test_every_fault_planted_in_vllms_worker_is_found() -> None:
    """A short campaign of the worker machine (the ci stream, no shrinking) finds each
    planted fault by itself; vLLM's code is put back as it was after each fault."""
    script = textwrap.dedent(IMPORTS) + textwrap.dedent(
        f"""
        import json
        import textwrap
        from hypothesis import Phase, settings
        from kvoffload.testing import profiles
        from kvoffload.testing.scheduler_machine import run_scheduler_check

        places = [(eval(owner), name) for owner, name in {PLANTED_ON!r}]
        kept = [(owner, name, getattr(owner, name)) for owner, name in places]
        profile = settings(profiles.get("ci"), max_examples=1000, phases=[Phase.generate])
        for fault in {list(PLANTED.values())!r}:
            exec(textwrap.dedent(fault))
            result = run_scheduler_check({VARIANT!r}, profile, None, workers=True)
            print(json.dumps({{"found": result["disagreement"]}}))
            for owner, name, value in kept:
                setattr(owner, name, value)
        """
    )
    found = found_in_release("0.34.0", script)
    escaped = [name for name, f in zip(PLANTED, found, strict=True) if f is None]
    assert not escaped, f"faults the worker machine does not find: {escaped}"


# A worker machine's failure as its file holds it (the model alone; a test adds the rest).
FAILURE = {
    "format": 2,
    "machine": WORKER,
    "adapter": "model",
    "variant": "fixed",
    "config": {
        "gpu_blocks": 4,
        "cpu_blocks": 2,
        "group_block_sizes": [4],
        "hash_block_size": 4,
        "world_size": 1,
    },
    "program": [["add", "r0", [0, 1, 2, 3], 1]],
    "disagreement": "call 0 ('add', 'r0', [0, 1, 2, 3], 1): planted",
    "whole_sequence_admission": True,
    "workers": WorkerLayout()._asdict(),
}


def test_a_worker_machines_failure_is_one_format_with_its_layout() -> None:
    """The worker machine's failure records its layout; a file without one, or with one out
    of bounds, is refused naming the field; the reproducer rebuilds the layout."""
    data = FAILURE | {
        "adapter": "vllm",
        "variant": VARIANT,
        "release": "0.34.0",
        "target": {"kind": "release", "version": "0.34.0"},
        "program": [["add", "r0", [0, 1, 2, 3], 1], ["step", 8, True]],
        "disagreement": "call 1 ('step', 8, True): the model returned 1, vLLM's scheduler 2",
        "workers": {"layers": 2, "heads": 2, "head_size": 4, "layout": "LHBNC"},
    }
    failure = validate(data)
    assert failure.workers == WorkerLayout(2, 2, 4, "LHBNC")
    assert failure.file_name.startswith("worker-vllm-0.34.0-")
    assert validate(json.loads(json.dumps(failure.to_dict()))) == failure
    assert (
        "workers=WorkerLayout(layers=2, heads=2, head_size=4, layout='LHBNC', backend='cpu')"
        in failure.reproducer()
    )
    assert "from kvoffload.vllm_target.worker import WorkerLayout" in failure.reproducer()
    for workers, words in (
        (None, "workers must be an object"),
        ({"layers": 9, "heads": 1, "head_size": 4, "layout": "LBHNC"}, "layers must be"),
        ({"layers": 1, "heads": 1, "head_size": 4, "layout": "XYZ"}, "layout must be one of"),
        ({"layers": 1, "heads": 1, "head_size": 4}, "layout"),
        ({"layers": 1, "heads": 1, "head_size": 4, "layout": "LBHNC", "backend": "nfs"}, "backend"),
    ):
        with pytest.raises(ValueError, match=words):
            validate(data | {"workers": workers})
    with pytest.raises(ValueError, match="for the worker machine only"):
        validate(data | {"machine": "scheduler"})


def test_a_worker_failure_file_loads_as_it_was_saved(tmp_path: Path) -> None:
    """A failure of the worker machine on the model alone, saved as a file, loads as it was,
    and its regression test names its machine and rebuilds its layout."""
    failure = validate(FAILURE)
    path = tmp_path / failure.file_name
    path.write_text(json.dumps(failure.to_dict()))
    assert load(path) == failure
    test = failure.regression_test()
    assert "def test_regression_worker_model" in test
    assert "layout='LBHNC', backend='cpu')" in test
    assert "from kvoffload.vllm_target.worker import WorkerLayout" in test
