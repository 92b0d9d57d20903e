"""kvservice/server/ha.py: open_journal's defaults are its contract: called without readonly it inspects, writing
nothing (its docstring: "readonly: inspection (kvservice check-state nats://...): nothing is written").

Oracles: the docstring, nats-server's own list of connections (/connz) for the connection name an inspection uses
("kvservice-inspect"), and kvservice/state/nats/assets.py's documented refusal for a store that is not created
("no kvservice journal there (stream ... is missing)") with nats-server's stream listing showing nothing was made.
"""

from __future__ import annotations

import pytest

from kvservice.state.nats.config import Unrecoverable
from tests.unit.test_mut_d5hm_ha import LEASE, _config, _seed
from tests.unit.test_server_ha_units import _connections


def test_open_journal_by_default_opens_an_inspection_connection_with_a_read_only_store(nats1) -> None:
    from kvservice.server.ha import open_journal

    config = _config(nats1)
    seq = _seed(config)
    before = set(_connections(nats1))
    j = open_journal(config, LEASE)
    try:
        opened = [n for cid, n in _connections(nats1).items() if cid not in before]
        assert opened == ["kvservice-inspect"]
        assert j.store.readonly is True and j.seq == seq and j.manager.pool_names() == ["p"]
    finally:
        j.close(snapshot=False)


def test_open_journal_by_default_creates_no_journal_where_there_is_none(nats1) -> None:
    import asyncio

    import nats

    from kvservice.server.ha import open_journal

    config = _config(nats1)                                   # a fresh name: no stream, no bucket
    with pytest.raises(Unrecoverable) as err:
        open_journal(config, LEASE, startup_seconds=5.0)
    assert f"no kvservice journal there (stream {config.stream} is missing)" in err.value.message

    async def streams() -> list[str]:
        nc = await nats.connect(list(nats1.urls))
        try:
            return [s.config.name for s in await nc.jetstream().streams_info()]
        finally:
            await nc.close()
    assert config.stream not in asyncio.run(streams())
