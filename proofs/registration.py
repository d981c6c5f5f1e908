"""The registration-ordering lemma of vLLM #53498, with ``_insert_block_hash`` as it is.

One CPU block, fresh from ``get_new_blocks`` (no primary, no key mapped, no secondary), and
symbolic keys: the GPU block's primary ``P`` and two secondary keys ``S1``, ``S2`` (any of
them may be equal). The block's state is its primary (``has``, ``pk``), the keys mapped to it
(``mapped``, the pairs ``(key, block)`` of the pool's map) and its secondary set (``sec``).

- stamp the primary at allocation, then insert ``P``, ``S1``, ``S2``: ``P`` is not mapped
  (z3 shows the state);
- stamp, ``reset_hash``, insert ``P`` then the secondaries: every key is mapped and ``P``
  is the primary (proved);
- no stamp, insert ``P`` then the secondaries: the same (proved);
- on a hashless block, a secondary inserted before ``P`` becomes the primary (shown).
"""

from __future__ import annotations

from dataclasses import dataclass

import z3

from kvoffload.proofs.obligation import Obligation

Key = z3.DeclareSort("Key")


@dataclass(frozen=True)
class BlockState:
    has: z3.BoolRef
    pk: z3.ExprRef
    mapped: z3.ArrayRef  # Key -> Bool: the pair (key, this block) is in the map
    sec: z3.ArrayRef  # Key -> Bool


def fresh(tag: str) -> BlockState:
    k = z3.Const(f"k_{tag}", Key)
    return BlockState(
        z3.BoolVal(False),
        z3.Const(f"pk0_{tag}", Key),
        z3.Lambda([k], z3.BoolVal(False)),
        z3.Lambda([k], z3.BoolVal(False)),
    )


def insert_block_hash(s: BlockState, key: z3.ExprRef, guard_one: bool = True) -> BlockState:
    """vLLM's ``_insert_block_hash(key, block)``."""
    stamped = z3.And(s.has, s.pk == key) if guard_one else z3.BoolVal(False)
    skip = z3.Or(stamped, s.mapped[key])  # guard 1, guard 2
    becomes_primary = z3.Not(s.has)
    return BlockState(
        z3.If(skip, s.has, z3.BoolVal(True)),
        z3.If(z3.Or(skip, z3.Not(becomes_primary)), s.pk, key),
        z3.If(skip, s.mapped, z3.Store(s.mapped, key, True)),
        z3.If(z3.Or(skip, becomes_primary), s.sec, z3.Store(s.sec, key, True)),
    )


def stamp(s: BlockState, key: z3.ExprRef) -> BlockState:
    """A direct write of the primary, as vLLM <= 0.29.0 did at allocation."""
    return BlockState(z3.BoolVal(True), key, s.mapped, s.sec)


def reset_hash(s: BlockState) -> BlockState:
    return BlockState(z3.BoolVal(False), s.pk, s.mapped, s.sec)


P, S1, S2 = z3.Consts("P S1 S2", Key)


def _register(s: BlockState, guard_one: bool = True) -> BlockState:
    for key in (P, S1, S2):
        s = insert_block_hash(s, key, guard_one)
    return s


def all_reachable(s: BlockState) -> z3.BoolRef:
    return z3.And(s.mapped[P], s.mapped[S1], s.mapped[S2], s.has, s.pk == P)


def observe(solver: z3.Solver, s: BlockState) -> None:
    """Name the final state's facts, so that a witness prints them."""
    solver.add(z3.Bool("final_primary_is_P") == z3.And(s.has, s.pk == P))
    solver.add(z3.Bool("final_primary_is_S1") == z3.And(s.has, s.pk == S1))
    for name, key in (("P", P), ("S1", S1), ("S2", S2)):
        solver.add(z3.Bool(f"{name}_mapped") == s.mapped[key])
        solver.add(z3.Bool(f"{name}_secondary") == s.sec[key])


def _stamp_then_insert(solver: z3.Solver, guard_one: bool = True) -> None:
    final = _register(stamp(fresh("a"), P), guard_one)
    solver.add(S1 != P, S2 != P, S1 != S2, z3.Not(final.mapped[P]))
    observe(solver, final)


def _reset_then_insert(solver: z3.Solver, guard_one: bool = True) -> None:
    solver.add(z3.Not(all_reachable(_register(reset_hash(stamp(fresh("b"), P)), guard_one))))


def _no_stamp(solver: z3.Solver) -> None:
    solver.add(z3.Not(all_reachable(_register(fresh("c")))))


def _secondary_first(solver: z3.Solver) -> None:
    final = insert_block_hash(insert_block_hash(fresh("d"), S1), P)
    solver.add(S1 != P, final.pk != P, final.sec[P])
    observe(solver, final)


OBLIGATIONS = [
    Obligation(
        "registration: stamp, then insert",
        "stamping the primary at allocation, then inserting it, leaves it unmapped",
        _stamp_then_insert,
        expect="sat",
    ),
    Obligation(
        "registration: reset_hash, insert primary, then secondaries",
        "every key is mapped and the primary is the GPU block's",
        _reset_then_insert,
    ),
    Obligation(
        "registration: no stamp, insert primary, then secondaries",
        "every key is mapped and the primary is the GPU block's",
        _no_stamp,
    ),
    Obligation(
        "registration: secondary before primary on a hashless block",
        "the secondary becomes the primary and the GPU primary a secondary",
        _secondary_first,
        expect="sat",
    ),
]
