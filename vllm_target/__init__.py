"""vLLM's own offload code as a target of the conformance machine, beside :mod:`kvoffload.impl`
(``docs/upstream.md``). It imports the model and vLLM, nothing of the machine.

- ``world``: vLLM's GPU ``BlockPool`` and ``SimpleCPUOffloadScheduler`` built from an
  ``OffloadConfig``; every difference between releases the adapter meets.
- ``engine``, ``keymap``, ``offload``: the model's engine over vLLM's objects, and the driver
  API and snapshot the machine compares (the target ``vllm``).
- ``scheduler``: vLLM's own ``Scheduler`` with the connector its factory builds (the target of
  the scheduler machine, :mod:`kvoffload.testing.scheduler_machine`).
- ``releases``, ``forms``: what each release is expected to do, and the forms a vLLM target
  takes on the command line (a release, a tree, the current environment).
- ``probe``: run in a release's environment, says whether vLLM's objects build there.
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
