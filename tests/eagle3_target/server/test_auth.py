"""The bearer-token check every data route sits behind."""

from __future__ import annotations

from eagle3_target.server.auth import bearer_matches


def test_bearer_matches():
    assert bearer_matches("Bearer tok", "tok")
    assert bearer_matches("bearer tok", "tok")
    assert not bearer_matches(None, "tok")
    assert not bearer_matches("Bearer tok2", "tok")
    assert not bearer_matches("Basic tok", "tok")
    assert not bearer_matches("tok", "tok")
