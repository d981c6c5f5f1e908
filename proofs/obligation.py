"""Proof obligations and their outcome.

An obligation is a z3 query with an expected answer: ``unsat`` for a lemma (its negation has
no model: proved), or ``sat`` for a demonstration (a concrete state that shows a behaviour,
printed to the user). Anything else is a failure: a counterexample to a lemma, no witness
for a demonstration, or ``unknown``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import z3

TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class Obligation:
    name: str
    statement: str
    build: Callable[[z3.Solver], None]
    expect: str = "unsat"  # "unsat": a lemma; "sat": a demonstration with a witness


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str  # "proved", "shown", "counterexample", "no witness", "unknown"
    seconds: float
    model: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("proved", "shown")


def render(model: z3.ModelRef, limit: int = 800) -> str:
    """The named Boolean and integer facts of a model, one per line (a readable witness)."""
    facts = []
    for decl in model.decls():
        value = model[decl]
        if decl.arity() == 0 and (z3.is_bool(value) or z3.is_int_value(value)):
            facts.append(f"{decl.name()} = {value}")
    text = "\n".join(sorted(facts)) or str(model)
    return text if len(text) <= limit else text[:limit] + " ..."


def check(obligation: Obligation, timeout_ms: int = TIMEOUT_MS) -> Outcome:
    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    obligation.build(solver)
    start = time.perf_counter()
    answer = solver.check()
    seconds = time.perf_counter() - start
    if answer == z3.unknown:
        return Outcome(obligation.name, "unknown", seconds, solver.reason_unknown())
    if obligation.expect == "unsat":
        if answer == z3.unsat:
            return Outcome(obligation.name, "proved", seconds)
        return Outcome(obligation.name, "counterexample", seconds, render(solver.model()))
    if answer == z3.sat:
        return Outcome(obligation.name, "shown", seconds, render(solver.model()))
    return Outcome(obligation.name, "no witness", seconds)
