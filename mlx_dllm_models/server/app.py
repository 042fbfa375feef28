"""The Starlette application of `mlx_dllm serve`: its routes, and the layers every request passes
before one, outermost first:

1. api.AccessLog: the access log, the metrics' counts, a 500 for a bug;
2. Guard: a 403 for a request naming a host the server does not serve (DNS rebinding) or coming
   from a web page of an origin `--cors-origin` does not name;
3. CORS (Starlette's middleware, only with `--cors-origin`): preflights answered (204), the
   allowed origin echoed with `Vary: Origin`;
4. Gate: OPTIONS outside a preflight answered 204; the API key (`--api-key`) asked of /v1;
5. the routes; an unknown path is a 404, a method a path does not take a 405, in OpenAI's error
   shape.
"""

import secrets
from typing import Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .api import AccessLog, Service, log_failure
from .fields import error_body
from .guards import origin_refusal, receive_body
from .image_api import edits, generations
from .metrics import CONTENT_TYPE
from .respond import CompletionResponse, plan, refused, submit
from .transport import Limits

# Paths that need the API key, when the server has one (/health and /metrics answer anyone who
# can reach the port, as vLLM's).
KEYED_PREFIXES = ("/v1/", "/chat/")


def error(message: str, status: int = 400, param=None, code=None, headers=None) -> Response:
    return JSONResponse(error_body(message, status, param, code), status, headers=headers)


class Guard:
    """A 403 for a request naming a host the server does not serve or from a page of an origin
    it does not allow; nothing else runs for it."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            message = self.service.hosts.refusal(headers.get("host"))
            message = message or origin_refusal(headers.get("origin"), self.service.cors_origins)
            if message is not None:
                return await error(message, 403)(scope, receive, send)
        await self.app(scope, receive, send)


class Gate:
    """OPTIONS that no CORS preflight took: 204. The API key of /v1 requests, when the server
    has keys: `Authorization: Bearer KEY`, else a 401."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "OPTIONS":
            return await Response(status_code=204)(scope, receive, send)
        keys = self.service.api_keys
        if keys and scope["path"].startswith(KEYED_PREFIXES):
            given = Headers(scope=scope).get("authorization", "")
            scheme, _, key = given.partition(" ")
            if not (scheme.lower() == "bearer" and any(_same(key.strip(), k) for k in keys)):
                answer = error(
                    "a valid API key is required: send it as 'Authorization: Bearer KEY'",
                    401,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await answer(scope, receive, send)
        await self.app(scope, receive, send)


def _same(given: str, key: str) -> bool:
    return secrets.compare_digest(given.encode(), key.encode())


class Preflight(CORSMiddleware):
    """Starlette's CORS middleware, its preflight answered as this server always did: 204, `Vary:
    Origin`, and an OpenAI error for a refused one."""

    def preflight_response(self, request_headers):
        answer = super().preflight_response(request_headers)
        headers = {
            k: v
            for k, v in answer.headers.items()
            if k.lower().startswith("access-control-") and k.lower() != "content-length"
        }
        if answer.status_code != 200:
            return error(answer.body.decode(), answer.status_code, headers=headers)
        headers["Vary"] = "Origin"
        return Response(status_code=204, headers=headers)


async def http_error(request, exc: HTTPException) -> Response:
    """Starlette's own 404 / 405 (and other HTTP errors) as OpenAI's error object."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return error(
            f"{request.method} is not allowed on {request.url.path}; it takes {allowed}",
            405,
            headers={"Allow": allowed},
        )
    if exc.status_code == 404:
        return error(f"no such endpoint: {where}", 404)
    return error(f"{exc.detail} ({where})", exc.status_code)


def build_app(service: Service, limits: Limits = Limits()) -> Callable:
    """The ASGI application serving `service`."""

    async def completion(request, chat: bool):
        try:
            body = await receive_body(request, service.max_body_bytes, limits.body_timeout)
        except ValueError as e:
            return body_refusal(e)
        try:
            planned = await run_in_threadpool(plan, service, body, chat)
        except (ValueError, TypeError) as e:  # RequestError, SettingsError, CheckpointError
            packet, status = refused(e, body)
            return JSONResponse(packet, status)
        return CompletionResponse(service, planned, submit(service, planned))

    async def chat(request):
        return await completion(request, chat=True)

    async def images(request, make):
        try:
            return JSONResponse(await make(request))
        except ValueError as e:  # RequestError: of the body, or of its fields
            return body_refusal(e)

    async def image_generations(request):
        return await images(request, lambda r: generations(r, service, receive_body, limits))

    async def image_edits(request):
        return await images(request, lambda r: edits(r, service))

    async def text(request):
        return await completion(request, chat=False)

    def model_object() -> dict:
        return {
            "id": service.model_id,
            "object": "model",
            "created": service.created,
            "owned_by": "mlx_dllm",
        }

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_object()]})

    async def model(request):
        name = request.path_params["name"].rstrip("/")
        if not name:
            return await models(request)
        try:
            service.check_model(name)
        except ValueError as e:
            return JSONResponse(*refused(e))
        return JSONResponse(model_object())

    async def health(request):
        ok = service.is_healthy
        return JSONResponse({"status": "ok" if ok else "unavailable"}, 200 if ok else 503)

    async def metrics(request):
        text = service.metrics.exposition(service.scheduler)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    async def bug(request, exc: Exception):
        log_failure(request.scope, exc)  # before the answer: a client reading it finds the line
        return bug_answer(exc)

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", text, methods=["POST"]),
        Route("/v1/images/generations", image_generations, methods=["POST"]),
        Route("/v1/images/edits", image_edits, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error, Exception: bug},
    )
    app.router.redirect_slashes = False
    inner = Gate(app, service)
    if service.cors_origins:
        inner = Preflight(
            inner,
            allow_origins=service.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Content-Type", "Authorization"],
        )
    return AccessLog(Guard(inner, service), service, bug_answer)


def body_refusal(e: Exception) -> Response:
    """A refused request's answer; one whose body was not read whole (too large, too slow, of no
    stated length) also closes the connection."""
    packet, status = refused(e)
    close = {"Connection": "close"} if status in (408, 411, 413) else None
    return JSONResponse(packet, status, headers=close)


def bug_answer(e: Exception) -> Response:
    """The answer to a bug: its kind, no details (they are in the server's log)."""
    return error(f"internal error ({type(e).__name__}); see the server log", 500)
