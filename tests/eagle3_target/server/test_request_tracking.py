"""Request ids: a client's well-formed id is kept, anything else replaced by a fresh one."""

from __future__ import annotations

from eagle3_target.server.request_tracking import pick_request_id


def test_request_ids():
    assert pick_request_id("abc-123") == "abc-123"
    fresh = pick_request_id("spaces are not ok")
    assert fresh != "spaces are not ok" and len(fresh) == 32
    assert pick_request_id(None) != pick_request_id(None)
