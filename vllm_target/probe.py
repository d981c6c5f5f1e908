"""``python -m kvoffload.vllm_target.probe``, run in a release's environment: build vLLM's
offload objects for a few configurations and print what vLLM made of them, as JSON lines.
Checks the recipe of :mod:`kvoffload.vllm_target.world` against a release."""

from __future__ import annotations

import json

from kvoffload.model import OffloadConfig
from kvoffload.vllm_target.world import build, describe, supported

CONFIGS = [
    OffloadConfig(8, 4, (4,), 4, 1),
    OffloadConfig(10, 6, (4, 8), 4, 2),
    OffloadConfig(8, 5, (8,), 8, 1),
    OffloadConfig(8, 5, (8,), 4, 1),
]


def main() -> None:
    for config in CONFIGS:
        reason = supported(config)
        result = {"unsupported": reason} if reason else describe(build(config))
        print(json.dumps({"config": [config.gpu_blocks, config.cpu_blocks]} | result))


if __name__ == "__main__":
    main()
