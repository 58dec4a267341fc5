"""The ASGI application of `sgraf serve` (FastAPI): thin routes over `SearchService` and `Worker`.

    app = create_app(SearchService.open("gallery"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: `/` (the web page, shipped in this package), `/static/*` (its script and style),
`/images/<file>` (the gallery's pictures, from its picture folder only), `/api/search`,
`/api/explain`, `/api/explain.png`, `/api/health`, `/openapi.json` and `/docs` (the API
reference, rendered here from the OpenAPI schema: it needs no script from elsewhere).

Every error is `{"error": "..."}`: 400 for bad arguments (the message names the problem), 404
for what is not there, 503 with `Retry-After` when the work queue is full or the server is
shutting down. No answer shows the server's absolute paths (`SearchService.public`).

Every answer carries `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer` and a
Content-Security-Policy that lets the page load only its own files (`SECURITY_HEADERS`); API
answers also `Cache-Control: no-store`. A request whose client disconnects while its job waits
is taken off the queue (`wait`).
"""

from __future__ import annotations

import asyncio
import html
import logging
import time
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgraf import __version__
from sgraf.errors import plain_integer
from sgraf.serve import markdown
from sgraf.serve.models import ErrorAnswer, ExplainAnswer, HealthAnswer, SearchAnswer
from sgraf.serve.service import MAX_TEXT_CHARS, MAX_TEXT_WORDS, MAX_TOP_K, NotFound, SearchService, Stale
from sgraf.serve.worker import Busy, ClientBusy, Worker

logger = logging.getLogger(__name__)

__all__ = ["create_app"]

ERRORS = {400: {"model": ErrorAnswer, "description": "bad arguments; the message names the problem"},
          404: {"model": ErrorAnswer, "description": "not there"},
          429: {"model": ErrorAnswer, "description": "this client has as many requests waiting as one client may; "
                                                     "retry after `Retry-After` seconds"},
          503: {"model": ErrorAnswer, "description": "the work queue is full; retry after `Retry-After` seconds"}}

SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    # the page's script, style and pictures come from this server only; no inline script, no frames
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
}
STOP_WAIT_S = 1.0     # at shutdown, how long the threads' jobs in hand are still waited for
API_CACHE_CONTROL = "no-store"     # answers depend on the server's state (queue, loaded index)

TEXT_LIMIT = f"1..{MAX_TEXT_CHARS} characters, at most {MAX_TEXT_WORDS} words"
TEXT = Query(None, description=f"a text query ({TEXT_LIMIT}): returns images")
ALLOW_UNKNOWN = Query(False, description="map words the vocabulary does not know to <unk> instead of refusing them")


