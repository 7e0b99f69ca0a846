"""POST /v1/embeddings and vLLM's /pooling (a server started with ``--runner pooling``): one engine pooling
request per input, answered together once all are pooled."""

from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from heron.engine.outputs import RequestOutput
from heron.errors import InvalidRequestError
from heron.pooling_params import PoolingParams
from heron.server.http_errors import APIError
from heron.server.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PoolingData,
)
from heron.server.serving import Serving, new_request_id
from heron.server.streaming import wait_for_request


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or as base64 of little-endian float32 (what OpenAI's clients decode)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class Embeddings:
    """Serves the embeddings API, and ``/pooling`` (the same vectors under vLLM's raw names)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, req: EmbeddingRequest, raw: Request, pooling_api: bool = False) -> Response:
        request_id = raw.state.request_id = new_request_id("pool" if pooling_api else "embd")
        if req.dimensions is not None:  # truncating is sound only for models trained for it (Matryoshka)
            raise InvalidRequestError(f"Model \"{self.serving.model_name}\" does not support matryoshka "
                                      "representation, changing output dimensions will lead to poor results",
                                      param="dimensions")
        streams = await self.serving.open(req.inputs(), PoolingParams(normalize=req.normalize), request_id,
                                          req.priority, req.add_special_tokens)
        try:
            finals = await wait_for_request(raw, self.serving.collect(streams))
        finally:
            self.serving.close(streams)
        vectors = [encode_vector(self._vector(out), req.encoding_format) for out in finals]
        data_type = PoolingData if pooling_api else EmbeddingData
        data = [data_type(index=i, **{"data" if pooling_api else "embedding": v}) for i, v in enumerate(vectors)]
        num_tokens = sum(len(out.prompt_token_ids) for out in finals)
        response = EmbeddingResponse(id=request_id, model=self.serving.model_name, data=data,
                                     usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        return JSONResponse(response.model_dump())

    @staticmethod
    def _vector(out: RequestOutput) -> list[float]:
        if out.pooled is None:
            raise APIError(500, f"pooling request {out.request_id} failed: {out.error or 'aborted'}",
                           code="internal_error")
        return out.pooled
