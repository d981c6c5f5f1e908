"""kvoffload.impl: the offload implementation on torch.

:class:`OffloadImpl` has the model's driver API and snapshot; its workers keep KV bytes in
device tensors and copy them to and from (pinned) host memory. :data:`FAULTS` lists the
fault variants.
"""

from kvoffload.impl.driver import OffloadImpl, default_device
from kvoffload.impl.faults import FAULTS
from kvoffload.impl.worker import KVLayout

__all__ = ["FAULTS", "KVLayout", "OffloadImpl", "default_device"]
