"""One table of modes on CUDA ([Note: one table of modes] in zbuf/compile/modes.py): every legal
combination trains with the pool's blocks, its streams and (offloaded) pinned host state on the
device, as the unsharded model does; the same body as tests/test_modes.py's CPU run
(``parity.modes_train_as_unsharded``). The graphs run as AOTAutograd hands them on
(``inner="aot_eager"``): what a mode changes on the GPU is the runtime's (pools, streams, host
copies, the step's measured memory), and Inductor's code for each structure on CUDA is
test_compile_gpu.py's and test_block_frames_gpu.py's. Eighteen Inductor compiles would take
about ten of a session's thirty device minutes (one took 40-90 s on the H200 machine)."""

from __future__ import annotations

import pytest
import torch

from parity import mode_name, modes_train_as_unsharded
from zbuf.compile.modes import legal_modes

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")]  # conftest.py


@pytest.mark.parametrize("modes", legal_modes(), ids=mode_name)
def test_every_legal_combination_trains_on_cuda_as_the_unsharded_model(modes):
    modes_train_as_unsharded(modes, torch.device("cuda", torch.cuda.current_device()),
                             inner="aot_eager")
