"""Large zero-filled stores on an anonymous memory mapping, with the kernel's own huge-page policy.

NumPy marks every allocation of 4 MiB or more ``MADV_HUGEPAGE``. Where transparent huge pages are enabled
"madvise" and none can be granted (fragmented memory, a VM that never grants one), each first write into a
fresh 4 KiB page of such an array then costs a failed huge-page attempt: about 9 us a fault on the shared
test VM against about 2 us without the hint. A prefix cache writes the tokens of each registered page into
a store of ``num_slots x page_size`` token ids (748 MB for 182,790 slots of 512 tokens), and on a cache that
is still filling, nearly every registered page is a first write, so the hint alone cost about a quarter of
a whole-trace replay at 100 % capacity (bench/results/cache.md).

``zeroed`` maps such stores with ``mmap`` instead: the same lazily committed zero pages as ``np.zeros``'s
``calloc``, no advice, so the host's setting decides (``always``: huge pages where available; ``madvise``
or ``never``: 4 KiB pages). Small arrays keep ``np.zeros``.
"""

from __future__ import annotations

import mmap

import numpy as np

MAPPED_BYTES = 4 << 20
"""Arrays of at least this many bytes are mapped (NumPy's own huge-page threshold); smaller ones use np.zeros."""


def zeroed(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A writable, C-contiguous array of zeros of ``shape`` and ``dtype``.

    Arrays of ``MAPPED_BYTES`` or more live on their own anonymous private mapping (released when the last
    view of it is garbage-collected); the rest come from ``np.zeros``. Either behaves as any NumPy array:
    views, copies, pickling and ``np.save`` see ordinary memory.
    """
    dt = np.dtype(dtype)
    count = 1
    for n in shape:
        if n < 0:
            raise ValueError(f"zeroed: negative dimension {n} in shape {shape}")
        count *= int(n)
    nbytes = count * dt.itemsize
    if nbytes < MAPPED_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.zeros(shape, dtype=dt)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, dtype=dt, count=count).reshape(shape)
