"""``zbuf.cli`` under torchrun, with one Ctrl-C replayed at a fixed step in the order that lost the
record of ``test_interrupt_leaves_no_orphans_and_a_record[ctrl-c-under-torchrun]`` (run by
``test_ctrl_c_that_a_finaliser_swallowed_before_a_peer_stopped_leaves_the_record``):

    torchrun --standalone --nproc_per_node 2 tests/swallowed_stop_job.py train ...

At step ``ZBUF_TEST_STOP_STEP`` (before the step's loss all-reduce), rank 0's SIGINT arrives while
a finaliser runs (a ``__del__``, as the eager path's re-gather weakref callbacks are), where
Python drops its ``KeyboardInterrupt`` ([Note: a stop a finaliser swallowed] in
zbuf/faults.py); rank 1's SIGINT stops rank 1 there at once. Rank 0 then enters the all-reduce,
which fails because rank 1 has gone: the same Ctrl-C, seen by rank 0 first as a peer failure.
Nothing else differs from ``python -m zbuf.cli``.
"""

from __future__ import annotations

import os
import signal
import sys

import zbuf.train.loop as loop
from zbuf.cli import main
from zbuf.faults import end_process

_STEP = int(os.environ["ZBUF_TEST_STOP_STEP"])
_real = loop._mean_over_ranks
_calls = [0]


class _Finaliser:
    def __del__(self) -> None:
        try:
            signal.raise_signal(signal.SIGINT)  # the handler runs, and raises, inside __del__
        finally:  # Python drops the KeyboardInterrupt as it leaves; this says that it happened
            print("zbuf test: a finaliser swallowed rank 0's Ctrl-C", file=sys.stderr, flush=True)


def _mean_over_ranks(loss, ranks):
    step = _calls[0]
    _calls[0] += 1
    if step == _STEP:
        if os.environ["RANK"] == "0":
            _Finaliser()  # freed at once: its __del__ swallows this rank's Ctrl-C
        else:
            signal.raise_signal(signal.SIGINT)
    return _real(loss, ranks)


loop._mean_over_ranks = _mean_over_ranks

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))  # as ``python -m zbuf.cli`` ends a rank
