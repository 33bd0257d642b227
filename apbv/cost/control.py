"""The small control collectives of one request, as :mod:`apbv.engine` issues them, counted
from its code; each costs the fixed cost of a collective
(:meth:`apbv.cost.hardware.Machine.collectives`: ``link_latency_s`` on a group of several ranks,
``solo_collective_s`` on a process group of one rank), which on a CPU machine is no small part
of a small model's request (``benchmarks/bench_eval.py``).

Besides the data collectives the stages price already (the prefill's all-gathers, one per
decode layer and step, the embeddings' all-to-all, the first token's broadcast) and the barrier
that ends every stage (:class:`apbv.timing.StageTimer`), a request runs:

- in ``preprocess``: the agreement after this rank's frames are read
  (:func:`apbv.engine.agree.agreement`: one all-reduce of the first failed rank, and a
  broadcast only when one failed): :data:`PREPROCESS_CHECKS`;
- in ``vision``: the agreement after the tower and the vision cache's hit flag
  (:func:`apbv.comm.any_rank`): :data:`VISION_CHECKS`;
- outside the timed stages (in the request's wall time, not in its TTFT): the request check
  before it starts (:func:`apbv.engine.agree.check_same`, one all-gather of the fields'
  hashes) and, after the answer, every timed stage's time and the KV bytes as the maximum over
  ranks (:meth:`apbv.timing.StageTimer.max_over_ranks`, one all-reduce each):
  :func:`bookkeeping_collectives`.
"""

from __future__ import annotations

from apbv.cost.hardware import Machine

PREPROCESS_CHECKS = 1
"""Control collectives in the ``preprocess`` stage besides its closing barrier."""
VISION_CHECKS = 2
"""Control collectives in the ``vision`` stage besides its closing barrier."""
REQUEST_CHECKS = 1
"""Collectives before the first stage: the request's fingerprint check."""
RESULT_REDUCES = 1
"""Collectives after the last stage besides one per timed stage: the KV bytes' maximum."""


def bookkeeping_collectives(stages: int) -> int:
    """The request's collectives outside its timed stages, with ``stages`` stages timed (six
    for an answer: preprocess, vision, transfer, prefill, first_token, decode)."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 0:
        raise ValueError(f"stages must be an integer >= 0, got {stages!r}")
    return REQUEST_CHECKS + stages + RESULT_REDUCES


def bookkeeping_s(m: Machine, ranks: int, stages: int) -> float:
    """Seconds of :func:`bookkeeping_collectives` on a group of ``ranks`` ranks."""
    return m.collectives(bookkeeping_collectives(stages), ranks)
