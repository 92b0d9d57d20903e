"""The committed stubs in kvservice/v1 are exactly what protoc generates from protos/ now."""

import sys
from pathlib import Path

from tests.ci import need_module

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_protos(tmp_path):
    need_module("grpc_tools", "pip package grpcio-tools, the dev extra")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gen_protos import generate
    finally:
        sys.path.pop(0)
    generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is not committed; run `make protos`"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} drifted from protos/; run `make protos`"
