"""Client construction without a server: TLS files read as given, and reprs that say whether a token is set but
never show it (client.py: the bearer token is never logged)."""

from __future__ import annotations

import os

from kvservice.client.client import BlockManagerClient, TLSOptions
from kvservice.client.worker_client import WorkerClient


def test_tls_options_read_each_file_it_is_given(tmp_path):
    blobs = {name: os.urandom(64) for name in ("ca", "cert", "key")}
    for name, data in blobs.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
    t = TLSOptions.from_files(tmp_path / "ca.pem", str(tmp_path / "cert.pem"), tmp_path / "key.pem", "mgr.internal")
    assert (t.ca, t.cert, t.key, t.server_name) == (blobs["ca"], blobs["cert"], blobs["key"], "mgr.internal")
    only_ca = TLSOptions.from_files(ca=tmp_path / "ca.pem")
    assert (only_ca.ca, only_ca.cert, only_ca.key, only_ca.server_name) == (blobs["ca"], None, None, None)
    assert "key=" not in repr(t)                   # the private key is left out of the repr


def test_reprs_say_whether_a_token_is_set_and_never_show_it():
    secret = "s3cret-token-" + os.urandom(8).hex()
    for cls in (WorkerClient, BlockManagerClient):
        name = cls.__name__
        with cls("127.0.0.1:1") as plain, cls("127.0.0.1:1", token=secret) as tok:
            assert repr(plain) == f"{name}('127.0.0.1:1', token=none)"
            assert repr(tok) == f"{name}('127.0.0.1:1', token=set)" and secret not in repr(tok)
