"""Suite-wide settings.

Multi-process tests start several torch processes on a 2-core machine: one intra-op thread per
process keeps them from oversubscribing the cores (and keeps CPU numerics deterministic).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

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