def create_app(service: SearchService, max_queue: int = 64, max_batch: int = 16, workers: int = 1,
               max_per_client: int | None = None) -> FastAPI:
    """The application for an opened service.

    Args:
        service: the gallery and models, opened once.
        max_queue: requests waiting for the models at most; more are answered 503.
        max_batch: text searches scored together at most (1: one at a time).
        workers: compute threads (see `Worker`).
        max_per_client: requests one client address may have waiting at most; more are answered
            429 (default: `default_max_per_client(max_queue)`).
    """
    if max_per_client is None:
        max_per_client = default_max_per_client(max_queue)
    worker = Worker(service, max_queue=max_queue, max_batch=max_batch, threads=workers,
                    max_per_client=max_per_client)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:   # queued jobs are refused; a job still running after the server's grace period is
            # abandoned (the threads are daemons) rather than holding the process
            await asyncio.to_thread(worker.stop, STOP_WAIT_S)

    app = FastAPI(title="sgraf serve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False,   # its redirect was built from the Host header the client sent
                  description="Gallery search and explanations with SGRAF (AAAI 2021) over an index written by "
                              "`sgraf index`. Errors are `{\"error\": \"...\"}` with a 4xx status (429 when the "
                              "client has too many requests waiting, 503 when busy or stopping, both with "
                              "Retry-After).")
    app.state.service = service
    app.state.worker = worker
    _add_error_handlers(app, service)
    app.add_middleware(SecurityHeaders)
    app.mount("/static", StaticFiles(packages=[("sgraf.serve", "static")]), name="static")
    _drop_unsent_422(app)

    async def wait(request: Request, future: Any) -> Any:
        """The job's result; if the client disconnects first, the job is cancelled (a job not yet
        started is never run) and the route ends with `ClientGone`."""
        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result = asyncio.wrap_future(future)
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait((result, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not result.done():
            future.cancel()       # leaves the queue unless a thread is running it already
            result.cancel()
            raise ClientGone()
        return result.result()

    # the page, pictures, health and the reference answer HEAD as the static files do (a monitor's check);
    # the searches and explanations, work a HEAD would throw away, answer it 405
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(_static_text("index.html"))

    @app.api_route("/images/{relative:path}", methods=["GET", "HEAD"], include_in_schema=False)
    async def picture(relative: str) -> FileResponse:
        # off the event loop: the data check may hash a touched features file (seconds at MSCOCO size)
        return FileResponse(await asyncio.to_thread(service.picture_file, relative))

    @app.get("/api/search", response_model=SearchAnswer, responses=ERRORS, summary="search the gallery")
    async def search(request: Request, text: Optional[str] = TEXT,
                     image_id: Optional[int] = Query(None, description="an image of the gallery: returns captions"),
                     top_k: int = Query(10, description=f"results, 1..{MAX_TOP_K}"),
                     allow_unknown: bool = ALLOW_UNKNOWN) -> dict[str, Any]:
        """Text -> the best images (`results`: `id`, `score`, `image` URL), or image -> the best
        captions (`results`: `id`, `score`, `caption`), best first. Give exactly one of `text` and
        `image_id`."""
        started = time.perf_counter()
        kind = service.check_query(text, image_id)
        top_k = service.check_top_k(top_k)
        if kind == "text":
            text = service.check_text(text, allow_unknown)
            results = await wait(request, worker.search_text(text, top_k, service.shortlist_for(top_k),
                                                             client=client_of(request)))
            answer = {"query": text, "results": results}
        else:
            image_id = service.check_image_id(image_id)
            answer = await wait(request, worker.call(service.search_image, image_id, top_k,
                                                     client=client_of(request)))
        answer["ms"] = (time.perf_counter() - started) * 1000.0
        return answer

    @app.get("/api/explain", response_model=ExplainAnswer, responses=ERRORS, summary="explain a match")
    async def explain(request: Request, image_id: int = Query(description="an image of the gallery"),
                      text: str = Query(description=f"the caption ({TEXT_LIMIT})"),
                      allow_unknown: bool = ALLOW_UNKNOWN) -> dict[str, Any]:
        """What `sgraf explain` computes for an image and a caption: each token's SAF weight, SGR's
        per-alignment agreement, each token's attention over the K regions with their grid cells
        or boxes, and the scores."""
        started = time.perf_counter()
        service.check_image_id(image_id)
        service.check_text(text, allow_unknown)
        answer = await wait(request, worker.call(service.explain, image_id, text, allow_unknown, heavy=True,
                                                 client=client_of(request)))
        answer["ms"] = (time.perf_counter() - started) * 1000.0
        return answer

    @app.get("/api/explain.png", responses={**ERRORS, 200: {"content": {"image/png": {}},
                                                           "description": "the picture"}},
             response_class=Response, summary="explain a match, as a picture")
    async def explain_png(request: Request, image_id: int = Query(description="an image of the gallery"),
                          text: str = Query(description=f"the caption ({TEXT_LIMIT})"),
                          allow_unknown: bool = ALLOW_UNKNOWN) -> Response:
        """The picture `sgraf explain --out` draws for these arguments (PNG)."""
        service.check_image_id(image_id)
        service.check_text(text, allow_unknown)
        png = await wait(request, worker.call(service.explain_png, image_id, text, allow_unknown, heavy=True,
                                              client=client_of(request)))
        return Response(png, media_type="image/png")

    @app.get("/api/health", response_model=HealthAnswer, summary="the gallery, the models, the queue")
    async def health() -> dict[str, Any]:
        """Gallery size, the models (their weight hashes), device, precision, queue."""
        answer = await asyncio.to_thread(service.health)     # its data check may hash a file: off the loop
        answer["queue"] = {"waiting": worker.waiting, "max_queue": worker.max_queue, "max_heavy": worker.max_heavy,
                           "max_batch": worker.max_batch, "workers": worker.n_threads, "batches": worker.batches,
                           "batched_texts": worker.batched_texts, "dropped": worker.dropped,
                           "refused": worker.refused, "busy": worker.busy, "max_per_client": worker.max_per_client,
                           "client_busy": worker.client_busy}
        return answer

    app.add_api_route("/api/health", health, methods=["HEAD"], include_in_schema=False)   # one operation documented

    @app.api_route("/docs", methods=["GET", "HEAD"], include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(render_docs(app.openapi()))

    return app


# --------------------------------------------------------------------------------- headers
class SecurityHeaders:
    """ASGI middleware: `SECURITY_HEADERS` on every answer, `Cache-Control` on the API's."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        api = scope.get("path", "").startswith("/api/")

        started = False

        async def send_with_headers(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(name, value) for name, value in message.get("headers", [])
                           if name.decode("latin-1").lower() not in SECURITY_HEADERS]
                headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in SECURITY_HEADERS.items()]
                if api:
                    headers = [(n, v) for n, v in headers if n.lower() != b"cache-control"]
                    headers.append((b"cache-control", API_CACHE_CONTROL.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        if sum(len(name) + len(value) for name, value in scope.get("headers", ())) > MAX_HEADER_BYTES:
            # uvicorn's own limit holds for headers arriving in pieces; this one for any
            await _error(400, f"request headers of more than {MAX_HEADER_BYTES} bytes: not an HTTP/1.1 request "
                              "this server can read", {"Connection": "close"})(scope, receive, send_with_headers)
            return
        if api:
            problem = query_problem(scope.get("query_string", b""), ROUTE_PARAMETERS.get(scope.get("path", "")))
            if problem is not None:
                await _error(400, problem)(scope, receive, send_with_headers)
                return
        try:
            await self.app(scope, receive, send_with_headers)
        except Exception as exc:     # answered here, logged once (Starlette's outermost handler re-raised
            # it after answering, and uvicorn logged the traceback a second time)
            logger.error("request failed: %s %s", scope.get("method"), scope.get("path"), exc_info=True)
            if not started:
                await _error(500, f"internal error ({type(exc).__name__}); the server's log has the "
                                  "details")(scope, receive, send_with_headers)


INTEGER_PARAMETERS = ("image_id", "top_k")
MAX_INTEGER_DIGITS = 12
MAX_HEADER_BYTES = 16 * 1024
# each API route's query parameters: the ones checked (another route's, or one a route does not take,
# is left to the route: a 404 for an unknown path, ignored by a route that takes none)
ROUTE_PARAMETERS = {"/api/search": ("text", "image_id", "top_k", "allow_unknown"),
                    "/api/explain": ("image_id", "text", "allow_unknown"),
                    "/api/explain.png": ("image_id", "text", "allow_unknown")}


def query_problem(query: bytes, parameters: Sequence[str] | None = None) -> str | None:
    """What is wrong with an API request's query string, or None: one of `parameters` (None: no
    check) given twice (only one value would count), or an integer parameter in another spelling
    than ASCII digits with at most a minus sign (the parameters' parser had read `1_0` as 10, `1.0`
    as 1 and `+5` as 5)."""
    from urllib.parse import parse_qsl

    if parameters is None:
        return None
    seen: set[str] = set()
    for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if name not in parameters:
            continue
        if name in seen:
            return f"query parameter {name!r} is given twice; give it once"
        seen.add(name)
        if name in INTEGER_PARAMETERS:
            if not (plain_integer(value) and not value.startswith("+")):
                return f"{name} must be an integer, got {value[:40]!r}"
            if len(value.lstrip("-")) > MAX_INTEGER_DIGITS:
                return f"{name} must be an integer of at most {MAX_INTEGER_DIGITS} digits, got {value[:40]!r}"
    return None


def _drop_unsent_422(app: FastAPI) -> None:
    """FastAPI documents a 422 "Validation Error" for every route with parameters; this server
    answers invalid parameters 400 (`_add_error_handlers`), so the schema (and `/docs`) leave it out."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def default_max_per_client(max_queue: int) -> int:
    """Requests one client may have waiting by default: a quarter of the queue's places (at least
    one), so that three clients at their limit still leave places to others."""
    return max(1, max_queue // 4)


def client_of(request: Request) -> str | None:
    """The address a request came from, the key of its client's line and limit in the queue
    (`Worker`): uvicorn's, which behind a reverse proxy it trusts (the machine itself, or the
    addresses in the environment's `FORWARDED_ALLOW_IPS`) is the one the proxy's `X-Forwarded-For`
    names. None where there is none (a Unix socket): not limited per client."""
    return request.client.host if request.client is not None else None


# --------------------------------------------------------------------------------- errors
class ClientGone(Exception):
    """The client disconnected before its answer was ready (nobody reads the answer)."""


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI, service: SearchService) -> None:
    public = service.public

    def sent(request: Request) -> list[str]:     # the client's own text, which answers echo as sent
        return [value for _, value in request.query_params.multi_items()]

    @app.exception_handler(ValueError)          # InputError and the library's other argument errors
    async def bad_input(request: Request, exc: ValueError) -> JSONResponse:
        return _error(400, public(str(exc), sent(request)))

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> JSONResponse:
        return _error(404, public(str(exc), sent(request)))

    @app.exception_handler(Busy)
    async def busy(_: Request, exc: Busy) -> JSONResponse:
        return _error(429 if isinstance(exc, ClientBusy) else 503, str(exc),
                      headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(Stale)
    async def stale(request: Request, exc: Stale) -> JSONResponse:
        return _error(503, public(str(exc), sent(request)))

    @app.exception_handler(ClientGone)
    async def gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)          # nginx's "client closed request"; nobody reads it

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, "; ".join(_describe_validation(e) for e in exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


def _describe_validation(error: dict[str, Any]) -> str:
    name = str(error.get("loc", ("?",))[-1])
    kind = error.get("type", "")
    given = error.get("input")
    if kind == "missing":
        return f"{name} is missing"
    if kind.startswith("int"):
        return f"{name} must be an integer, got {given!r}"
    if kind.startswith("bool"):
        return f"{name} must be true or false, got {given!r}"
    return f"{name}: {error.get('msg', 'invalid')} (got {given!r})"


# --------------------------------------------------------------------------------- pages
def _static_text(name: str) -> str:
    return resources.files("sgraf.serve").joinpath("static", name).read_text(encoding="utf-8")


def render_docs(schema: dict[str, Any]) -> str:
    """The API reference as one HTML page, from the OpenAPI schema (no script, nothing fetched)."""
    esc = html.escape
    info = schema.get("info", {})
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{esc(info.get('title', 'API'))}"
             " - API</title><link rel='icon' href='data:,'><link rel='stylesheet' href='/static/style.css'></head>"
             "<body class='docs'>",
             f"<h1>{esc(info.get('title', 'API'))} {esc(info.get('version', ''))}</h1>",
             markdown.block(info.get("description", "")),
             "<p>The machine-readable schema: <a href='/openapi.json'>/openapi.json</a>. The web page: "
             "<a href='/'>/</a>.</p>"]
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            parts.append(f"<section><h2><code>{esc(method.upper())} {esc(path)}</code></h2>")
            parts.append(f"<p><b>{esc(operation.get('summary', ''))}</b></p>")
            if operation.get("description"):
                parts.append(markdown.block(operation["description"]))
            parameters = operation.get("parameters", [])
            if parameters:
                parts.append("<table><tr><th>parameter</th><th>type</th><th>required</th><th>default</th>"
                             "<th>description</th></tr>")
                for parameter in parameters:
                    schema_ = parameter.get("schema", {})
                    kinds = [s.get("type") for s in schema_.get("anyOf", [])] or [schema_.get("type")]
                    kind = " or ".join(str(k) for k in kinds if k and k != "null")
                    parts.append(f"<tr><td><code>{esc(parameter['name'])}</code></td><td>{esc(kind)}</td>"
                                 f"<td>{'yes' if parameter.get('required') else 'no'}</td>"
                                 f"<td>{esc(str(schema_.get('default', '')))}</td>"
                                 f"<td>{markdown.inline(parameter.get('description', ''))}</td></tr>")
                parts.append("</table>")
            parts.append("<ul>")
            for status, response in operation.get("responses", {}).items():
                parts.append(f"<li><code>{esc(status)}</code>: {markdown.inline(response.get('description', ''))}</li>")
            parts.append("</ul></section>")
    parts.append("</body></html>")
    return "\n".join(parts)
