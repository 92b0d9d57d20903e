"""create_request: the CreatePool request of a configured pool carries every configured field (it is journaled and
replayed like an API CreatePool, so a field it drops is a pool that comes back different)."""

from kvservice.contract.convert import cache_spec_from_proto, sizing_from_proto
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.state.startup import create_request


def test_create_request_carries_every_configured_field():
    """Name, geometry, sizing, backends (in order), prefix caching, model and prefix-hash settings all arrive."""
    spec = CacheSpec.uniform(3, 2, 128, page_size=32)
    sizing = Sizing(num_slots=77, max_seq_len=1024)
    r = create_request("p7", spec, sizing, ("cuda", "cpu"), prefix_caching=True, model="llama-x",
                       prefix_hash="sha256", prefix_hash_seed="s33d")
    assert r.name == "p7" and list(r.backends) == ["cuda", "cpu"]
    assert cache_spec_from_proto(r.cache) == spec
    assert (r.sizing.num_slots, r.sizing.max_seq_len) == (77, 1024) and sizing_from_proto(r.sizing) == sizing
    assert (r.enable_prefix_caching, r.model, r.prefix_hash, r.prefix_hash_seed) == (True, "llama-x", "sha256",
                                                                                      "s33d")
    assert r.request_id == ""
