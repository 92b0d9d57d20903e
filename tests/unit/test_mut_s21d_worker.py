"""The worker's start-up and host facts, and one refusal of its persistent tables: device_info on machines whose
/proc/cpuinfo has no "model name" (ARM) or cannot be read; _warm refusing a kernel view of the index space that
misses the page of the layer's first or last slot; serve_worker's start-up GetPool deadline (30 s, as its
RegisterWorker); and DeviceTables refusing, with its message, a reply that leaves the table without page
generations (behind TablePlan.check, which refuses such replies first)."""

from __future__ import annotations

import dataclasses
import io
import os
import re

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument, NotFound
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.worker import ops_numpy, server
from kvservice.worker.caches import CacheSet
from kvservice.worker.tables import TablePlan
from tests.unit.test_mut_m29w2_tables import Stream, _manager, _tables


def _memory() -> int:
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:")) * 1024


@pytest.mark.parametrize("text, want", [
    ("processor\t: 0\nmodel name\t:  Acme Z80: rev 2 @ 4MHz \nflags\t\t: fpu\n"
     "processor\t: 1\nmodel name\t: Other CPU\n", "Acme Z80: rev 2 @ 4MHz"),        # the first, split at one ':'
    ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n", "cpu"),   # ARM: no name
    ("", "cpu"),
    (None, "cpu"),                                                                    # unreadable /proc/cpuinfo
])
def test_a_cpu_devices_name_is_the_first_model_name_else_cpu(monkeypatch, text, want):
    """device_info("cpu") reads /proc/cpuinfo: the value of its first "model name" line (after the first ':',
    stripped); "cpu" when there is no such line or the file cannot be opened. The memory is the machine's, in
    whole pages, at least /proc/meminfo's MemTotal, whatever cpuinfo says."""
    opened = []

    def fake_open(path, *args, **kw):
        opened.append(path)
        if text is None:
            raise PermissionError(13, "Permission denied", path)
        return io.StringIO(text)

    monkeypatch.setattr(server, "open", fake_open, raising=False)
    name, memory = server.device_info("cpu")
    assert opened == ["/proc/cpuinfo"]
    assert name == want and isinstance(name, str)
    assert memory >= _memory() > 0 and memory % os.sysconf("SC_PAGE_SIZE") == 0


PS, SLOTS = 4, 24


@pytest.mark.parametrize("side", ["first", "last"])
@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
def test_the_warm_check_refuses_a_kernel_view_that_misses_the_layers_first_or_last_slot(layout, side):
    """_warm validates the first AND the last slot of each layer's own index space: a layout (the kernels' view)
    whose index space starts just after the page of the layer's first slot, or ends just before the page of its
    last one, makes it raise RuntimeError naming the layer, the pages it validated and what it expected; the pool's
    own layouts pass. NUMBERING: page of a slot = base + offset + slot * scale, valid iff base <= p < upper_bound
    and (p - base - offset) % scale == 0."""
    spec = CacheSpec((LayerSpec(1, 32), LayerSpec(1, 32, sliding_window=8), LayerSpec(2, 64)), PS, layout)
    for layer in range(3):
        caches = CacheSet(spec, SLOTS, 0, 3, ops_numpy, max_seq_len=64)
        server._warm(caches)                                               # the pool's own geometry is clean
        geo = caches.geometry
        lay = caches.layouts[layer]
        slots = geo.groups[geo.layers[layer].group].num_slots
        first = lay.base + lay.offset
        last = first + (slots - 1) * lay.scale
        assert lay.base <= first < last < lay.upper_bound
        if side == "last":                                                 # one page short of the last slot
            short = dataclasses.replace(lay, upper_bound=last)
        else:                                                              # the same pages, from first + 1 on
            short = dataclasses.replace(lay, base=first + 1, offset=-1)
        assert [short.page_index(0), short.page_index(slots - 1)] == [first, last]
        caches.layouts[layer] = short
        others = [s for s in geo.index_spaces if s.id != geo.layers[layer].index_space]
        with pytest.raises(RuntimeError) as err:
            server._warm(caches)
        msg = str(err.value)
        assert msg.startswith(f"layer {layer}: the kernels disagree with the pool geometry: validating pages "
                              f"[{first}, {last}"), msg
        want = f"expected {len(others)} x wrong_index_space" if others else "expected 0 x None"
        assert re.search(rf"{re.escape(want)} from position 2$", msg), msg


GENS_MSG = "step carries no page generations (a manager older than this worker: upgrade it)"


def test_a_reply_leaving_no_page_generations_is_refused_and_a_delta_drops_the_table(monkeypatch):
    """Behind TablePlan.check (which refuses a reply without UINT32 generations first), DeviceTables' own apply
    step refuses a reply after which the table holds no page generations, with the exact message: a full reply
    creates nothing; a delta drops the table it applied to (asking for it then is NotFound)."""
    monkeypatch.setattr(TablePlan, "check", lambda self, reply, held_rows: None)
    stream = Stream(_manager(7), True)
    tables = _tables(stream)
    ids, lens = [4, 11, 23], [5, 9, 2]
    full = stream.step(admit_seq_ids=ids, admit_num_tokens=lens)
    bare = type(full)()
    bare.CopyFrom(full)
    for st in bare.tables:
        st.ClearField("generations")
    with pytest.raises(InvalidArgument) as err:
        tables.update("ten", "a", bare)
    assert str(err.value) == GENS_MSG
    with pytest.raises(NotFound, match=r"^no tables 'a' on this worker \(UpdateTables creates them\)$"):
        tables.slot_mapping("ten", "a", 0)                                     # nothing was created
    tables.update("ten", "b", full)
    sm, gens = tables.slot_mapping("ten", "b", 0)
    assert len(np.asarray(sm)) == sum(lens) and len(np.asarray(gens)) == sum(lens)
    step = stream.step(extend_seq_ids=ids, extend_num_tokens=[1, 1, 1])
    for st in step.tables:
        st.delta.ClearField("generations")
    with pytest.raises(InvalidArgument) as err:
        tables.update("ten", "b", step)
    assert str(err.value) == GENS_MSG
    with pytest.raises(NotFound, match=r"^no tables 'b' on this worker \(UpdateTables creates them\)$"):
        tables.slot_mapping("ten", "b", 0)                                     # the delta dropped the table
