"""``kvoffload prove``: every obligation, its outcome and its time."""

from __future__ import annotations

from kvoffload.proofs import arithmetic, registration, transitions
from kvoffload.proofs.obligation import Obligation, Outcome, check


def all_obligations() -> list[Obligation]:
    return [*registration.OBLIGATIONS, *transitions.OBLIGATIONS, *arithmetic.OBLIGATIONS]


def run_prove(verbose: bool = False) -> int:
    """Check every obligation; exit status 0 only if every one is proved (or shown)."""
    outcomes: list[Outcome] = []
    for obligation in all_obligations():
        outcome = check(obligation)
        outcomes.append(outcome)
        print(f"{outcome.status:>14}  {outcome.seconds:7.3f} s  {obligation.name}")
        if outcome.model and (verbose or not outcome.ok or outcome.status == "shown"):
            for line in outcome.model.splitlines():
                print(f"{'':>26}{line}")
    failed = [o for o in outcomes if not o.ok]
    total = sum(o.seconds for o in outcomes)
    print(
        f"\n{len(outcomes) - len(failed)} of {len(outcomes)} obligations hold "
        f"({sum(o.status == 'proved' for o in outcomes)} proved, "
        f"{sum(o.status == 'shown' for o in outcomes)} shown) in {total:.2f} s"
    )
    return 0 if not failed else 1
