"""vLLM's own scheduler-side offload code under the conformance machine (``docs/upstream.md``).

- ``install``: a chosen vLLM release in a cache folder outside the project's environment (the
  wheel without its dependencies, over the CPU torch, plus the few small packages its
  scheduler-side modules import), reused when present. vLLM is never a dependency of
  kvoffload: what needs it runs in the cache's own interpreter.
- ``vllm_world``: vLLM's GPU ``BlockPool`` and ``SimpleCPUOffloadScheduler`` built from an
  ``OffloadConfig``; every difference between releases the adapter meets.
- ``engine``, ``keymap``, ``target``: the model's engine over vLLM's objects, and the driver
  API and snapshot the machine compares (the adapter ``vllm``).
- ``releases``, ``check``: what each release is expected to do, and
  ``kvoffload verify --target vllm==X``.
"""
