"""tests/conftest.py scales every per-test time limit by the machine's load (KVS_TIMEOUT_SCALE overrides)."""

import pytest


def _limit(request) -> float:
    marker = request.node.get_closest_marker("timeout")
    return float(marker.args[0]) if marker else float(request.config.getini("timeout"))


def test_the_default_limit_is_scaled(request):
    assert _limit(request) == pytest.approx(300 * request.config._kvs_timeout_scale)


@pytest.mark.timeout(7)
def test_a_declared_limit_is_scaled(request):
    assert _limit(request) == pytest.approx(7 * request.config._kvs_timeout_scale)


def test_the_scale_is_the_load_per_core_bounded(monkeypatch):
    from tests.conftest import MAX_TIMEOUT_SCALE, timeout_scale

    monkeypatch.delenv("KVS_TIMEOUT_SCALE", raising=False)
    monkeypatch.setattr("os.getloadavg", lambda: (100.0, 0.0, 0.0))
    assert timeout_scale() == MAX_TIMEOUT_SCALE
    monkeypatch.setattr("os.getloadavg", lambda: (0.1, 0.0, 0.0))
    assert timeout_scale() == 1.0
    monkeypatch.setenv("KVS_TIMEOUT_SCALE", "2.5")
    assert timeout_scale() == 2.5
