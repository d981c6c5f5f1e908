"""The implementation's input checks, as one component the fault catalogue can weaken.

Every check is the shared driver contract of :mod:`kvoffload.model.validate` (the same bad
input raises the same error on every driver, before anything changes); this class only
gathers the ones ``OffloadImpl`` makes, so that a fault can override one of them and the
conformance machine's misuse rule must find it.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvoffload.model.config import OffloadConfig
from kvoffload.model.validate import require_completion, require_new_request


class Validation:
    def __init__(self, config: OffloadConfig) -> None:
        self.config = config

    def new_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        known: Container[str],
        skip_reading_prefix_cache: object = False,
    ) -> tuple[int, ...]:
        """A request to add: valid tokens, fits the GPU pool alone, an unused id, a bool
        flag."""
        return require_new_request(
            self.config, request_id, prompt, max_tokens, known, skip_reading_prefix_cache
        )

    def completion(
        self, kind: str, event: int, worker: int, counter: int, reported: set[int]
    ) -> None:
        """A worker's report: an issued event, a worker in range that has not reported it."""
        require_completion(self.config, kind, event, worker, counter, reported)
