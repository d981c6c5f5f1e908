"""The two bugs of vLLM issue #53498 as variants of the model.

Each variant overrides one step of :class:`~kvoffload.model.offload.OffloadScheduler`
and reproduces what vLLM did before PR #53532. ``check()`` names the invariant each one
breaks:

- ``bug-53498-phantom-primary``: CPU blocks are stamped with the GPU block's primary at
  allocation and the primary is then inserted through ``insert_block_hash`` without
  ``reset_hash``. Guard 1 returns early, so the primary never enters the map: the stored
  block is reachable by its secondary keys only. Caught by REGISTERED and POOL-PRIMARY.
- ``bug-53498-no-final-flush``: finishing a request queues nothing, so blocks confirmed
  after its last scan are never stored. Caught by FLUSH-COMPLETE.
"""

from __future__ import annotations

from kvoffload.model.block_pool import Block
from kvoffload.model.engine import Request
from kvoffload.model.offload import OffloadScheduler, Transfer


class PhantomPrimaryScheduler(OffloadScheduler):
    """vLLM #53498, bug 1: stamp at allocation, insert without ``reset_hash``.

    Registration at completion is the fixed code's (primary first, then secondaries); with
    the stamp in place, guard 1 of ``insert_block_hash`` turns the primary insert into a
    no-op, which is the whole bug.
    """

    def allocate_store_destinations(self, gpu_ids: list[int]) -> list[Block]:
        cpu_blocks = self.cpu_pool.get_new_blocks(len(gpu_ids))
        for gpu_id, cpu_block in zip(gpu_ids, cpu_blocks, strict=True):
            # A direct write, as vLLM <= 0.29.0 did: no token count, no map entry.
            cpu_block.block_hash = self.gpu_pool.blocks[gpu_id].block_hash
        return cpu_blocks

    def _release_transfer_refs(self, transfer: Transfer) -> None:
        for block_id in transfer.cpu_block_ids:
            self.cpu_pool.blocks[block_id].reset_hash()
        super()._release_transfer_refs(transfer)


class NoFinalFlushScheduler(OffloadScheduler):
    """vLLM #53498, bug 2: a finished request's unscanned confirmed blocks are dropped."""

    def _queue_finished_eager_store(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> Transfer | None:
        return None


VARIANTS: dict[str, type[OffloadScheduler]] = {
    "fixed": OffloadScheduler,
    "bug-53498-phantom-primary": PhantomPrimaryScheduler,
    "bug-53498-no-final-flush": NoFinalFlushScheduler,
}
