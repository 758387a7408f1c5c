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

# [Note: two pytest workers]
# ``.ci/run`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadfile``): many tests
# leave a core idle for much of their time (a launcher waiting on its ranks, one rank of a
# simulated world, a single-process Inductor compile), and the other worker fills it.
# - Whole files, not single tests, go to a worker: a module runs in its usual order in one
#   process, so a module-scoped fixture (a shared launch: ``two_ranks``, ``simulated_runs``,
#   ``one_rank_runs``, ``pairs``) runs once, as it does without xdist. (``--dist loadgroup`` with
#   ``xdist_group`` marks would split files, but pytest-xdist 3.8 groups nothing under pytest
#   9.2: it renames ``item._nodeid``, which pytest 9.2 no longer reads; the fixtures above then
#   ran twice.)
# - Files are handed out in collection order, one at a time as a worker frees up, so the
#   slowest go first (``_FIRST``; ``--no-loadscope-reorder`` keeps xdist from ordering them by
#   their number of tests): a long file started last would leave the other worker idle at the
#   end. Outside xdist the order is the usual one.
# Nothing in the suite needs the machine to itself: ports come from the OS (port 0), temporary
# and record directories from ``tmp_path``, Inductor's cache is safe to share between processes,
# and memory is measured per process (RSS, the pool's accounting), never as the machine's free
# memory.
_FIRST = (
    "test_cli_train.py",
    "test_compile_dist.py",
    "test_step_memory.py",
    "test_shard_parity.py",
    "test_simulate.py",
    "test_compile.py",
    "test_exit.py",
    "test_warm_start.py",
    "test_recompute.py",
    "test_faults.py",
    "test_soak.py",
    "test_varlen.py",
    "test_checkpoint.py",
    "test_linear_cross_entropy.py",
    "test_shard_hf.py",
)
"""The slowest test files, slowest first (about 40-300 s each on CI's two cores; [Note: two
pytest workers])."""


def _first_rank(item) -> int:
    name = item.nodeid.split("::")[0].split("/")[-1]
    return _FIRST.index(name) if name in _FIRST else len(_FIRST)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker
        items.sort(key=_first_rank)  # stable: each file keeps its order
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
