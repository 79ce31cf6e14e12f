"""The OpenAI-compatible HTTP server: `python -m tinyvllm.serve` (or `tinyvllm serve`).

FastAPI routes on one AsyncLLM; the engine runs on its own thread, the event loop only parses, renders and
streams. Endpoints: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models (and /v1/models/{id}),
/tokenize, /detokenize (behind --api-key when set), /health, /metrics, /version. Every error is OpenAI's body {"error": {message, type, param, code}}.
"""
from __future__ import annotations
import argparse, hmac, logging, os, socket, sys, time
from contextlib import asynccontextmanager
from pathlib import Path
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from tinyvllm.entrypoints.engine_args import add_engine_args
from tinyvllm.entrypoints.openai.protocol import APIError, DetokenizeRequest, TokenizeRequest, parse_body
from tinyvllm.entrypoints.openai.serving import OpenAIServing, ServerSettings
from tinyvllm.tools import FORMATS

log = logging.getLogger("tinyvllm.server")


def build_app(engine, settings: ServerSettings, metrics=None) -> FastAPI:
  """The FastAPI app serving `engine` (an AsyncLLM). `metrics` (a PrometheusStatLogger fed by the engine) backs
  /metrics. The app shuts the engine down when the server stops."""
  from tinyvllm import __version__
  from tinyvllm.entrypoints.openai.serving_chat import OpenAIServingChat
  from tinyvllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
  from tinyvllm.entrypoints.openai.serving_responses import OpenAIServingResponses

  @asynccontextmanager
  async def lifespan(app: FastAPI):
    yield
    engine.shutdown()

  app = FastAPI(title="tinyvllm", version=__version__, lifespan=lifespan)
  app.state.engine, app.state.settings = engine, settings
  chat, completion, serving = OpenAIServingChat(engine, settings), OpenAIServingCompletion(engine, settings), OpenAIServing(engine, settings)
  responses = OpenAIServingResponses(chat)
  created = int(time.time())

  @app.exception_handler(APIError)
  async def api_error(request: Request, e: APIError):
    # one line per refused request (a client debugging its 400s reads the cause in the server's log too)
    log.log(logging.WARNING if e.status >= 500 else logging.INFO, "%s %s refused %d%s: %s", request.method, request.url.path,
            e.status, f" (param {e.param})" if e.param else "", e.message)
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request: Request, e: StarletteHTTPException):
    error = APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=str(e.status_code))
    return JSONResponse(error.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

  @app.exception_handler(RequestValidationError)
  async def validation_error(request: Request, e: RequestValidationError):
    return JSONResponse(APIError(400, str(e)).body(), status_code=400)

  @app.exception_handler(Exception)
  async def internal_error(request: Request, e: Exception):   # a bug of ours: the client gets a 500, never a hang
    log.exception("internal error on %s %s", request.method, request.url.path)
    return JSONResponse(APIError(500, f"internal server error: {type(e).__name__}: {e}").body(), status_code=500)

  async def check_api_key(request: Request) -> None:
    if settings.api_key is None: return
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
      raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

  api = APIRouter(dependencies=[Depends(check_api_key)])

  @api.post("/v1/chat/completions")
  async def chat_completions(request: Request): return await chat.create(request)

  @api.post("/v1/completions")
  async def completions(request: Request): return await completion.create(request)

  @api.post("/v1/responses")
  async def responses_create(request: Request): return await responses.create(request)

  def model_card() -> dict:
    return {"id": settings.served_model_name, "object": "model", "created": created, "owned_by": "tinyvllm",
            "root": settings.model_path, "parent": None, "max_model_len": engine.max_model_len}

  @api.get("/v1/models")
  async def models(): return {"object": "list", "data": [model_card()]}

  @api.get("/v1/models/{model_id:path}")
  async def model(model_id: str):
    """OpenAI's retrieve (`client.models.retrieve(id)`): the one model this server runs, or a 404 naming the id."""
    if model_id != settings.served_model_name:
      raise APIError(404, f"the model '{model_id}' does not exist; this server runs '{settings.served_model_name}'",
                     param="model", code="model_not_found")
    return model_card()

  @api.post("/tokenize")
  async def tokenize(request: Request):
    body: TokenizeRequest = parse_body(await request.body(), TokenizeRequest)
    serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None): raise APIError(400, "give exactly one of 'prompt' and 'messages'")
    if body.messages is not None:
      rendered = serving.render_chat(body)
      tokens = rendered["prompt_token_ids"] if not body.add_special_tokens else serving.tokenizer.encode(rendered["prompt"])
    else: tokens = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

  @api.post("/detokenize")
  async def detokenize(request: Request):
    body: DetokenizeRequest = parse_body(await request.body(), DetokenizeRequest)
    serving.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < serving.tokenizer.vocab_size]
    if bad: raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{serving.tokenizer.vocab_size - 1})", param="tokens")
    return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}

  app.include_router(api)

  @app.get("/health")
  async def health():
    if not engine.is_healthy(): raise APIError(503, "the engine is not running", type="server_error")
    return Response(status_code=200)

  @app.get("/version")
  async def version(): return {"version": __version__}

  @app.get("/metrics")
  async def prometheus():
    if metrics is None: raise APIError(404, "metrics are off")
    from prometheus_client import CONTENT_TYPE_LATEST
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

  return app


