"""kvoffload.impl: the real offload implementation on torch (to come; see the issues)."""
