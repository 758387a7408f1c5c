"""Where a step's allocated peak grows when the Python thread runs far ahead of the device.

A probe, not a benchmark: tests/gpu/test_block_offload_gpu.py's eight-block checkpointed decoder,
trained four steps by ``zbuf.compile``'s default as that test does, each step queued either
right behind the device or behind a kernel that sleeps about a second; both with the block
gathers on the pool's gather stream ([Note: the gather stream] in zbuf/compile/block_gather.py)
and with them on the compute stream. Per run: each step's allocated and reserved peaks.
"""

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "gpu"))
from parity import decoder_loss  # noqa: E402
from test_block_offload import _train  # noqa: E402
from test_block_offload_gpu import SLEEP_CYCLES, _checkpointed_decoder, _deterministic  # noqa: E402

import zbuf.pool  # noqa: E402


def behind_a_sleeping_device(step_fn, tokens):
    torch.cuda._sleep(SLEEP_CYCLES)
    return decoder_loss(step_fn, tokens)


def run(gather_stream: bool, lagging: bool):
    mp = pytest.MonkeyPatch()
    if not gather_stream:
        init_pool = zbuf.pool.GatherBufferPool.__init__

        def without(self, *a, **k):
            init_pool(self, *a, **k)
            self.gather_stream = None

        mp.setattr(zbuf.pool.GatherBufferPool, "__init__", without)
    init, batches = _checkpointed_decoder(8)
    torch._dynamo.reset()
    with _deterministic():
        trained = _train(mp, init, 1, 4, device="cuda", batches=batches,
                         **({"loss_of": behind_a_sleeping_device} if lagging else {}))
    mp.undo()
    torch.cuda.synchronize()
    return {"gather_stream": gather_stream, "lagging": lagging, "peaks": trained.peaks,
            "reserved": trained.reserved,
            "offloaded": trained.frames.offload.report()["blocks"]}


def main():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    out = []
    for gather_stream in (True, False):
        for lagging in (False, True):
            r = run(gather_stream, lagging)
            print(json.dumps(r), flush=True)
            out.append(r)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
