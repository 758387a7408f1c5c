"""How long a block's forward takes on the device, read off the forward that just ran.

[Note: the measured block forward]
An offloaded block's copy to host memory runs while the blocks after it compute their forward
([Note: offloaded blocks] in block_offload.py), so how far apart the offloaded blocks must be is
the copy's time over one block's forward. The cost model's flops (``flops_per_second``, one
constant for every card) put qwen3-14b's block forward at 27 ms where an H100 ran it in about
20: planned two forwards apart, each of 19 offloaded blocks' copies (47 ms over a 36 GB/s link)
outran its two forwards, and the forward stood 127 ms a step waiting for them
(benches/results/onepath14.md). So the plan reads the forward's time from the device: an event
on the compute stream as each block's forward begins, and a block's forward is the median
time between two consecutive ones of the last forward. The median, because a gap may hold what
the host did in between (the first call's compile in step 0, an allocation the caching
allocator had to make) and most do not. The ranks agree on the shortest (the copies must hide
behind every rank's forward).
The forward's tail is read the same way: from the last block's start to the model's output (an
event as the model's forward hook runs), in block forwards, where the copies' queue may drain
([Note: the copy queue] in recompute_plan.py).
"""

from __future__ import annotations

from statistics import median
from typing import Optional

import torch

__all__ = ["BlockClock"]


class BlockClock:
    """The compute stream's time at each block forward's start ([Note: the measured block
    forward]); nothing on a device without events (the host). Two sets of events, one the
    forward now running records into, the other the last finished forward's, so a step
    records into events it already has."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events: tuple[list[torch.cuda.Event], list[torch.cuda.Event]] = ([], [])
        """The two sets (producer: ``block_started``)."""
        self._recording = 0
        """The set this forward records into (producer: ``forward_finished``)."""
        self._recorded = 0
        """Events this forward recorded so far (producer: ``block_started``)."""
        self._last = 0
        """Events of the last finished forward, in the other set (producer:
        ``forward_finished``; consumer: ``block_seconds``)."""
        self._outputs: tuple[torch.cuda.Event, ...] = ()
        """The model's output of each set's forward (producer: ``forward_finished``; consumer:
        ``tail_forwards``)."""

    def block_started(self) -> None:
        if self.device.type != "cuda":
            return
        events = self._events[self._recording]
        if self._recorded == len(events):
            events.append(torch.cuda.Event(enable_timing=True))
        events[self._recorded].record(torch.cuda.current_stream(self.device))
        self._recorded += 1

    def forward_finished(self) -> None:
        if self._recorded > 1:
            if not self._outputs:
                self._outputs = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._outputs[self._recording].record(torch.cuda.current_stream(self.device))
            self._last, self._recording = self._recorded, 1 - self._recording
        self._recorded = 0

    def block_seconds(self) -> Optional[float]:
        """A block's forward in the last forward that called two blocks or more (waits for
        it to end on the device), or None when none did."""
        if not self._last:
            return None
        events = self._events[1 - self._recording][:self._last]
        events[-1].synchronize()
        return median(a.elapsed_time(b) for a, b in zip(events, events[1:])) / 1e3

    def tail_forwards(self) -> Optional[float]:
        """The last such forward's time from its last block's start to the model's output, in
        its block forwards (waits for it to end on the device), or None when none ran."""
        block = self.block_seconds()
        if block is None or block <= 0:
            return None
        last, output = self._events[1 - self._recording][self._last - 1], self._outputs[
            1 - self._recording]
        output.synchronize()
        return last.elapsed_time(output) / 1e3 / block
