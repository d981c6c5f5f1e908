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

import logging as _logging
import os as _os

# vLLM logs from some modules before its own logging is set up (its platform detection, on a
# tree that is not installed): those records reach Python's last-resort handler whatever
# VLLM_LOGGING_LEVEL says, and surround every verdict. The level that variable names (ERROR in
# a release's process, unless the user set another: kvoffload.upstream.install.run_variables)
# holds for vLLM's loggers from the first import of this package, before vLLM's.
if _os.environ.get("VLLM_LOGGING_LEVEL"):
    _logging.getLogger("vllm").setLevel(_os.environ["VLLM_LOGGING_LEVEL"].upper())
