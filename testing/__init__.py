"""kvoffload.testing: conformance testing of offload implementations against the model.

- :mod:`.lockstep`: one program of driver calls, run on the model and an implementation side
  by side, compared after every call;
- :mod:`.adapters`: the protocol an implementation satisfies, and the adapters known;
- :mod:`.stateful`: the reusable Hypothesis state machine, parameterized by an adapter;
- :mod:`.campaign`: ``kvoffload verify``, the mutation matrix, ``kvoffload replay``.
"""
