"""create_request's defaults (kvservice/state/startup.py): a pool configured without prefix caching, model or
prefix-hash settings asks for none of them, so its CreatePool request leaves those fields at protobuf's defaults
(False and the empty string: the proto3 "unset" values the manager reads as "not configured")."""

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.state.startup import create_request
from kvservice.v1 import block_manager_pb2 as pb


def test_a_pool_configured_with_nothing_optional_leaves_every_optional_field_unset():
    r = create_request("q", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=40, max_seq_len=256), ())
    assert (r.enable_prefix_caching, r.model, r.prefix_hash, r.prefix_hash_seed) == (False, "", "", "")
    unset = pb.CreatePoolRequest()
    assert (r.model, r.prefix_hash, r.prefix_hash_seed) == (unset.model, unset.prefix_hash, unset.prefix_hash_seed)
    assert list(r.backends) == [] and r.name == "q"
