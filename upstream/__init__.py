"""Campaigns over vLLM's releases (``docs/upstream.md``, ``docs/history.md``), above the machine
(:mod:`kvoffload.testing`) and the vLLM target (:mod:`kvoffload.vllm_target`).

- ``install``: a chosen vLLM release in a cache folder outside the project's environment (the
  wheel without its dependencies, over the CPU torch, plus the few small packages its
  scheduler-side modules import), reused when present. vLLM is never a dependency of
  kvoffload: what needs it runs in the cache's own interpreter.
- ``check``: ``kvoffload verify --target vllm==X``, each release held to its row of
  :mod:`kvoffload.vllm_target.releases`.
- ``bugs``, ``history``: the historical bugs and ``kvoffload history``.
- ``reach``: how much of vLLM's offload code a campaign reaches.
- ``schedbench``: the scheduler trace of ``kvoffload bench`` through vLLM's own objects.
"""
