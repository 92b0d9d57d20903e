"""Persistent page tables on the worker's device, kept current by the manager's StepStream replies.

A scheduler that receives incremental tables (kvservice.client.stream.StepStream with deltas) forwards
each reply to the workers (UpdateTables); each worker applies it to its own PageTableMirror
whose arrays live where the kernels run (CuPy on a GPU, NumPy on the CPU backend). A decode
step then ships only the delta to the device, and AppendKV / DecodeAttention name the copy
(``table_id``) instead of carrying slot mappings and CSR tables: the shape of vLLM v1's
persistent block table. The kernels still check every page index they read (docs/DESIGN.md).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from kvservice.contract.errors import FailedPrecondition, InvalidArgument, NotFound
from kvservice.contract.mirror import MirrorError, PageTableMirror
from kvservice.core.geometry import Geometry
from kvservice.v1 import block_manager_pb2 as pb

_TABLE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class DeviceTables:
    """table_id -> PageTableMirror on the device, at most max_tables (least recently updated dropped).

    geometry: the pool's (layer -> index space). xp: numpy or cupy.
    """

    def __init__(self, geometry: Geometry, xp: Any = np, max_tables: int = 64) -> None:
        self.page_size = geometry.spec.page_size
        self.layer_space = [v.index_space for v in geometry.layers]
        self.xp = xp
        self.max_tables = max_tables
        self._tables: OrderedDict[str, PageTableMirror] = OrderedDict()
        self._lock = threading.Lock()

    def update(self, table_id: str, reply: pb.StepReply) -> PageTableMirror:
        """Apply one StepStream reply to the copy `table_id` (created by a full reply).

        Raises InvalidArgument for a bad id or a reply with neither tables nor a delta, FailedPrecondition
        (reason TABLES_OUT_OF_SYNC) for a delta the copy cannot take; the copy is then unchanged.
        """
        if not _TABLE_ID.match(table_id):
            raise InvalidArgument("table_id must be 1-64 characters of [A-Za-z0-9_.:-]")
        if reply.HasField("error"):
            raise InvalidArgument("step is a refused request's reply: it carries no tables")
        if reply.stream_seq < 1:
            raise InvalidArgument("step must be a StepStream reply (stream_seq >= 1)")
        with self._lock:
            mirror = self._tables.get(table_id)
            if mirror is None:
                if reply.HasField("delta"):
                    raise FailedPrecondition(f"no tables {table_id!r} on this worker to apply a delta to; send a full "
                                             "reply first (kvservice.contract.mirror.PageTableMirror.full_reply())",
                                             reason="TABLES_OUT_OF_SYNC", table_id=table_id)
                mirror = PageTableMirror(self.page_size, self.xp)
            try:
                mirror.apply(reply)
            except MirrorError as err:
                if not mirror.seq:                        # what it held is gone (see PageTableMirror.apply)
                    self._tables.pop(table_id, None)
                raise FailedPrecondition(f"tables {table_id!r}: {err}; send a full reply "
                                         "(kvservice.contract.mirror.PageTableMirror.full_reply())",
                                         reason="TABLES_OUT_OF_SYNC",
                                         table_id=table_id) from None
            if not mirror.seq:
                self._tables.pop(table_id, None)
                raise InvalidArgument("step carries no page tables (a reply to omit_tables): nothing to hold")
            self._tables[table_id] = mirror
            self._tables.move_to_end(table_id)
            while len(self._tables) > self.max_tables:
                self._tables.popitem(last=False)
            return mirror

    def _mirror(self, table_id: str, layer: int) -> tuple[PageTableMirror, int]:
        with self._lock:
            mirror = self._tables.get(table_id)
        if mirror is None:
            raise NotFound(f"no tables {table_id!r} on this worker (UpdateTables creates them)", table_id=table_id)
        return mirror, self.layer_space[layer]

    def csr(self, table_id: str, layer: int) -> tuple[Any, Any, Any]:
        """(indptr int32 [B + 1], indices int32 [nnz], last_page_len int32 [B]) of a layer, on the device."""
        mirror, space = self._mirror(table_id, layer)
        t = mirror.page_table(space)
        if t.indices.dtype != np.int32:
            raise FailedPrecondition(f"layer {layer}'s index space needs int64 page indices; the kernels take int32")
        return t.indptr.astype(np.int32), t.indices, t.last_page_len

    def slot_mapping(self, table_id: str, layer: int) -> Any:
        """int64 [num_new_tokens] of the copy's last step in a layer's index space, on the device."""
        mirror, space = self._mirror(table_id, layer)
        return mirror.slot_mapping(space)
