"""vLLM's own scheduler-side offload code under the conformance machine.

``install`` puts a chosen vLLM release into a cache folder outside the project's environment
(the wheel without its dependencies, over the CPU torch, plus the few small packages its
scheduler-side modules import) and reuses it when present. vLLM is never a dependency of
kvoffload: what needs it runs in the cache's own interpreter.
"""
