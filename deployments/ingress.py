"""The HTTP ingress: the OpenAI API, grammar registration, health and metrics.

Each request: authenticate (API key → tenant), admit (the tenant's limits, for the whole service,
before the body is read: a slow sender holds its own tenant's slot, no one else's), read and
validate the body, then stream from an `LLMReplica` through its handle. Errors use the OpenAI
error shape; no input a client can send produces a 500 or a hang. Each completion is one server
span, one count and one JSON log line (deployments/observe.py); `/metrics` sums every replica's
metrics.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time
# (after Ray Serve rewrites them), and `request: Request` must be a class, not a string.

import asyncio
import functools
import logging
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from ray import serve

from deployments import (
    adapter_api,
    batch_api,
    files_api,
    grammar_api,
    model_api,
    openapi,
    responses,
    tools,
)
from deployments.adapter_api import AdapterRef, AdapterRegistration, Adapters
from deployments.answers import ApiError, cancel, collect, engine_refusal, sse
from deployments.edge import ReleasingStream, check_metrics_token, openai_errors
from deployments.gate import Gate
from deployments.grammar_api import GrammarRegistration
from deployments.listener import start as listen
from deployments.observe import RequestObs, observe
from deployments.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    client_request_id,
    engine_id,
    new_id,
    template_options,
)
from deployments.responses_protocol import ResponsesRequest, to_chat
from deployments.service_config import ServiceConfig
from deployments.telemetry_hub import scraped, setup
from deployments.tenants import Tenants
from deployments.translate import sampling_from, screen
from deployments.wire import Delta
from services import settings
from services.batches.jobs import CreateBatch
from services.engine.gc_freeze import freeze_startup_objects

log = logging.getLogger(__name__)

PREFIXES = {"chat": "chatcmpl", "completions": "cmpl", "responses": "resp"}  # response ids

app = FastAPI(title="structserve", docs_url=None, redoc_url=None)
openai_errors(app)


openapi.install(
    app,
    {
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/completions": CompletionRequest,
        "/v1/responses": ResponsesRequest,
        "/v1/grammars": GrammarRegistration,
        "/v1/adapters": AdapterRegistration,
        "/v1/batches": CreateBatch,
        "/tokenize": TokenizeRequest,
        "/detokenize": DetokenizeRequest,
    },
)


@serve.ingress(app)  # here, not in the builder: the routes must pickle with the class
class Ingress:
    """Route handlers; Ray Serve binds it with the replica and grammar-service handles."""

    def __init__(
        self,
        config: dict[str, Any],
        llm: Any,
        grammar: Any,
        default_key: str | None = None,
        hub: Any | None = None,
        runner: Any | None = None,
    ) -> None:
        from deployments.grammar_service import redis_client

        self.config = ServiceConfig.model_validate(config)
        setup(self.config, "Ingress", hub)
        self.llm = llm
        self.grammar = grammar
        self.hub = hub
        redis = redis_client(self.config.redis_url)
        self.tenants = Tenants(self.config, default_key, redis)
        self.gate = Gate(self.config, self.tenants, llm)
        self.adapters = Adapters(self.config, redis, llm)
        self.files = files_api.file_store(self.config, redis)
        self.batches = batch_api.batch_store(self.config, redis)
        self.runner = runner  # deployed with the app; it takes batches from Redis
        self.metrics_token = settings.metrics_token()
        freeze_startup_objects(self.config.llm.engine.freeze_gc)  # as the replicas do
        ing = self.config.ingress
        self.listener = listen(app, ing.host, ing.port, ing.listener)  # None: Ray's proxy

    async def __del__(self) -> None:
        """Ray awaits it when it stops the replica (Ray's proxy would drain the answers it
        tracks): the own listener stops taking connections, the answers in flight finish."""
        if (own := getattr(self, "listener", None)) is not None:
            await own.close()

    # -- plumbing ------------------------------------------------------------------------

    def _params(self, tenant: str, body: Any) -> Any:
        lim = self.tenants.limits_of(tenant)
        try:
            params = sampling_from(body, lim.max_tokens)
            screen(params, self.config.grammar.limits)
        except BadRequest as exc:
            raise ApiError(400, str(exc), exc.param) from exc
        if isinstance(body, ChatCompletionRequest) and tools.calls_expected(body):
            # screened here; the replica holds the calls to the model's dialect (replica.py)
            return replace(params, structured=None)
        return params

    async def _inputs(self, body: Any) -> tuple[Any, Any, Any, Any]:
        """(prompt, messages, template options, the answer's tool choice) for the replica,
        within its size cap; 400 on earlier calls' arguments that are not JSON and on template
        variables refused."""
        if not isinstance(body, ChatCompletionRequest):
            p = body.prompt
            prompt = p[0] if isinstance(p, list) and isinstance(p[0], str) else p
            await self.gate.check_prompt(prompt)
            return prompt, None, None, None
        try:
            messages = tools.messages_of(body)
            template = template_options(body)
        except ValueError as exc:
            raise ApiError(400, str(exc), str(exc).split(":")[0]) from exc
        if (listed := tools.prompt_tools(body)) is not None:
            template["tools"] = listed
        await self.gate.check_prompt(messages=messages)
        return None, messages, template, tools.answer_of(body)

    def _stream(
        self, obs: RequestObs, inputs: Any, params: Any, i: int, rid: str, lora: AdapterRef | None
    ) -> Any:
        if params.seed is not None and i:
            params = replace(params, seed=params.seed + i)
        prompt, messages, template, answer = inputs
        return self.llm.options(stream=True).generate.remote(
            prompt,
            messages,
            params,
            obs.engine_tenant or obs.tenant,
            engine_id(rid, i),
            obs.carrier,
            template,
            answer,
            lora,
        )

    async def _first(self, stream: Any) -> Delta:
        """The first delta; a request refused by the engine becomes an HTTP error here."""
        from ray.serve.exceptions import BackPressureError

        try:
            first: Delta = await stream.__anext__()
        except BackPressureError as exc:
            message = "the model replicas are busy; try again"
            raise ApiError(429, message, retry_after=1, reason="replica_busy") from exc
        except StopAsyncIteration as exc:
            raise ApiError(503, "the replica ended the stream early") from exc
        except Exception as exc:  # the replica died before answering
            log.warning("replica failed: %s", exc)
            raise ApiError(503, "the model replica is unavailable; try again") from exc
        if first.finish_reason == "error" and not first.completion_tokens:
            raise engine_refusal(first)
        return first

    # -- completions ---------------------------------------------------------------------

    async def complete(self, request: Request, kind: str) -> Response:
        """`kind`: chat, completions or responses (a chat answer, read into a response)."""
        obs = observe(kind, request.headers)
        try:
            response = await self._complete(request, kind, obs)
        except BaseException as err:  # incl. a client gone before the answer
            obs.finish(err.status if isinstance(err, ApiError) else 499, err)
            raise
        if not isinstance(response, ReleasingStream):  # a stream finishes with its last event
            obs.finish(200)
        return response

    async def _body(self, request: Request, kind: str) -> tuple[Any, Any]:
        """The request's body, and for a response its own (the body is the chat it means)."""
        if kind != "responses":
            bodies: dict[str, type[BaseModel]] = {
                "chat": ChatCompletionRequest,
                "completions": CompletionRequest,
            }
            return await self.gate.body(request, bodies[kind]), None
        asked = await self.gate.body(request, ResponsesRequest)
        try:
            return to_chat(asked), asked
        except BadRequest as exc:
            raise ApiError(400, str(exc), exc.param) from exc

    async def _complete(self, request: Request, kind: str, obs: RequestObs) -> Response:
        tenant = obs.tenant = await self.gate.tenant(request)
        lease = await self.gate.admit(tenant)
        try:
            body, asked = await self._body(request, kind)
        except BaseException:
            self.tenants.release(lease)
            raise
        rid = new_id(PREFIXES[kind], client_request_id(request.headers))
        return await self._answer(obs, kind, lease, body, asked, rid)

    async def _answer(
        self, obs: RequestObs, kind: str, lease: Any, body: Any, asked: Any, rid: str
    ) -> Response:
        """The answer to a read body, holding `lease` (released here, or by the stream)."""
        tenant = obs.tenant
        streams: list[Any] = []
        streaming = False  # the stream releases the lease from then on
        chat = kind != "completions"
        try:
            lora = await self.adapters.resolve(tenant, body.model)  # None: the base model
            params = self._params(tenant, body)
            obs.describe(body, params, rid, self.config.served_model_name)
            inputs = await self._inputs(body)
            await self.gate.admit(tenant, lease, body.n - 1)
            streams = [self._stream(obs, inputs, params, i, rid, lora) for i in range(body.n)]
            firsts = await asyncio.gather(*(self._first(s) for s in streams))
            if body.stream:
                release = functools.partial(self.tenants.release, lease)
                events = sse(obs, body, rid, chat, streams, firsts, release)
                if asked is not None:
                    events = responses.events(asked, rid, events)
                streaming = True
                return ReleasingStream(events, release)
            answer = await collect(obs, body, rid, chat, streams, firsts)
            await self.tenants.release(lease, sum(obs.usage.values()))  # see Tenants.release
            if asked is not None:
                answer = responses.response_of(asked, rid, answer)
            return JSONResponse(answer)
        except BaseException:  # incl. a client gone before the answer
            cancel(streams)
            raise
        finally:
            if not streaming:  # any other end (idempotent)
                self.tenants.release(lease, sum(obs.usage.values()))

    async def batch_line(self, tenant: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """One line of a tenant's batch, for the runner (batch_api.line)."""
        return await batch_api.line(self, tenant, kind, body)

    # -- the rest ------------------------------------------------------------------------

    async def metrics(self, request: Request) -> PlainTextResponse:
        """Every replica's metrics (telemetry_hub.scraped); only for the metrics token's holder
        when one is set (they name tenants and their traffic)."""
        check_metrics_token(self.metrics_token, request.headers.get("authorization"))
        text = await scraped(self.hub)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- routes (Ray Serve's `serve.ingress(app)` binds them to this class) ----------------

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.complete(request, "completions")

    @app.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        return await self.complete(request, "responses")

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> JSONResponse:
        return await model_api.models(self, request)

    @app.post("/v1/grammars")
    async def post_grammar(self, request: Request) -> JSONResponse:
        return await grammar_api.register(self.gate, self.grammar, request)

    @app.get("/v1/grammars")
    async def get_grammars(self, request: Request) -> JSONResponse:
        return await grammar_api.listed(self.gate, self.grammar, request)

    @app.get("/v1/grammars/{grammar_id}")
    async def get_one_grammar(self, request: Request, grammar_id: str) -> JSONResponse:
        return await grammar_api.listed(self.gate, self.grammar, request, grammar_id)

    @app.delete("/v1/grammars/{grammar_id}")
    async def delete_one_grammar(self, request: Request, grammar_id: str) -> JSONResponse:
        return await grammar_api.delete(self.gate, self.grammar, request, grammar_id)

    @app.post("/v1/adapters")
    async def post_adapter(self, request: Request) -> JSONResponse:
        return await adapter_api.register(self.gate, self.adapters, request)

    @app.get("/v1/adapters")
    async def get_adapters(self, request: Request) -> JSONResponse:
        return await adapter_api.listed(self.gate, self.adapters, request, None)

    @app.get("/v1/adapters/{name}")
    async def get_one_adapter(self, request: Request, name: str) -> JSONResponse:
        return await adapter_api.listed(self.gate, self.adapters, request, name)

    @app.delete("/v1/adapters/{name}")
    async def delete_one_adapter(self, request: Request, name: str) -> JSONResponse:
        return await adapter_api.delete(self.gate, self.adapters, request, name)

    @app.post("/v1/load_lora_adapter")  # vLLM's names for the same
    async def load_lora_adapter(self, request: Request) -> Response:
        return await adapter_api.load_lora(self.gate, self.adapters, request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        return await adapter_api.unload_lora(self.gate, self.adapters, request)

    @app.post("/v1/files")
    async def post_file(self, request: Request) -> Response:
        return await files_api.upload(self.gate, self.files, self.config, request)

    @app.get("/v1/files")
    async def get_files(self, request: Request) -> Response:
        return await files_api.listed(self.gate, self.files, request)

    @app.get("/v1/files/{file_id}")
    async def get_one_file(self, request: Request, file_id: str) -> Response:
        return await files_api.one(self.gate, self.files, request, file_id)

    @app.get("/v1/files/{file_id}/content")
    async def get_file_content(self, request: Request, file_id: str) -> Response:
        return await files_api.content(self.gate, self.files, request, file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_one_file(self, request: Request, file_id: str) -> Response:
        return await files_api.delete(self.gate, self.files, request, file_id)

    @app.post("/v1/batches")
    async def post_batch(self, request: Request) -> Response:
        return await batch_api.create(self.gate, self.batches, self.files, request)

    @app.get("/v1/batches")
    async def get_batches(self, request: Request) -> Response:
        return await batch_api.listed(self.gate, self.batches, request)

    @app.get("/v1/batches/{batch_id}")
    async def get_one_batch(self, request: Request, batch_id: str) -> Response:
        return await batch_api.retrieve(self.gate, self.batches, request, batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(self, request: Request, batch_id: str) -> Response:
        return await batch_api.cancel(self.gate, self.batches, request, batch_id)

    @app.get("/healthz")
    async def health(self) -> JSONResponse:
        return await model_api.health(self)

    @app.get("/health")  # vLLM's name for it
    async def health_alias(self) -> JSONResponse:
        return await model_api.health(self)

    @app.post("/tokenize")
    async def post_tokenize(self, request: Request) -> JSONResponse:
        return await model_api.tokenize(self, request)

    @app.post("/detokenize")
    async def post_detokenize(self, request: Request) -> JSONResponse:
        return await model_api.detokenize(self, request)

    @app.get("/metrics")
    async def prometheus(self, request: Request) -> PlainTextResponse:
        return await self.metrics(request)
