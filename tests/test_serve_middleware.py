"""The `vinterp` body-field middleware around a completions route whose client has left: vLLM
0.32's route then answers `null`, 0.33's an empty body. Either goes back as it came, and the
request's captures are still taken from the workers (dropped, never kept). Around any other
route, a body declared over the size limit is refused before the route reads it. The routes
and the engine client stand in for vLLM's (no engine here; tests/test_serve.py and
tests/test_serve_faults.py run the real server)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient
from transformers import LlamaConfig

from vinterp.serve import client_limits
from vinterp.serve.client_limits import ServeLimits
from vinterp.serve.fields import vinterp_fields


class EngineClient:
    """What the middleware reads of vLLM's engine client: its configuration (the model's
    config in it) and the workers' RPCs (each worker answers with no captured rows)."""

    def __init__(self) -> None:
        config = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2)
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(
                hf_config=config, served_model_name="m", dtype="float32", max_model_len=64
            ),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4),
            cache_config=SimpleNamespace(enable_prefix_caching=False),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
            additional_config={},
        )
        self.calls: list[tuple[str, Any]] = []

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[dict]:
        self.calls.append((method, args))
        return [{}]


@pytest.mark.parametrize(
    "left", [JSONResponse(None), Response(b"")], ids=["vllm-0.32-null", "vllm-0.33-empty"]
)
def test_a_route_whose_client_left_goes_back_as_it_came_and_its_captures_are_dropped(
    left: Response,
) -> None:
    async def completions(request: Any) -> Response:
        return left

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.add_middleware(BaseHTTPMiddleware, dispatch=vinterp_fields)
    engine = app.state.engine_client = EngineClient()
    body = {"prompt": "hi", "vinterp": {"capture": {"sites": ["layers.1.output"]}}}
    with TestClient(app) as client:
        answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200 and answer.content == left.body
    assert [method for method, _ in engine.calls] == ["vinterp_take_captures"]


def test_a_body_declared_over_the_limit_is_refused_on_any_route(monkeypatch) -> None:
    """The middleware refuses it from its Content-Length before the route (here vLLM's
    `/tokenize`, which reads bodies itself) is reached."""
    monkeypatch.setenv(client_limits.ENV, ServeLimits(body_bytes=1000).model_dump_json())
    reached = []

    async def tokenize(request: Any) -> Response:
        reached.append(await request.body())
        return JSONResponse({"tokens": []})

    app = Starlette(routes=[Route("/tokenize", tokenize, methods=["POST"])])
    app.add_middleware(BaseHTTPMiddleware, dispatch=vinterp_fields)
    with TestClient(app) as client:
        refused = client.post("/tokenize", content=b"x" * 1001)
        assert refused.status_code == 413 and "--max-body-mb" in refused.json()["error"]["message"]
        assert not reached
        assert client.post("/tokenize", content=b"x" * 1000).status_code == 200
    assert reached == [b"x" * 1000]
