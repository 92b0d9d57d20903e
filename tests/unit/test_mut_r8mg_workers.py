"""WorkerRegistry.register refuses an empty layer range: a worker serves layers [layer_begin, layer_end), at least
one, inside the pool's [0, num_layers) (block_manager.proto's RegisterWorkerRequest; layer_end 0 = to the last)."""

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.manager.workers import WorkerRegistry


@pytest.mark.parametrize("at", [1, 3])
def test_an_empty_layer_range_is_refused_naming_it(at):
    reg = WorkerRegistry()
    with pytest.raises(InvalidArgument) as e:
        reg.register("w", "p", 4, layer_begin=at, layer_end=at)
    assert e.value.message == f"layers [{at}, {at}) are not inside pool 'p''s [0, 4)"
    assert reg.workers() == []
    rec = reg.register("w", "p", 4, layer_begin=at, layer_end=at + 1)
    assert (rec.layer_begin, rec.layer_end) == (at, at + 1)
