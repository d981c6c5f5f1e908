"""kvoffload: an executable specification, implementation and proof kit for KV-cache CPU
offloading in LLM serving. See ``kvoffload.model`` for the specification."""

__version__ = "0.1.0"
