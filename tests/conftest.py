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
# ``.ci/run`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``): many tests
# leave a core idle for much of their time (a launcher waiting on its ranks, one rank of a
# simulated world, a single-process Inductor compile), and the other worker fills it. Two rules
# keep that sound:
# - A test module's own module-scoped fixture (a shared launch: ``two_ranks``, ``simulated_runs``,
#   ``one_rank_runs``, ``pairs``, ...) would run once per worker that gets one of its tests; the
#   tests that use it are one xdist group, so they run on one worker after one launch. The
#   conftest's module fixtures (``one_rank_group``) are cheap and run per worker as they come.
# - Work is handed out in collection order, one test (or group) at a time, so the slowest go
#   first (``_FIRST``, longest first): a long test started last would leave the other worker
#   idle at the end. The order changes nothing else; outside xdist it is the usual one.
# Nothing in the suite needs a machine to itself: ports come from the OS (port 0), temporary and
# record directories from ``tmp_path``, Inductor's cache is safe to share between processes, and
# memory is measured per process (RSS, the pool's accounting), never as the machine's free memory.
_FIRST = (
    "test_compile_dist.py::test_three_ranks",
    "test_step_memory.py",  # two_ranks
    "test_compile.py::test_inductor_never_reads_a_released_buffer",
    "test_cli_train.py::test_resume_under_torchrun_with_a_hugging_face_model_is_bit_exact",
    "test_soak.py::test_soak_tiny_two_ranks_flat",
    "test_warm_start.py::test_second_launch_is_served_from_the_caches",
    "test_compile_dist.py::test_inductor_with_collectives_deferred_to_their_waits",
    "test_simulate.py",  # simulated_runs
    "test_shard_parity.py::test_parity_eager_and_compiled",
    "test_cli_train.py::test_train_default_engine_then_report",
    "test_compile_dist.py::test_two_ranks",
    "test_exit.py::test_multi_rank_jobs_exit_cleanly",
    "test_faults.py",  # pairs
)
"""Node ids (or their start) of the slowest tests, slowest first ([Note: two pytest workers])."""


def _module_fixture_group(item) -> str | None:
    """The xdist group of a test that uses a module-scoped fixture of its own module: the
    module's name ([Note: two pytest workers])."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(item, "module", None)
    if info is None or module is None:
        return None
    for name in item.fixturenames:
        for fdef in info.name2fixturedefs.get(name, ()):
            if fdef.scope == "module" and getattr(fdef.func, "__module__", None) == module.__name__:
                return module.__name__
    return None


def _first_rank(item) -> int:
    nodeid = item.nodeid.split("/")[-1]
    return next((i for i, head in enumerate(_FIRST) if nodeid.startswith(head)), len(_FIRST))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker
        for item in items:
            group = _module_fixture_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
        items.sort(key=_first_rank)  # stable: collection order within a rank
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
