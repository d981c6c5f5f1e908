"""kvoffload.proofs: z3 proofs of the model's invariants and CrossHair contracts.

- :mod:`.registration`: the registration-ordering lemma of vLLM #53498;
- :mod:`.transitions`: inductive invariants of the pool and offload transition system, for
  any number of blocks, one query per transition;
- :mod:`.arithmetic`: range and alignment lemmas over unbounded integers;
- the contracts of :mod:`kvoffload.model.arith` and :mod:`kvoffload.model.keys`, checked by
  CrossHair in the test suite.

``kvoffload prove`` runs the z3 obligations; ``docs/proofs.md`` says what each establishes.
"""

from kvoffload.proofs.obligation import Obligation, Outcome, check
from kvoffload.proofs.run import all_obligations, run_prove

__all__ = ["Obligation", "Outcome", "all_obligations", "check", "run_prove"]
