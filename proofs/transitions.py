"""Inductive invariants of the block-pool and offload transition system, for any number of
blocks.

The state is a set of z3 arrays indexed by block id (an unbounded integer; the pool has a
symbolic size ``N``), keys are an uninterpreted sort, and the free queue is abstracted to
membership (its order matters to no invariant here). For each transition ``T`` one query
checks ``Inv and pre(T) and T => Inv'``; a second query checks that the initial state
satisfies ``Inv``. Every transition has a ``broken`` form (one update dropped or one guard
removed), and the tests show that its proof then fails.

Strengthening: the model's POOL-PRIMARY ("a free hashed block's primary is mapped") is not
inductive: freeing a held block whose primary is unmapped would break it. The inductive form
is PRIMARY+: every block's primary is mapped, held or free. It holds in the fixed code because
a primary is only ever set by ``insert_block_hash``, which maps it; the stamping of vLLM
#53498 is exactly what breaks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import z3

from kvoffload.proofs.obligation import Obligation
from kvoffload.proofs.registration import Key

Int = z3.IntSort()
Bool = z3.BoolSort()
NONE, PENDING, LIVE, ABANDONED = 0, 1, 2, 3


@dataclass(frozen=True)
class State:
    # the CPU pool (the generic pool obligations use these fields alone)
    n: z3.ArithRef
    ref: z3.ArrayRef  # Int -> Int
    inq: z3.ArrayRef  # Int -> Bool: in the free queue
    has: z3.ArrayRef  # Int -> Bool: has a primary
    pk: z3.ArrayRef  # Int -> Key: the primary
    mapped: z3.ArrayRef  # Int -> (Key -> Bool): (key, block) in the map, block-major
    sec: z3.ArrayRef  # Int -> (Key -> Bool): secondary keys
    # the offload scheduler
    stat: z3.ArrayRef  # Int -> Int: CPU block's store (NONE, PENDING, LIVE, ABANDONED)
    partner: z3.ArrayRef  # Int -> Int: the GPU block it stores
    lp: z3.ArrayRef  # Int -> Int: lookup and load pins
    # the GPU pool, as the offload scheduler sees it
    gn: z3.ArithRef
    gref: z3.ArrayRef
    hold: z3.ArrayRef  # request block tables holding it
    gpin: z3.ArrayRef  # store pins: at least the number of stores of the block
    idx: z3.ArrayRef  # Int -> Int: ghost, a distinct slot below gpin for each store
    gload: z3.ArrayRef  # load pins
    ghas: z3.ArrayRef
    gpk: z3.ArrayRef
    gsec: z3.ArrayRef  # Int -> (Key -> Bool)
    inflight: z3.ArrayRef  # Int -> Bool
    owner: z3.ArrayRef  # Int -> Int: ghost, the live store of an in-flight GPU block


def symbolic(tag: str) -> State:
    def arr(name: str, dom: z3.SortRef, rng: z3.SortRef) -> z3.ArrayRef:
        return z3.Array(f"{name}_{tag}", dom, rng)

    return State(
        z3.Int(f"n_{tag}"),
        arr("ref", Int, Int),
        arr("inq", Int, Bool),
        arr("has", Int, Bool),
        arr("pk", Int, Key),
        arr("mapped", Int, z3.ArraySort(Key, Bool)),
        arr("sec", Int, z3.ArraySort(Key, Bool)),
        arr("stat", Int, Int),
        arr("partner", Int, Int),
        arr("lp", Int, Int),
        z3.Int(f"gn_{tag}"),
        arr("gref", Int, Int),
        arr("hold", Int, Int),
        arr("gpin", Int, Int),
        arr("idx", Int, Int),
        arr("gload", Int, Int),
        arr("ghas", Int, Bool),
        arr("gpk", Int, Key),
        arr("gsec", Int, z3.ArraySort(Key, Bool)),
        arr("inflight", Int, Bool),
        arr("owner", Int, Int),
    )


b, c, c2, g = z3.Ints("b c c2 g")
k = z3.Const("k", Key)

# Bounded mode: quantifiers range over blocks 0..BOUND-1 and a few keys only. It exists to
# find concrete counterexamples for the broken transitions fast; the proofs are unbounded.
_bound: list[int] = []
KEYS = [z3.Const(f"K{i}", Key) for i in range(3)]


def forall(variables: list[z3.ExprRef], body: z3.BoolRef) -> z3.BoolRef:
    if not _bound:
        return z3.ForAll(variables, body)
    choices: list[list[tuple[z3.ExprRef, z3.ExprRef]]] = [[]]
    for v in variables:
        values = KEYS if v.sort() == Key else [z3.IntVal(i) for i in range(_bound[0])]
        choices = [[*done, (v, value)] for done in choices for value in values]
    return z3.And([z3.substitute(body, *pairs) for pairs in choices])


def _blk(s: State, x: z3.ArithRef) -> z3.BoolRef:
    return z3.And(x > 0, x < s.n)


def _gblk(s: State, x: z3.ArithRef) -> z3.BoolRef:
    return z3.And(x > 0, x < s.gn)


def _live(s: State, x: z3.ArithRef) -> z3.BoolRef:
    return z3.Or(s.stat[x] == PENDING, s.stat[x] == LIVE)


# -- invariants ---------------------------------------------------------------------------


def pool_invariant(s: State) -> z3.BoolRef:
    return z3.And(
        s.n >= 1,
        z3.Not(s.inq[0]),
        z3.Not(s.has[0]),
        forall([k], z3.Not(s.sec[0][k])),
        # POOL-QUEUE
        forall([b], z3.Implies(_blk(s, b), z3.And(s.ref[b] >= 0, s.inq[b] == (s.ref[b] == 0)))),
        # POOL-MAP, both directions
        forall(
            [k, b],
            z3.Implies(
                s.mapped[b][k],
                z3.And(_blk(s, b), z3.Or(z3.And(s.has[b], s.pk[b] == k), s.sec[b][k])),
            ),
        ),
        forall(
            [b, k],
            z3.Implies(
                z3.And(_blk(s, b), s.sec[b][k]),
                z3.And(s.mapped[b][k], s.has[b], s.pk[b] != k),
            ),
        ),
        # PRIMARY+ (the inductive strengthening of POOL-PRIMARY)
        forall([b], z3.Implies(z3.And(_blk(s, b), s.has[b]), s.mapped[b][s.pk[b]])),
    )


def offload_invariant(s: State) -> z3.BoolRef:
    return z3.And(
        pool_invariant(s),
        s.gn >= 1,
        # REF-CPU
        forall(
            [c],
            z3.Implies(
                _blk(s, c),
                z3.And(s.lp[c] >= 0, s.ref[c] == z3.If(s.stat[c] != NONE, 1, 0) + s.lp[c]),
            ),
        ),
        # stores pair a real CPU block with a real GPU block
        forall(
            [c],
            z3.And(
                s.stat[c] >= 0,
                s.stat[c] <= ABANDONED,
                z3.Implies(s.stat[c] != NONE, z3.And(_blk(s, c), _gblk(s, s.partner[c]))),
            ),
        ),
        # UNREACHABLE
        forall([c], z3.Implies(s.stat[c] != NONE, z3.Not(s.has[c]))),
        forall([c, k], z3.Implies(s.stat[c] != NONE, z3.Not(s.mapped[c][k]))),
        # LOAD-PINNED
        forall(
            [c],
            z3.Implies(z3.And(_blk(s, c), s.lp[c] >= 1), z3.And(s.has[c], s.mapped[c][s.pk[c]])),
        ),
        # REF-GPU
        forall(
            [g],
            z3.Implies(
                _gblk(s, g),
                z3.And(
                    s.hold[g] >= 0,
                    s.gpin[g] >= 0,
                    s.gload[g] >= 0,
                    s.gref[g] == s.hold[g] + s.gpin[g] + s.gload[g],
                ),
            ),
        ),
        # a stored GPU block stays pinned and keyed until its store is done: each store
        # owns a distinct pin slot below gpin (a ghost ranking standing in for a count)
        forall(
            [c],
            z3.Implies(
                s.stat[c] != NONE,
                z3.And(s.idx[c] >= 0, s.idx[c] < s.gpin[s.partner[c]], s.ghas[s.partner[c]]),
            ),
        ),
        forall(
            [c, c2],
            z3.Implies(
                z3.And(
                    s.stat[c] != NONE,
                    s.stat[c2] != NONE,
                    s.partner[c] == s.partner[c2],
                    c != c2,
                ),
                s.idx[c] != s.idx[c2],
            ),
        ),
        forall([g, k], z3.Implies(s.gsec[g][k], z3.And(s.ghas[g], s.gpk[g] != k))),
        # IN-FLIGHT, both ways; the ghost ``owner`` names the witness, so that no
        # quantifier alternates
        forall(
            [g],
            z3.Implies(
                z3.And(_gblk(s, g), s.inflight[g]),
                z3.And(_blk(s, s.owner[g]), _live(s, s.owner[g]), s.partner[s.owner[g]] == g),
            ),
        ),
        forall([c], z3.Implies(_live(s, c), s.inflight[s.partner[c]])),
        # no GPU block is in two live stores (the in-flight skip)
        forall(
            [c, c2],
            z3.Implies(z3.And(_live(s, c), _live(s, c2), s.partner[c] == s.partner[c2]), c == c2),
        ),
    )


# -- pool transitions ---------------------------------------------------------------------


def _no_keys_on(s: State, x: z3.ArithRef, keep_secondary: bool = False) -> State:
    return replace(
        s,
        has=z3.Store(s.has, x, False),
        mapped=z3.Store(s.mapped, x, z3.K(Key, z3.BoolVal(False))),
        sec=s.sec if keep_secondary else z3.Store(s.sec, x, z3.K(Key, z3.BoolVal(False))),
    )


def allocate(s: State, x: z3.ArithRef, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """``get_new_blocks``: a queued block leaves the queue with ref 1 and no key.
    Broken: its secondary keys are not evicted."""
    t = _no_keys_on(s, x, keep_secondary=broken)
    return z3.And(_blk(s, x), s.inq[x]), replace(
        t, inq=z3.Store(s.inq, x, False), ref=z3.Store(s.ref, x, 1)
    )


def touch(s: State, x: z3.ArithRef, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """Broken: a free block is not taken out of the queue."""
    leaves = z3.And(x != 0, s.ref[x] == 0, not broken)
    return z3.And(x >= 0, x < s.n), replace(
        s,
        ref=z3.Store(s.ref, x, s.ref[x] + 1),
        inq=z3.Store(s.inq, x, z3.If(leaves, False, s.inq[x])),
    )


def free(s: State, x: z3.ArithRef, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """Broken: the block is queued without its ref count going down."""
    after = s.ref[x] if broken else s.ref[x] - 1
    queued = z3.And(x != 0, s.ref[x] - 1 == 0)
    return z3.And(x >= 0, x < s.n, z3.Or(x == 0, s.ref[x] >= 1)), replace(
        s,
        ref=z3.Store(s.ref, x, after),
        inq=z3.Store(s.inq, x, z3.If(queued, True, s.inq[x])),
    )


def insert_key(
    s: State, x: z3.ArithRef, key: z3.ExprRef, broken: bool = False
) -> tuple[z3.BoolRef, State]:
    """``_insert_block_hash`` with both guards. Broken: a hashless block gets its primary
    without a map entry (the stamp of vLLM #53498)."""
    skip = z3.Or(z3.And(s.has[x], s.pk[x] == key), s.mapped[x][key])
    primary = z3.And(z3.Not(skip), z3.Not(s.has[x]))
    secondary = z3.And(z3.Not(skip), s.has[x])
    mapped_now = z3.And(z3.Not(skip), z3.Not(z3.And(primary, broken)))
    return _blk(s, x), replace(
        s,
        has=z3.Store(s.has, x, z3.Or(s.has[x], primary)),
        pk=z3.Store(s.pk, x, z3.If(primary, key, s.pk[x])),
        mapped=z3.Store(
            s.mapped, x, z3.Store(s.mapped[x], key, z3.Or(s.mapped[x][key], mapped_now))
        ),
        sec=z3.Store(s.sec, x, z3.Store(s.sec[x], key, z3.Or(s.sec[x][key], secondary))),
    )


def evict(s: State, x: z3.ArithRef, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """``evict_blocks``: remove every key, whatever the ref count. Broken: the primary stays."""
    t = _no_keys_on(s, x)
    return _blk(s, x), replace(t, has=s.has) if broken else t


def reset_pool(s: State, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """``reset_prefix_cache`` when every block is free. Broken: primaries are not reset."""
    idle = forall([b], z3.Implies(_blk(s, b), s.inq[b]))
    no = z3.BoolVal(False)
    return idle, replace(
        s,
        mapped=z3.K(Int, z3.K(Key, no)),
        sec=z3.K(Int, z3.K(Key, no)),
        has=s.has if broken else z3.Store(z3.K(Int, no), 0, no),
    )


# -- offload transitions ------------------------------------------------------------------


def _gpu_add(s: State, x: z3.ArithRef, pin: int = 0, hold: int = 0, load: int = 0) -> State:
    return replace(
        s,
        gref=z3.Store(s.gref, x, s.gref[x] + pin + hold + load),
        gpin=z3.Store(s.gpin, x, s.gpin[x] + pin),
        hold=z3.Store(s.hold, x, s.hold[x] + hold),
        gload=z3.Store(s.gload, x, s.gload[x] + load),
    )


def select_store(
    s: State, x: z3.ArithRef, y: z3.ArithRef, status: int = LIVE, broken: bool = False
) -> tuple[z3.BoolRef, State]:
    """Select GPU block ``y`` for a store into a new CPU block ``x`` (``status`` LIVE: the
    per-step scan; PENDING: the final flush). Broken: no in-flight skip."""
    pre_alloc, t = allocate(s, x)
    skip_ok = z3.BoolVal(True) if broken else z3.Not(s.inflight[y])
    pre = z3.And(pre_alloc, _gblk(s, y), s.ghas[y], skip_ok)
    t = _gpu_add(t, y, pin=1)
    return pre, replace(
        t,
        idx=z3.Store(s.idx, x, s.gpin[y]),
        stat=z3.Store(s.stat, x, status),
        partner=z3.Store(s.partner, x, y),
        inflight=z3.Store(s.inflight, y, True),
        owner=z3.Store(s.owner, y, x),
    )


def queue_flush(
    s: State, x: z3.ArithRef, y: z3.ArithRef, broken: bool = False
) -> tuple[z3.BoolRef, State]:
    return select_store(s, x, y, status=PENDING, broken=broken)


def submit(s: State, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """The next store event carries every queued flush. Broken: queued flushes are dropped."""
    sent = NONE if broken else LIVE
    return z3.BoolVal(True), replace(
        s, stat=z3.Lambda([c], z3.If(s.stat[c] == PENDING, sent, s.stat[c]))
    )


def _give_up_slot(s: State, x: z3.ArithRef) -> z3.ArrayRef:
    """Store ``x`` gives up its pin slot: the store in the last slot of the same GPU block
    moves into it, so slots stay distinct and below the decremented pin count."""
    y = s.partner[x]
    return z3.Lambda(
        [c],
        z3.If(
            z3.And(
                c != x,
                s.stat[c] != NONE,
                s.partner[c] == y,
                s.idx[c] == s.gpin[y] - 1,
            ),
            s.idx[x],
            s.idx[c],
        ),
    )


def complete_store(s: State, x: z3.ArithRef, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """A live store completes: the GPU block's primary, then its secondary keys, are
    registered on ``x``, which is freed; the GPU pin is dropped. Broken: the CPU block's
    ref count is not dropped."""
    y = s.partner[x]
    key = s.gpk[y]
    after = s.ref[x] if broken else s.ref[x] - 1
    t = replace(
        s,
        has=z3.Store(s.has, x, True),
        pk=z3.Store(s.pk, x, key),
        mapped=z3.Store(s.mapped, x, z3.Lambda([k], z3.Or(s.mapped[x][k], k == key, s.gsec[y][k]))),
        sec=z3.Store(s.sec, x, z3.Lambda([k], z3.And(s.gsec[y][k], k != key))),
        ref=z3.Store(s.ref, x, after),
        inq=z3.Store(s.inq, x, after == 0),
        stat=z3.Store(s.stat, x, NONE),
        inflight=z3.Store(s.inflight, y, False),
        idx=_give_up_slot(s, x),
    )
    return s.stat[x] == LIVE, _gpu_add(t, y, pin=-1)


def abandon(s: State, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """``reset()``: live stores are abandoned, queued flushes released, the in-flight set
    cleared. Broken: queued flushes are forgotten without releasing their blocks."""
    released = z3.BoolVal(not broken)
    pend = z3.Lambda([c], s.stat[c] == PENDING)
    # The queued flush of GPU block g, if any, is its in-flight owner.
    flushed = z3.Lambda([g], z3.And(s.inflight[g], pend[s.owner[g]]))
    drop = z3.Lambda([g], z3.If(z3.And(released, flushed[g]), 1, 0))
    new_ref = z3.Lambda([c], z3.If(z3.And(pend[c], released), s.ref[c] - 1, s.ref[c]))
    moved = z3.Lambda(
        [c],
        z3.If(
            z3.And(
                released,
                s.stat[c] == ABANDONED,
                flushed[s.partner[c]],
                s.idx[c] == s.gpin[s.partner[c]] - 1,
            ),
            s.idx[s.owner[s.partner[c]]],
            s.idx[c],
        ),
    )
    return z3.BoolVal(True), replace(
        s,
        stat=z3.Lambda([c], z3.If(s.stat[c] == LIVE, ABANDONED, z3.If(pend[c], NONE, s.stat[c]))),
        ref=new_ref,
        inq=z3.Lambda([c], z3.If(z3.And(pend[c], released), new_ref[c] == 0, s.inq[c])),
        gref=z3.Lambda([g], s.gref[g] - drop[g]),
        gpin=z3.Lambda([g], s.gpin[g] - drop[g]),
        inflight=z3.K(Int, z3.BoolVal(False)),
        idx=moved,
    )


def complete_abandoned(s: State, x: z3.ArithRef, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """An abandoned store completes: its blocks are released, nothing is registered.
    Broken: its data is registered, as if the store had not been abandoned."""
    y = s.partner[x]
    after = s.ref[x] - 1
    t = replace(
        s,
        ref=z3.Store(s.ref, x, after),
        inq=z3.Store(s.inq, x, after == 0),
        stat=z3.Store(s.stat, x, NONE),
        idx=_give_up_slot(s, x),
    )
    if broken:  # the GPU block's primary lands, and the now free block keeps it unmapped
        t = replace(t, has=z3.Store(s.has, x, True), pk=z3.Store(s.pk, x, s.gpk[y]))
    return s.stat[x] == ABANDONED, _gpu_add(t, y, pin=-1)


def pin_cpu(s: State, x: z3.ArithRef, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """A lookup or load pins a mapped CPU block. Broken: the pin is not counted."""
    pre_touch, t = touch(s, x)
    hit = z3.And(_blk(s, x), s.has[x], s.mapped[x][s.pk[x]])
    return z3.And(pre_touch, hit), t if broken else replace(t, lp=z3.Store(s.lp, x, s.lp[x] + 1))


def unpin_cpu(s: State, x: z3.ArithRef, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """A lookup pin or a load is released. Broken: the block is not queued at ref 0."""
    pre_free, t = free(s, x)
    if broken:
        t = replace(t, inq=s.inq)
    return z3.And(pre_free, _blk(s, x), s.lp[x] >= 1), replace(t, lp=z3.Store(s.lp, x, s.lp[x] - 1))


def gpu_allocate(s: State, y: z3.ArithRef, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """A request takes a free GPU block: its keys go. Broken: a pinned block can be taken."""
    pre = z3.And(_gblk(s, y), z3.BoolVal(True) if broken else s.gref[y] == 0)
    t = replace(
        s,
        ghas=z3.Store(s.ghas, y, False),
        gsec=z3.Store(s.gsec, y, z3.K(Key, z3.BoolVal(False))),
        gref=z3.Store(s.gref, y, s.gref[y] + 1),
        hold=z3.Store(s.hold, y, s.hold[y] + 1),
    )
    return pre, t


def gpu_release(s: State, y: z3.ArithRef, broken: bool = False) -> tuple[z3.BoolRef, State]:
    """A request drops its hold on a GPU block. Broken: the ref count is not dropped."""
    t = _gpu_add(s, y, hold=-1)
    if broken:
        t = replace(t, gref=s.gref)
    return z3.And(_gblk(s, y), s.hold[y] >= 1), t


def initial(s: State) -> z3.BoolRef:
    return z3.And(
        s.n >= 1,
        s.gn >= 1,
        forall([b], s.inq[b] == z3.And(_blk(s, b))),
        forall([b], z3.And(s.ref[b] == 0, z3.Not(s.has[b]), s.stat[b] == NONE, s.lp[b] == 0)),
        forall([k, b], z3.Not(s.mapped[b][k])),
        forall([b, k], z3.Not(s.sec[b][k])),
        forall(
            [g],
            z3.And(
                s.gref[g] == 0,
                s.hold[g] == 0,
                s.gpin[g] == 0,
                s.gload[g] == 0,
                z3.Not(s.inflight[g]),
            ),
        ),
        forall([g, k], z3.Implies(s.gsec[g][k], z3.And(s.ghas[g], s.gpk[g] != k))),
    )


Step = Callable[[State, bool], tuple[z3.BoolRef, State]]
x_, y_ = z3.Ints("x y")
key_ = z3.Const("key", Key)

POOL_STEPS: dict[str, Step] = {
    "allocate": lambda s, br: allocate(s, x_, br),
    "touch": lambda s, br: touch(s, x_, br),
    "free": lambda s, br: free(s, x_, br),
    "insert key": lambda s, br: insert_key(s, x_, key_, br),
    "evict": lambda s, br: evict(s, x_, br),
    "reset prefix cache": lambda s, br: reset_pool(s, br),
}

OFFLOAD_STEPS: dict[str, Step] = {
    "select store": lambda s, br: select_store(s, x_, y_, LIVE, br),
    "queue flush": lambda s, br: queue_flush(s, x_, y_, br),
    "submit": lambda s, br: submit(s, br),
    "complete store": lambda s, br: complete_store(s, x_, br),
    "abandon (reset)": lambda s, br: abandon(s, br),
    "complete abandoned": lambda s, br: complete_abandoned(s, x_, br),
    "pin for lookup or load": lambda s, br: pin_cpu(s, x_, br),
    "unpin after load": lambda s, br: unpin_cpu(s, x_, br),
    "gpu allocate": lambda s, br: gpu_allocate(s, y_, br),
    "gpu release": lambda s, br: gpu_release(s, y_, br),
    "reset prefix cache": lambda s, br: reset_pool(s, br),
}


def _small_world(s: State, bound: int) -> z3.BoolRef:
    """Bounded mode: ``bound`` blocks in each pool, and every key in play among ``KEYS``."""
    keys = [s.pk[i] for i in range(bound)] + [s.gpk[i] for i in range(bound)] + [key_]
    return z3.And(
        s.n == bound,
        s.gn == bound,
        *[z3.Or([key == known for known in KEYS]) for key in keys],
    )


def step_obligation(
    system: str, name: str, broken: bool = False, bound: int | None = None
) -> Obligation:
    """``Inv and pre(T) and T and not Inv'``: unsat proves the step. With ``bound`` the
    query ranges over ``bound`` blocks per pool (for counterexamples to broken steps)."""
    steps, inv = (
        (POOL_STEPS, pool_invariant) if system == "pool" else (OFFLOAD_STEPS, offload_invariant)
    )

    def build(solver: z3.Solver) -> None:
        if bound is not None:
            _bound.append(bound)
        try:
            s = symbolic("s")
            pre, after = steps[name](s, broken)
            solver.add(inv(s), pre, z3.Not(inv(after)))
            if bound is not None:
                solver.add(_small_world(s, bound), z3.And(x_ >= 0, x_ < bound, y_ >= 0, y_ < bound))
        finally:
            if bound is not None:
                _bound.pop()

    label = f"{system}: {name}" + (" (broken)" if broken else "")
    return Obligation(
        f"{label} preserves the invariant",
        f"Inv and pre({name}) and {name} imply Inv'",
        build,
    )


def initial_obligation(system: str) -> Obligation:
    inv = pool_invariant if system == "pool" else offload_invariant

    def build(solver: z3.Solver) -> None:
        s = symbolic("s")
        solver.add(initial(s), z3.Not(inv(s)))

    return Obligation(f"{system}: initial states satisfy the invariant", "Init implies Inv", build)


OBLIGATIONS = [
    initial_obligation("pool"),
    *[step_obligation("pool", name) for name in POOL_STEPS],
    initial_obligation("offload"),
    *[step_obligation("offload", name) for name in OFFLOAD_STEPS],
]
