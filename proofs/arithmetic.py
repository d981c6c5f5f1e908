"""Arithmetic lemmas over unbounded integers: the ranges the offload scheduler computes
stay where they must, for every block size, alignment and token count.

Names: ``S`` the scheduler block size, ``B`` a group block size dividing it, ``H`` the hash
block size dividing ``B``, ``C`` computed tokens, ``T`` a request's tokens, ``n`` a group's
cursor (blocks stored or skipped so far), ``m`` a prefill's end (in the Mamba lemmas).
"""

from __future__ import annotations

import z3

from kvoffload.proofs.obligation import Obligation

S, B, C, T, n, i = z3.Ints("S B C T n i")
q, m, p, h, A = z3.Ints("q m p h A")
external, computed, hit, free, picked = z3.Ints("external computed hit free picked")


def _sizes() -> z3.BoolRef:
    return z3.And(S > 0, B > 0, S % B == 0, C >= 0)


def ceil_div(a: z3.ArithRef, d: z3.ArithRef) -> z3.ArithRef:
    return (a + d - 1) / d


def aligned(tokens: z3.ArithRef, alignment: z3.ArithRef) -> z3.ArithRef:
    return tokens / alignment * alignment


def _flush_in_allocated(solver: z3.Solver) -> None:
    # Final flush: blocks [n, aligned(C, S) / B) of the block table clipped to the computed
    # tokens, which holds ceil(C / B) blocks.
    ready = aligned(C, S) / B
    solver.add(_sizes(), z3.Not(ready <= ceil_div(C, B)))


def _flush_blocks_are_full(solver: z3.Solver) -> None:
    ready = aligned(C, S) / B
    solver.add(_sizes(), i >= 0, i < ready, z3.Not((i + 1) * B <= C))


def _flush_disjoint_from_stored(solver: z3.Solver) -> None:
    # Blocks below the cursor were stored or skipped; the flush starts at the cursor.
    ready = aligned(C, S) / B
    solver.add(_sizes(), n >= 0, i >= 0, i < n, n <= i, i < ready)


def _group_alignment_exact(solver: z3.Solver) -> None:
    # Scheduler-aligned token counts (A = q * S) split into whole blocks of every group whose
    # size divides S (S = m * B): A = (q * m) * B. Divisibility is stated by its witnesses,
    # which keeps the query a ring identity.
    solver.add(B > 0, m > 0, m * B == S, q * S == A, z3.Not((q * m) * B == A))


def _load_destinations_in_range(solver: z3.Solver) -> None:
    # A load of ``external`` tokens after ``computed`` local ones writes group blocks
    # [computed / B, computed / B + ceil(external / B)) of a table that covers
    # ceil((computed + external) / B) blocks; both counts are multiples of S.
    start = computed / B
    end = start + ceil_div(external, B)
    solver.add(
        S > 0,
        B > 0,
        S % B == 0,
        computed >= 0,
        external > 0,
        computed % S == 0,
        external % S == 0,
        z3.Not(z3.And(start >= 0, end <= ceil_div(computed + external, B))),
    )


def _capacity(solver: z3.Solver) -> None:
    # One selection takes ``picked <= free`` blocks and the pool then has ``free - picked``:
    # never negative, so get_new_blocks never asks for more than is free.
    solver.add(free >= 0, picked >= 0, picked <= free, z3.Not(free - picked >= 0))


def _lookup_cap(solver: z3.Solver) -> None:
    # The hit is capped at T - 1 - computed and aligned down: the last token is recomputed,
    # and the hit ends on a scheduler block boundary.
    limit = T - 1 - computed
    solver.add(
        S > 0,
        computed >= 0,
        computed == p * S,
        limit > 0,
        hit >= 0,
        hit <= limit,
        hit == h * S,
        z3.Not(z3.And(computed + hit < T, computed + hit == (p + h) * S)),
    )


def _mamba_load_is_the_allocated_state(solver: z3.Solver) -> None:
    # A Mamba CPU hit after ``computed`` local tokens (a multiple of S, so of B) is i nulls and
    # one state: ``external = (i + 1) * B``. The load writes table position computed / B + i;
    # the allocation for the external range pads the table with nulls to
    # ceil((computed + external) / B) - 1 and takes that last position.
    solver.add(
        B > 0,
        p >= 0,
        i >= 0,
        computed == p * B,
        external == (i + 1) * B,
        z3.Not(computed / B + i == ceil_div(computed + external, B) - 1),
    )