def create_app(config, *, served_model_name: str | None = None, api_key: str | None = None,
               max_waiting_requests: int | None = None, chat_template: str | None = None,
               tool_call_parser: str | None = None) -> FastAPI:
  """Load the model of `config` (an EngineConfig with a local model path) into an AsyncLLM with Prometheus metrics,
  and build the app on it. `app.state.engine` is the engine, `app.state.settings` the settings."""
  from tinyvllm.engine.async_llm import AsyncLLM
  from tinyvllm.entrypoints.openai.metrics import PrometheusStatLogger
  path = Path(config.model)
  name = served_model_name or (path.stem if path.is_file() else path.name)
  metrics = PrometheusStatLogger(name, speculative=config.draft_model is not None)
  engine = AsyncLLM.from_config(config, stat_loggers=[metrics])
  metrics.bind(lambda: engine.engine.scheduler_stats)
  settings = ServerSettings(served_model_name=name, model_path=str(path), api_key=api_key,
                            max_waiting_requests=max_waiting_requests, chat_template=chat_template, tool_call_parser=tool_call_parser)
  return build_app(engine, settings, metrics)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m tinyvllm.serve", description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
  p.add_argument("--model", default=None, help="HF directory, GGUF file or hub id (default: SmolLM2-135M-Instruct Q4_1)")
  s = p.add_argument_group("server")
  s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface; opens the server to the network)")
  s.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
  s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /tokenize "
                                                 "(default: the TINYVLLM_API_KEY environment variable, else none)")
  s.add_argument("--served-model-name", default=None, help="the model name clients send and /v1/models lists "
                                                           "(default: the model's file or directory name)")
  s.add_argument("--max-waiting-requests", type=int, default=None, help="answer 503 while this many requests wait (default: no limit)")
  s.add_argument("--chat-template", default=None, help="a Jinja chat template file to use instead of the model's")
  s.add_argument("--tool-call-parser", default=None, choices=sorted(FORMATS),
                 help="the format tool calls are read in (default: the one the chat template writes; json: a generic JSON "
                      "format, described to the model in a system message when its template has no tool support)")
  s.add_argument("--enable-auto-tool-choice", action="store_true",
                 help="accepted for vLLM's command lines: tool_choice 'auto' is always available here")
  s.add_argument("--warmup", default="auto", choices=["auto", "on", "off"],
                 help="capture every decode batch size and prefill token count before serving, so that no request waits "
                      "while a new pass shape is captured (seconds on a GPU); auto: on a GPU, off on the CPU device")
  s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
  add_engine_args(p.add_argument_group("engine"))
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  model = args.model or args.model_tag
  if args.model and args.model_tag and args.model != args.model_tag:
    print(f"error: two models given: {args.model_tag} and --model {args.model}", file=sys.stderr)
    return 2
  if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
    print("error: --max-waiting-requests must be at least 1", file=sys.stderr)
    return 2
  chat_template = None
  if args.chat_template:
    try: chat_template = Path(args.chat_template).read_text(encoding="utf-8")
    except OSError as e:
      print(f"error: --chat-template: cannot read {args.chat_template}: {e.strerror}", file=sys.stderr)
      return 2
  logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  try:
    sock = bind(args.host, args.port)   # before loading: a port in use fails in a second, not after the model loads
  except OSError as e:
    print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
    return 2
  from tinyvllm.config import EngineConfig
  from tinyvllm.entrypoints.engine_args import engine_kwargs
  from tinyvllm.model.fetch import FetchError
  from tinyvllm.model.weights import resolve_model
  try:
    path = resolve_model(model)
    config = EngineConfig.from_kwargs(model=str(path), **engine_kwargs(args))
    app = create_app(config, served_model_name=args.served_model_name, chat_template=chat_template, tool_call_parser=args.tool_call_parser,
                     api_key=args.api_key or os.environ.get("TINYVLLM_API_KEY") or None,
                     max_waiting_requests=args.max_waiting_requests)
  except (ValueError, TypeError, FetchError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  def warm_up(engine) -> int:
    if args.warmup == "off" or (args.warmup == "auto" and engine.core.device.startswith("CPU")): return 0
    try: return engine.warm_up()
    except Exception as e:   # requests still capture their shapes as they come: serve, and say why not before
      log.warning("capturing the pass shapes before serving failed (they will be captured as requests need them): %s: %s",
                  type(e).__name__, e)
      return 0
  if captured := app.state.engine.engine.call(warm_up): log.info("captured %d pass shapes before serving", captured)
  import uvicorn
  host, port = sock.getsockname()[:2]
  log.info("serving %s (max_model_len %d) on http://%s:%d", app.state.settings.served_model_name,
           app.state.engine.max_model_len, host, port)
  server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=5))
  try: server.run(sockets=[sock])
  except KeyboardInterrupt: pass   # uvicorn re-raises the Ctrl-C it handled, after shutting down gracefully
  return 0


def bind(host: str, port: int) -> socket.socket:
  """A listening socket (IPv6 when the host is an IPv6 address)."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  sock.listen(2048)
  sock.set_inheritable(True)
  return sock
