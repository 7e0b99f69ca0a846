"""A native grammar compiler cannot take the server down or stall other requests: a compiler crash costs the one
request (a 400 before any stream starts), a slow compile holds no other request, oversized constraints are
refused before any compiler sees them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from grammar_stubs import ABORT, SLOW, stub_env

from heron.sampling_params import MAX_GUIDED_BYTES, MAX_GUIDED_DEPTH


def test_grammar_crash_slow_compile_and_bounds(launch_server, tiny_model_dir):
    server = launch_server(tiny_model_dir("llama"), env=stub_env()).wait_healthy()
    url = server.url + "/v1/completions"

    def complete(timeout: float = 60, **body) -> httpx.Response:
        return httpx.post(url, json={"prompt": "Hello", "temperature": 0, **body}, timeout=timeout)

    r = complete(max_tokens=5, stream=True, guided_regex=f"a|{ABORT}")
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["param"] == "guided_regex"
    assert error["message"] == "the grammar compiler crashed (killed by SIGABRT) on this regex; simplify it"
    assert httpx.get(server.url + "/health").status_code == 200
    assert complete(max_tokens=2).status_code == 200
    r = complete(max_tokens=5, guided_choice=["yes", "no"])  # compiled by a new child
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    assert server.log().count("the grammar compiler process") == 1

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(complete, max_tokens=30, guided_regex=f"({SLOW})")
        time.sleep(0.5)  # its compile is under way (the stub sleeps 3 s)
        start = time.time()
        r = complete(max_tokens=1)
        elapsed = time.time() - start
        assert r.status_code == 200 and elapsed < 1.0, elapsed
        assert not slow.done()
        assert slow.result().status_code == 200 and slow.result().json()["choices"][0]["text"] == SLOW

    deep: dict = {"type": "string"}
    for _ in range(MAX_GUIDED_DEPTH):
        deep = {"type": "array", "items": deep}
    for body, limit in [({"guided_json": {"type": "string", "description": "x" * MAX_GUIDED_BYTES}}, "65536"),
                        ({"guided_json": deep}, f"deeper than {MAX_GUIDED_DEPTH} levels"),
                        ({"guided_regex": "(" * 65 + "a" + ")" * 65}, f"deeper than {MAX_GUIDED_DEPTH} levels")]:
        r = complete(max_tokens=2, **body)
        assert r.status_code == 400 and limit in r.json()["error"]["message"], r.text
