"""write_manifest's whole contract (kvservice/state/sqlite/dirfiles.py: "replaced atomically (write, fsync, rename,
fsync the dir)"): the bytes it leaves, and the order and arguments of the calls that make it atomic.

The file's bytes are rebuilt by hand: one field per line, keys sorted, one space of indent, a final newline.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from kvservice.state.sqlite.dirfiles import read_manifest, write_manifest


def test_write_manifest_writes_sorted_json_through_a_synced_temp_file_then_syncs_the_dir(tmp_path, monkeypatch):
    rng = np.random.default_rng(7_30)
    fields = {"incarnation": int(rng.integers(1, 1000)), "running": bool(rng.integers(2)),
              "last_seq": int(rng.integers(0, 2**40)), "snapshot_seq": int(rng.integers(0, 2**40)),
              "lineage": f"{int(rng.integers(1, 2**62)):016x}", "acked_mark": True}
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_manifest(tmp_path, **fields)
    monkeypatch.undo()
    tmp, final = str(tmp_path / "MANIFEST.tmp"), str(tmp_path / "MANIFEST")
    assert calls == [("fsync", tmp), ("replace", tmp, final), ("fsync", str(tmp_path))]
    raw = (tmp_path / "MANIFEST").read_bytes()
    m = json.loads(raw)
    body = {k: v for k, v in m.items() if k != "digest"}
    assert m["digest"] == hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()
    assert set(m) == {"format", "updated", "digest", *fields} and m["format"] == 2
    lines = [f' "{k}": {json.dumps(m[k])}' for k in sorted(m)]
    assert raw == ("{\n" + ",\n".join(lines) + "\n}\n").encode()
    assert read_manifest(tmp_path) == m
    assert sorted(p.name for p in tmp_path.iterdir()) == ["MANIFEST"]
