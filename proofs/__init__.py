"""kvoffload.proofs: z3 proofs and CrossHair contracts of the model (to come; see the issues)."""
