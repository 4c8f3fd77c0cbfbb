"""Admission control at the gateway: a refusal is an OpenAI-shaped 429 with Retry-After, and
`wait_s` reaches the router (bounded). The rule is the router's
(packages/areal-router/tests/test_admission.py); the whole path on a real engine is
tests/e2e/test_admission.py."""

from __future__ import annotations

import httpx
from conftest import ADMIN_KEY, Stack

from areal_runtime.errors import AdmissionRefused

HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_a_refused_start_is_a_429_with_retry_after(stack: Stack) -> None:
    stack.register("adm", ["p0"])
    stack.router.refuse_starts = AdmissionRefused(
        "Model 'adm' is at max_concurrent_rollouts=2 (2 running). Retry after the "
        "Retry-After delay, pass wait_s to wait for room, or end sessions.",
        code="capacity_exhausted",
        retry_after_s=3,
    )
    try:
        with httpx.Client(base_url=stack.url, timeout=10) as c:
            r = c.post(
                "/rl/start_session",
                headers=HEADERS,
                json={"model": "adm", "group_size": 2, "wait_s": 1.5},
            )
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "3"
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "capacity_exhausted"
        assert "max_concurrent_rollouts" in err["message"]
        bind = stack.router.binds[-1]
        # The group's sessions are the samples; the group pin is not one.
        assert len(bind.admission.sample_ids) == 2 and bind.admission.wait_s == 1.5
        assert all(not s.startswith("group:") for s in bind.admission.sample_ids)
        assert [s for s in bind.session_ids if s.startswith("group:")]
    finally:
        stack.router.refuse_starts = None


def test_a_bad_wait_names_the_field(stack: Stack) -> None:
    stack.register("adm", ["p0"])
    with httpx.Client(base_url=stack.url, timeout=10) as c:
        for bad in (-1, 601, "5", None):
            r = c.post("/rl/start_session", headers=HEADERS, json={"model": "adm", "wait_s": bad})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "wait_s"
