"""The core process and its client: messages survive msgpack, errors keep their class, a core's end is reported."""

from __future__ import annotations

import queue

import msgspec
import pytest

from heron.config import EngineConfig
from heron.engine.core_client import CoreClient, rebuild_error
from heron.engine.core_process import AddRequest, CoreCommand, CoreEvent, CoreStep
from heron.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, RequestRejection
from heron.engine.outputs import EngineStats
from heron.errors import ConfigError, EngineDeadError, EngineOverloadedError, PromptTooLongError
from heron.sampling.sampler import TokenLogprobs
from heron.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams
from tests.server.fake_core import FakeCore


def _round_trip(message, kind):
    return msgspec.msgpack.Decoder(kind).decode(msgspec.msgpack.Encoder().encode(message))


def test_a_request_survives_msgpack():
    params = SamplingParams(n=2, temperature=0.5, seed=2**63, stop=["x", "yz"], stop_token_ids=[3],
                            logit_bias={5: -1.0}, bad_words=["no"], logprobs=2, output_kind=RequestOutputKind.DELTA,
                            guided_decoding=GuidedDecodingParams(json={"type": "object"}), extra={"k": [1, "v"]})
    params.bad_words_token_ids = [[7, 8]]
    request = EngineCoreRequest("r1", [1, 2, 3], params, priority=-1, arrival_time=12.5)
    back = _round_trip(AddRequest(request), CoreCommand).request
    assert back == request
    assert back.sampling_params.output_kind is RequestOutputKind.DELTA
    assert isinstance(back.sampling_params.guided_decoding, GuidedDecodingParams)
    choice = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert _round_trip(AddRequest(EngineCoreRequest("r2", [1], choice)), CoreCommand).request.sampling_params == choice


def test_a_step_survives_msgpack():
    outputs = EngineCoreOutputs(
        [EngineCoreOutput("r1", 1, [4, 5], [TokenLogprobs(4, -0.1, 1, [(4, -0.1), (9, -2.0)])] * 2,
                          finish_reason="stop", stop_reason=5)],
        admitted=["r1"], rejected=[RequestRejection("r2", "PromptTooLongError", "too long", "prompt")],
        stats=EngineStats(num_running=3, finished_by_reason={"stop": 2}))
    assert _round_trip(CoreStep(outputs), CoreEvent).outputs == outputs


def test_errors_keep_their_class():
    error = rebuild_error("PromptTooLongError", "too long", "prompt")
    assert isinstance(error, PromptTooLongError) and error.param == "prompt" and str(error) == "too long"
    assert isinstance(rebuild_error("EngineOverloadedError", "busy"), EngineOverloadedError)
    assert isinstance(rebuild_error("KeyError", "'x'"), RuntimeError)


def failing_core(config: EngineConfig) -> None:
    raise ConfigError("--max-model-len 99999 exceeds the model's maximum of 64")


class _Recorder:
    """The client's callbacks, queued for the test thread."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()

    def client(self, factory) -> CoreClient:
        return CoreClient(EngineConfig(model="fake"), lambda info: self.events.put(("ready", info)),
                          lambda outs: self.events.put(("outputs", outs)),
                          lambda error: self.events.put(("dead", error)), factory)

    def next(self, kind: str):
        while True:
            got, value = self.events.get(timeout=30)
            if got == kind:
                return value


def test_client_adds_steps_and_shuts_down():
    recorder = _Recorder()
    client = recorder.client(FakeCore)
    client.start()
    try:
        assert recorder.next("ready").model_name == "fake"
        client.add_request(EngineCoreRequest("r1", [0], SamplingParams(max_tokens=2)))
        client.add_request(EngineCoreRequest("r2", list(range(64)), SamplingParams()))
        tokens, admitted, rejected = [], [], []
        while len(tokens) < 2 or not rejected:  # r2's rejection may come a turn after r1's tokens
            outs = recorder.next("outputs")
            admitted += outs.admitted
            rejected += outs.rejected
            tokens += [t for o in outs.outputs for t in o.new_token_ids]
        assert tokens == [1, 2] and admitted == ["r1"]
        assert [(r.request_id, r.kind, r.param) for r in rejected] == [("r2", "PromptTooLongError", "prompt")]
    finally:
        client.shutdown()
    assert all(kind != "dead" for kind, _ in list(recorder.events.queue))  # a shutdown is no death
    with pytest.raises(EngineDeadError):
        client.abort_requests(["r1"])


def test_a_core_that_fails_to_load_reports_the_error():
    recorder = _Recorder()
    client = recorder.client(failing_core)
    client.start()
    try:
        error = recorder.next("dead")
    finally:
        client.shutdown()
    assert isinstance(error, ConfigError) and "99999" in str(error)
