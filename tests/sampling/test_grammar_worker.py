"""The grammar compile child: a crash or a hang fails one constraint, is logged once, and the next compile gets
a new child; compiles run off the caller's thread, and cached grammars never wait behind a slow compile."""

from __future__ import annotations

import logging
import time

import pytest
from grammar_stubs import ABORT, SLOW, stub_env
from helpers import build_tiny_tokenizer

from heron.errors import InvalidRequestError
from heron.sampling.structured import StructuredOutputCompiler
from heron.sampling_params import GuidedDecodingParams


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(autouse=True)
def stub_compile(monkeypatch):
    for name, value in stub_env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def compiler(tokenizer):
    return StructuredOutputCompiler(tokenizer, len(tokenizer), [2])


def ref_chain(n: int) -> dict:
    """A schema of ``n`` objects, each holding the next by $ref: xgrammar's compiler recurses through it."""
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["next"]}
            for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def test_a_crash_fails_that_constraint_only(compiler, caplog):
    assert compiler.submit(GuidedDecodingParams(regex="ab|cd")).result() is not None
    first_pid = compiler.worker.pid
    with caplog.at_level(logging.ERROR), pytest.raises(InvalidRequestError) as err:
        compiler.submit(GuidedDecodingParams(regex=f"x|{ABORT}")).result()
    assert err.value.param == "guided_regex"
    assert str(err.value) == "the grammar compiler crashed (killed by SIGABRT) on this regex; simplify it"
    assert [r.getMessage() for r in caplog.records].count(
        f"the grammar compiler process (pid {first_pid}) died (killed by SIGABRT) compiling a regex constraint; "
        "that request fails, the next grammar starts a new process") == 1
    assert compiler.submit(GuidedDecodingParams(choice=["yes", "no"])).result() is not None
    assert compiler.worker.pid not in (None, first_pid)


def test_a_real_native_crash_is_contained(compiler):
    """A chain of 5,000 nested $refs overflows xgrammar's stack (the bounds in GuidedDecodingParams refuse it
    first; here it is set past them)."""
    guided = GuidedDecodingParams(json={"type": "string"})
    guided.json = ref_chain(5000)
    with pytest.raises(InvalidRequestError, match=r"crashed \(killed by SIGSEGV\) on this schema"):
        compiler.submit(guided).result()
    chain = GuidedDecodingParams(json=ref_chain(300))
    assert compiler.submit(chain).result() is not None


def test_a_compile_past_the_timeout_is_killed(tokenizer):
    compiler = StructuredOutputCompiler(tokenizer, len(tokenizer), [2], timeout=2)
    compiler.submit(GuidedDecodingParams(regex="warm")).result()  # the child's start-up is not timed
    with pytest.raises(InvalidRequestError, match="the grammar compiler took longer than 2 s on this choice list"):
        compiler.submit(GuidedDecodingParams(choice=[SLOW])).result()
    assert compiler.submit(GuidedDecodingParams(regex="warm again")).result() is not None


def test_compiles_are_off_the_callers_thread_and_cached_ones_do_not_wait(compiler):
    cached = GuidedDecodingParams(regex="[a-z]+")
    compiler.submit(cached).result()
    start = time.time()
    slow = compiler.submit(GuidedDecodingParams(regex=SLOW))
    same = compiler.submit(GuidedDecodingParams(regex=SLOW))
    hit = compiler.submit(cached)
    assert time.time() - start < 0.5 and not slow.done() and same is slow and hit.done()
    assert slow.result() is not None
