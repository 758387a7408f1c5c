"""Suite-wide settings.

Multi-process tests start several torch processes on a 2-core machine: one intra-op thread per
process keeps them from oversubscribing the cores (and keeps CPU numerics deterministic).

``TORCHINDUCTOR_VEC_ISA_OK=1``: every process that first compiles with Inductor on a CPU probes
each vector instruction set the CPU lists (AVX-512, AVX2) by building a small library and loading
it in a new Python that imports torch, about 6 s of CPU per process on CI's 2-core box (a warm
launch of test_warm_start.py: 21-22 s of CPU with the probe, 15 s without). The suite's Inductor
processes (pytest itself, the two launches of test_warm_start.py, the two ranks of
test_compile_dist.py's Inductor test) take the instruction set from the CPU's flags instead, as
torch does with the variable set; what they compile is the same. The variable is inherited by
the worker processes and subprocesses the tests start; an explicit setting wins.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo default group for single-process tests; yields its group name.

    Created only if none exists, and destroyed at the module's end only if created here (a test
    may destroy and re-create it in between to exercise a destroyed group).
    """
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD.group_name
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and zbuf's schedule records emptied before and after the test, so that
    each test compiles (and records) its own graphs."""
    from zbuf.compile.report import clear_records

    torch._dynamo.reset()
    clear_records()
    yield
    torch._dynamo.reset()
