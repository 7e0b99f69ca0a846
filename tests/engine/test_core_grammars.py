"""Grammars compile off the step loop: a request waits for its grammar (vLLM's WAITING_FOR_FSM) while the others
run, joins the queue once compiled or is rejected with the compile's error, and never trips the stall guard."""

from __future__ import annotations

import select

import pytest
from grammar_stubs import ABORT, SLOW, stub_env

from heron import LLM, SamplingParams
from heron.engine.messages import EngineCoreRequest
from heron.errors import InvalidRequestError
from heron.sampling_params import GuidedDecodingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        for name, value in stub_env().items():
            mp.setenv(name, value)
        llm = LLM(tiny_model_dir("llama"), dtype="float32")
        llm.generate(["warm"], SamplingParams(max_tokens=1, guided_decoding=GuidedDecodingParams(regex="up")),
                     use_tqdm=False)  # starts the compile child under the stub
        yield llm


def guided(regex: str, max_tokens: int = 30) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, guided_decoding=GuidedDecodingParams(regex=regex))


def wait_for_compile(core) -> None:
    assert select.select(core.wait_handles(), [], [], 60)[0], "no compile ended within 60 s"


def run_to_end(core) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_work_to_step():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_requests_run_while_a_grammar_compiles(llm):
    core = llm.engine.core
    assert core.add_request(EngineCoreRequest("g", [5, 6, 7], guided(f"({SLOW})"))) is False
    assert core.add_request(EngineCoreRequest("p", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))) is True
    assert len(run_to_end(core)["p"]) == 3
    assert core.has_unfinished_requests() and not core.has_work_to_step()
    assert core.step() == [] and core.stats().num_waiting == 1  # no stall error: "g" is not scheduled yet
    wait_for_compile(core)
    assert core.admit_compiled() == (["g"], [])
    text = llm.engine.tokenizer.decode(run_to_end(core)["g"], skip_special_tokens=True)
    assert text == SLOW and not core.has_unfinished_requests()


def test_a_failed_compile_rejects_only_that_request(llm):
    core = llm.engine.core
    assert core.add_request(EngineCoreRequest("crash", [5], guided(ABORT))) is False
    wait_for_compile(core)
    admitted, [rejection] = core.admit_compiled()
    assert not admitted and rejection.request_id == "crash" and rejection.kind == "InvalidRequestError"
    assert rejection.param == "guided_regex" and "the grammar compiler crashed" in rejection.message
    assert not core.has_unfinished_requests()
    assert core.add_request(EngineCoreRequest("after", [5], guided("(yes|no)", 5))) is False  # a new child
    wait_for_compile(core)
    assert core.admit_compiled() == (["after"], [])
    assert llm.engine.tokenizer.decode(run_to_end(core)["after"], skip_special_tokens=True) in ("yes", "no")


def test_an_abort_while_compiling_leaves_nothing(llm):
    core = llm.engine.core
    assert core.add_request(EngineCoreRequest("gone", [5], guided(f"{SLOW}|x"))) is False
    core.abort_requests(["gone"])
    assert not core.has_unfinished_requests()
    wait_for_compile(core)
    assert core.admit_compiled() == ([], [])
    assert core.add_request(EngineCoreRequest("gone", [5], guided(f"{SLOW}|x"))) is True  # compiled: cached
    run_to_end(core)
    core.block_manager.check_invariants()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_in_process_adds_wait_for_the_compile_and_raise_its_error(llm):
    with pytest.raises(InvalidRequestError, match="the grammar compiler crashed"):
        llm.generate(["hi"], guided(f"{ABORT}|z"), use_tqdm=False)
    [out] = llm.generate(["hi"], guided("(cat|dog)"), use_tqdm=False)
    assert out.outputs[0].text in ("cat", "dog")