def _mamba_keeps_its_running_state(solver: z3.Solver) -> None:
    # After ``C >= 1`` computed tokens a Mamba table frees every position below (C - 1) / B
    # (the tokens before the last one are skipped); the running state's block sits at
    # ceil(C / B) - 1, which is never below that, and the block it was copied from, one
    # position before, is freed exactly when the state has moved past it.
    solver.add(B > 0, C >= 1, z3.Not(ceil_div(C, B) - 1 == (C - 1) / B))


def _mamba_chunk_ends_on_a_state(solver: z3.Solver) -> None:
    # A prefill chunk from ``computed`` of ``q`` tokens that ends before the prefill's end
    # (m) is cut to end on a block boundary: end = (computed + q) / S * S; when that end is
    # past the start, the state it writes is a whole block's (arith.mamba_chunk).
    end = aligned(computed + q, S)
    solver.add(
        S > 0,
        computed >= 0,
        q > 0,
        computed + q < m,
        end > computed,
        z3.Not(z3.And(end % S == 0, end <= computed + q, end < m)),
    )


def _tail_block_in_the_flushed_table(solver: z3.Solver) -> None:
    # The final flush's prompt tail: a boundary ``b`` (a multiple of the hash block H) with
    # 0 < b <= C that is no block boundary sits in block b / B of the table clipped to the
    # computed tokens, which holds ceil(C / B) blocks (vLLM's `block_idx >= len(...)` guard
    # never fires under its scheduler: docs/upstream.md).
    b = A
    solver.add(B > 0, h > 0, b == q * h, b > 0, b <= C, b % B != 0, z3.Not(b / B < ceil_div(C, B)))


def _tail_hash_within_the_hashes(solver: z3.Solver) -> None:
    # The tail's boundary min((P - 1) / H, k) * H, with k hashed blocks, is at most k hash
    # blocks: its hash index b / H - 1 is below k (vLLM's `hash_idx >= len(...)` is dead).
    b = z3.If((T - 1) / h < n, (T - 1) / h, n) * h
    solver.add(h > 0, T >= 1, n >= 0, b > 0, z3.Not(b / h - 1 < n))


OBLIGATIONS = [
    Obligation(
        "flush range within the allocated blocks",
        "aligned(C, S) / B <= ceil(C / B) for every B dividing S",
        _flush_in_allocated,
    ),
    Obligation(
        "flushed blocks are full",
        "every block below aligned(C, S) / B is full",
        _flush_blocks_are_full,
    ),
    Obligation(
        "flush range disjoint from the stored blocks",
        "[n, ready) and [0, n) share no block",
        _flush_disjoint_from_stored,
    ),
    Obligation(
        "scheduler alignment is exact in every group",
        "aligned(C, S) is a whole number of B-token blocks",
        _group_alignment_exact,
    ),
    Obligation(
        "load destinations in range",
        "a load writes only blocks the request's table holds",
        _load_destinations_in_range,
    ),
    Obligation("capacity never exceeded", "free - picked >= 0 after a selection", _capacity),
    Obligation(
        "lookup never covers the last token",
        "computed + hit < T and ends on a block boundary",
        _lookup_cap,
    ),
    Obligation(
        "a Mamba load writes the state block the allocation takes",
        "computed / B + i == ceil((computed + (i + 1) * B) / B) - 1",
        _mamba_load_is_the_allocated_state,
    ),
    Obligation(
        "a Mamba table keeps its running state",
        "(C - 1) / B == ceil(C / B) - 1 for C >= 1: the freed positions end at the state's",
        _mamba_keeps_its_running_state,
    ),
    Obligation(
        "the prompt tail's block is in the table a finish hands over",
        "0 < b <= C, b not a multiple of B: b / B < ceil(C / B)",
        _tail_block_in_the_flushed_table,
    ),
    Obligation(
        "the prompt tail's hash is among the request's hashes",
        "b = min((T - 1) / H, k) * H > 0: b / H - 1 < k",
        _tail_hash_within_the_hashes,
    ),
    Obligation(
        "a Mamba prefill chunk ends on a state boundary",
        "a chunk cut before the prefill's end ends on a multiple of S, within its tokens",
        _mamba_chunk_ends_on_a_state,
    ),
]
