"""Which side of the disaggregation a worker runs (``--disaggregation-mode``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixrt.disaggregation.decode import DecodeSide
    from radixrt.disaggregation.prefill import PrefillSide
    from radixrt.worker.scheduler import Scheduler


def build_side(sched: Scheduler) -> PrefillSide | DecodeSide | None:
    """The prefill or decode side for ``sched`` (None for a normal server)."""
    mode = sched.args.disaggregation_mode
    if mode == "prefill":
        from radixrt.disaggregation.prefill import PrefillSide

        return PrefillSide(sched)
    if mode == "decode":
        from radixrt.disaggregation.decode import DecodeSide

        return DecodeSide(sched)
    return None
