"""The 2026 incident, reproduced with the `unsafe_reject_path` fault: an over-length request is
"rejected" by swapping in a placeholder token, prefill sends KV for the placeholder only, and
decode proceeds as if every page were written.

- with page tags off the bug is live: the request's output depends on whoever used its pages
  before (it reads their stale KV), and it gets HTTP 200;
- with page tags on (S1) the stale read is caught at read time and fails that request only;
- without the fault (the healthy engine) it never gets past intake (S2).
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import openai
from pd_harness import client, complete, deployment, metric, reference_text, served_model, wait_pools_empty

POOL, CONTEXT = 128, 128  # one request can span the whole pool: every page gets reused
OVER_LENGTH = "o" * 200  # longer than the context


def _over_length(d) -> str:  # type: ignore[no-untyped-def]
    return client(d).completions.create(model=served_model(d), prompt=OVER_LENGTH, max_tokens=8, temperature=0).choices[0].text


def test_without_tags_the_incident_leaks_another_requests_kv(tiny_model_dir: Path) -> None:
    with deployment(tiny_model_dir, "unsafe_reject_path,no_tags", kv_pool_tokens=POOL, context_length=CONTEXT, allow_small_pool=True) as d:
        after = {}
        for tenant in ("alice's secret order #1234 " * 2, "bob's medical record 5678 " * 2):
            complete(d, tenant, max_tokens=60)  # fills and releases pages the next request reuses
            after[tenant] = _over_length(d)  # HTTP 200: the bug
        first, second = after.values()
        assert first != second, "the over-length request's output should depend on the previous tenant's KV"
        assert metric(d, "decode", "kvguard_tag_violations_total") == 0  # nothing noticed
        wait_pools_empty(d)


def test_with_tags_the_stale_read_fails_only_that_request_s1(tiny_model_dir: Path) -> None:
    with deployment(tiny_model_dir, "unsafe_reject_path", kv_pool_tokens=POOL, context_length=CONTEXT, allow_small_pool=True) as d:
        complete(d, "a previous tenant " * 3, max_tokens=60)
        bystanders = [f"bystander {i}" for i in range(4)]
        with cf.ThreadPoolExecutor(5) as pool:
            others = [pool.submit(complete, d, p, 20) for p in bystanders]
            try:
                _over_length(d)
                raise AssertionError("the stale read was not caught")
            except openai.APIStatusError as err:
                assert err.status_code == 500 and err.code == "kv_tag_violation"
            outputs = [f.result() for f in others]
        assert outputs == [reference_text(tiny_model_dir, p, 20, kv_pool_tokens=POOL, context_length=CONTEXT) for p in bystanders]
        assert metric(d, "decode", "kvguard_tag_violations_total") >= 1
        wait_pools_empty(d)
