"""Page generations on the worker's kernels: the arguments every backend takes, checked in one place.

A table may carry the generation it expects beside each page (docs/KERNELS.md, "Page generations"):
``generations`` uint32 [nnz] parallel to ``indices`` (decode, validate), ``slot_generations`` uint32 [n]
parallel to ``slot_mapping`` (append), copy ``generations`` uint32 [n, 2] (src, dst). The worker keeps,
per layer, ``page_gen`` uint32 [layout.num_pages]: the generation each page was last written under
(index ``page - base``; 0 = never written). Given both, a page whose record differs is ``stale_page``
(reads), an older write is refused, and writes record theirs (paged.cuh ``kv_gen_*``); given neither,
nothing is checked or recorded (a table from elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

NULL = np.uint64(0)          # a null pointer argument (kernel_api.NULL)


def check_generations(name: str, gens: Any, n: int | tuple[int, int], page_gens: Any, num_pages: int,
                      what: str, check_array: Callable[..., None]) -> bool:
    """A table's generations (uint32, shape n) and the record(s) of the layer(s) it reads (uint32 [num_pages]
    each; one array or a sequence of them): both or neither. True when they are checked. check_array:
    kernel_api.check_array (shape, dtype, C order)."""
    if gens is None and page_gens is None:
        return False
    if gens is None or page_gens is None:
        raise ValueError(f"{name} and the page generation record go together: give both or neither")
    check_array(name, gens, n if isinstance(n, tuple) else (n,), np.uint32, what)
    many = isinstance(page_gens, Sequence)
    for i, pg in enumerate(page_gens if many else [page_gens]):
        check_array(f"page_gen[{i}]" if many else "page_gen", pg, (num_pages,), np.uint32,
                    "[num_pages] (one per page of the layer)")
    return True


def pointers(*arrays: Any) -> list[Any]:
    """Kernel arguments of optional arrays: each array, or a null pointer for None."""
    return [NULL if a is None else a for a in arrays]
