"""layer_kinds' refusals, whole message: the default `where` ("config.json", the file a model ships its config in)
and the list of known hybrid_override_pattern characters, as Nemotron-H's config defines them."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.core.layer_kinds import layer_kinds


@pytest.mark.parametrize("seed", range(3))
def test_unknown_override_character_is_refused_with_the_whole_documented_message(seed):
    """An unknown character in hybrid_override_pattern is InvalidArgument naming the default file, the field, the
    first unknown character, and every known character with what it means (M Mamba, * attention, - MLP, E MoE)."""
    rng = np.random.default_rng(2100 + seed)
    n = int(rng.integers(3, 40))
    chars = [str(c) for c in rng.choice(list("M*-E"), n)]
    bad = str(rng.choice(list("XQz0+")))
    at = int(rng.integers(0, n))
    chars[at] = bad
    for cfg in ({"hybrid_override_pattern": "".join(chars)},
                {"num_hidden_layers": n, "hybrid_override_pattern": "".join(chars)}):
        with pytest.raises(InvalidArgument) as exc:
            layer_kinds(cfg)
        assert exc.value.message == (f"config.json: field 'hybrid_override_pattern' has {bad!r}; known: M (Mamba), "
                                     "* (attention), - (MLP), E (MoE)")


def test_default_where_names_config_json_in_a_missing_field():
    """Without `where`, a refusal names config.json: a config stating no pattern and no num_hidden_layers."""
    with pytest.raises(InvalidArgument) as exc:
        layer_kinds({"model_type": "llama"})
    assert exc.value.message == ("config.json: field 'num_hidden_layers' is missing; it is needed to size the KV "
                                 "cache")
