"""A CPU learner's freed activations go back to the OS: glibc's mmap threshold, fixed.

On a CPU learner every activation and temporary is a glibc `malloc`. glibc
serves a block of at least M_MMAP_THRESHOLD bytes (128 KiB to start) with its
own `mmap`, unmapped on free; but its threshold is dynamic: freeing an
mmapped block raises it to that block's size (up to 32 MiB, `man mallopt`), so
from the first freed activation on, blocks of a few MiB come from the heap.
Freed heap blocks stay resident while anything above them lives, and a
forward pass frees its temporaries (attention buffers, the sequence-parallel
all-to-all's send and receive copies) between tensors it keeps for backward:
every layer leaves holes the next layer's different sizes do not fill.
Measured on Ulysses SP=2 (benchmarks/sequence_parallel.py's model, one
16,384-token row over 2 gloo ranks): peak RSS 1.53 GB with glibc's default
and 1.18 GB with the threshold fixed at 1 MiB, for the same 0.67 GB of
tensors saved for backward; at SP=1 (8,192 tokens per rank) 1.23-1.33 GB
against 1.16 GB. Step time, one run each: 15.7 s fixed against 16.6 s
default at SP=1, 23.9 s against 22.0 s at SP=2.

Setting the threshold with `mallopt` also switches the dynamic adjustment
off, so blocks of 1 MiB and more are mmapped for the whole process life.
GPU learners keep their activations in CUDA memory (PyTorch's caching
allocator) and are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number (malloc.h)."""
MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks of at least 1 MiB (a 4096-token row of a 64-wide head is 1 MiB in fp32) are mmapped and
unmapped on free; smaller ones stay on glibc's heap, where reuse is cheap."""


def return_freed_blocks_to_os(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for this process (see the module docstring). True when it was set;
    False where the C library is not glibc (no `mallopt`), where nothing changes."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)) == 1  # mallopt returns 1 on success


__all__ = ["MMAP_THRESHOLD_BYTES", "return_freed_blocks_to_os"]
