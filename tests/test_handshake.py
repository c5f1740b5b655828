"""The one admission rule every dialect applies (service.handshake.admission)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from whistle_stream.service import protocol as P
from whistle_stream.service.handshake import admission


def app(token="secret", draining=False, ready=True, full=False):
    return SimpleNamespace(config=SimpleNamespace(token=token, max_sessions=3), draining=draining, ready=ready,
                           full=full)


@pytest.mark.parametrize("state, code", [
    ({}, None),
    ({"full": True}, P.ErrorCode.SERVER_FULL),
    ({"ready": False}, P.ErrorCode.NOT_READY),
    ({"draining": True, "full": True}, P.ErrorCode.SHUTTING_DOWN),
    ({"ready": False, "full": True}, P.ErrorCode.NOT_READY),
])
def test_a_drain_or_loading_comes_before_capacity(state, code):
    refused = admission(app(**state), "Bearer secret", "")
    assert (refused and refused.code) == code
    if code == P.ErrorCode.SERVER_FULL:
        assert "limit of 3 sessions" in refused.message


@pytest.mark.parametrize("state", [{}, {"full": True}, {"draining": True}, {"ready": False}])
def test_the_token_decides_first(state):
    refused = admission(app(**state), "Bearer wrong", "")
    assert refused is not None and refused.code == P.ErrorCode.UNAUTHORIZED


def test_without_credentials_the_token_is_not_asked_for():
    assert admission(app(), None, "", authorize=False) is None
    assert admission(app(token=None), None, "") is None
