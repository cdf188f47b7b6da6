"""What both backends of the transfer engine build on (transfer.py picks the backend:
the CPU one there, the CUDA one in transfer_cuda.py): the two directions, a completion, and
the per-block and per-segment copies that run on any device."""

from __future__ import annotations

from collections.abc import Callable

import torch

IN, OUT = "in", "out"

Pairs = list[tuple[int, int]]
# What a fence returns: called once the work queued after the fence has run, the seconds
# that work waited for the copies (host time on CPU, device time on CUDA).
StallProbe = Callable[[], float]


def no_stall() -> float:
    return 0.0


class Done:
    """A direction with nothing to do (or already finished)."""

    event = None

    def wait(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def fence(self, stream=None) -> StallProbe:
        return no_stall


DONE = Done()


def copy_segments(src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, non_blocking: bool = False) -> None:
    """naive: one copy per (block, layer, K/V) segment of block_size × heads × dim elements,
    as a layer-first layout must."""
    num_layers = src.shape[1]
    for s, d in pairs:
        for layer in range(num_layers):
            for kv in (0, 1):
                dst[d, layer, kv].copy_(src[s, layer, kv], non_blocking=non_blocking)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, non_blocking: bool = False) -> None:
    """merged: one copy per whole block (one contiguous region in the block-first layout)."""
    for s, d in pairs:
        dst[d].copy_(src[s], non_blocking=non_blocking)
