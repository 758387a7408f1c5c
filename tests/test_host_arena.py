"""Host arenas ([Note: host arenas] in zbuf/host_arena.py): tensors of any size, stride and dtype
carved at aligned offsets, never overlapping, None exactly when the rest is too small; the same
bytes again after ``reset``. Page-locking itself is CUDA's (tests/gpu/test_host_arena_gpu.py)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from zbuf import _core
from zbuf.host_arena import ALIGN, HostArena, span_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]


@st.composite
def strided(draw):
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    t = torch.empty(shape, dtype=dtype)
    if len(shape) >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    return t


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 4096), likes=st.lists(strided(), max_size=12))
def test_carved_tensors_are_aligned_disjoint_shaped_and_refused_only_when_too_big(nbytes, likes):
    arena = HostArena(nbytes, torch.device("cpu"))
    base = arena.memory.data_ptr()
    taken = []
    for like in likes:
        start = -(-arena.used // ALIGN) * ALIGN
        fits = start + span_bytes(like) <= nbytes
        got = arena.carve(like)
        assert (got is not None) == fits
        if got is None:
            continue
        assert (got.shape, got.stride(), got.dtype) == (like.shape, like.stride(), like.dtype)
        if like.numel() == 0:  # spans nothing (torch gives its data no address)
            continue
        assert got.data_ptr() - base == start and start % ALIGN == 0
        lo, hi = got.data_ptr() - base, got.data_ptr() - base + span_bytes(like)
        assert all(hi <= a or b <= lo for a, b in taken)
        taken.append((lo, hi))
        got.copy_(torch.ones_like(like))  # every element writable, inside the arena
        assert hi <= nbytes


def test_reset_hands_the_same_bytes_out_again():
    arena = HostArena(4 * ALIGN, torch.device("cpu"))
    like = torch.empty(3, 5)
    first = [arena.carve(like).data_ptr() for _ in range(4)]
    assert arena.carve(like) is None
    arena.reset()
    assert [arena.carve(like).data_ptr() for _ in range(4)] == first


def test_page_lock_of_an_empty_range_is_refused():
    with pytest.raises(_core.InvalidRequestError, match="page_lock needs a host range"):
        _core.page_lock(0, 0, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA driver")
def test_page_lock_without_a_driver_is_a_clean_error():
    memory = torch.empty(8192, dtype=torch.uint8)
    with pytest.raises(_core.NoCudaDriverError):
        _core.page_lock(0, memory.data_ptr(), memory.numel())


def test_page_lock_needs_a_touch_thread():
    memory = torch.empty(8192, dtype=torch.uint8)
    with pytest.raises(_core.InvalidRequestError, match="at least one touch thread"):
        _core.page_lock(0, memory.data_ptr(), memory.numel(), 0)
