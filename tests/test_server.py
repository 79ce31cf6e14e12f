"""The OpenAI-compatible server, driven by the official `openai` client (and raw HTTP where the client hides the
wire) against a server on 127.0.0.1 on a free port: responses equal offline `LLM.generate`, logprobs equal HF's,
streams equal plain responses, concurrent streams all finish, a client that hangs up frees its blocks, every error
has its status and OpenAI's body, metrics move. Each load is bounded in requests and time."""
from __future__ import annotations
import concurrent.futures, json, os, re, signal, subprocess, sys, threading, time
import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import LlamaForCausalLM
from conftest import serve_in_thread
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import EngineConfig
from tinyvllm.entrypoints.openai.api_server import create_app

ENGINE = dict(block_size=8, num_kv_blocks=512, max_num_seqs=32, max_num_batched_tokens=128, max_model_len=256)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def server(tiny_model):
  app = create_app(EngineConfig(model=str(tiny_model), **ENGINE))
  with serve_in_thread(app) as url:
    yield url, app.state.engine


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model):
  llm = LLM(str(tiny_model), **ENGINE)
  yield llm
  llm.shutdown()


def metric(url: str, name: str, **labels) -> float:
  """A sample of the server's /metrics (0 when absent)."""
  text = httpx.get(url + "/metrics", timeout=10).text
  want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
  for line in text.splitlines():
    m = re.match(r"([^{ ]+)(?:\{(.*)\})? (\S+)$", line)
    if m and m.group(1) == name and ",".join(sorted(x for x in (m.group(2) or "").split(",") if not x.startswith("model_name"))) == want:
      return float(m.group(3))
  return 0.0


def wait_until(predicate, seconds: float = 15.0) -> bool:
  deadline = time.time() + seconds
  while time.time() < deadline:
    if predicate(): return True
    time.sleep(0.05)
  return False


# **** answers ****

def test_models_health_version(server, client, tiny_model):
  url, engine = server
  models = client.models.list().data
  assert [m.id for m in models] == [tiny_model.name] and models[0].max_model_len == 256 and models[0].object == "model"
  assert client.models.retrieve(tiny_model.name).id == tiny_model.name   # GET /v1/models/{id}
  missing = httpx.get(url + "/v1/models/no-such-model")
  assert missing.status_code == 404 and "no-such-model" in missing.json()["error"]["message"]
  assert httpx.get(url + "/health").status_code == 200
  assert httpx.get(url + "/version").json() == {"version": __import__("tinyvllm").__version__}


def test_chat_plain_and_streamed_equal_offline(server, client, offline):
  want = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
  plain = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, temperature=0,
                                         max_tokens=12, extra_body={"ignore_eos": True})
  assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-")
  choice = plain.choices[0]
  assert choice.message.role == "assistant" and choice.message.content == want.outputs[0].text
  assert choice.finish_reason == "length" and choice.index == 0
  assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (len(want.prompt_token_ids), 12)
  assert plain.usage.total_tokens == plain.usage.prompt_tokens + 12
  chunks = list(client.chat.completions.create(messages=MESSAGES, model=plain.model, temperature=0, max_tokens=12, stream=True,
                                               stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert all(c.usage is None for c in chunks[:-1]) and not chunks[-1].choices
  assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_stream_frames_on_the_wire(server):
  """SSE as OpenAI writes it: `data: {json}` frames separated by blank lines, ending with `data: [DONE]`."""
  body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True}
  with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body, timeout=60) as r:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    raw = "".join(r.iter_text())
  frames = raw.split("\n\n")
  assert frames[-1] == "" and frames[-2] == "data: [DONE]"
  for f in frames[:-2]: assert f.startswith("data: {") and json.loads(f[6:])["object"] == "chat.completion.chunk"


def hf_greedy(path, ids: list[int], k: int) -> tuple[list[int], np.ndarray]:
  """HF's greedy continuation of `ids` (k tokens) and log_softmax of its logits at every position (float64)."""
  hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    gen = hf.generate(torch.tensor([ids]), max_new_tokens=k, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    logprobs = torch.log_softmax(hf(torch.tensor([ids + gen])).logits[0].double(), -1).numpy()
  return gen, logprobs


LOGPROB_TOL = 1e-4   # float32 logits from two implementations (ours and HF's) agree to ~1e-5 here


def test_chat_logprobs_are_the_models(server, client, tiny_model):
  out = client.chat.completions.create(model=tiny_model.name, messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
  prompt = httpx.post(server[0] + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
  gen, ref = hf_greedy(tiny_model, prompt, 6)
  content = out.choices[0].logprobs.content
  assert len(content) == 6
  for step, entry in enumerate(content):
    row = ref[len(prompt) - 1 + step]
    assert abs(entry.logprob - row[gen[step]]) < LOGPROB_TOL
    assert [t.logprob for t in entry.top_logprobs] == pytest.approx(np.sort(row)[::-1][:3], abs=LOGPROB_TOL)
    assert bytes(entry.bytes) == httpx.post(server[0] + "/detokenize", json={"tokens": [gen[step]]}).json()["prompt"].encode() \
      or "\ufffd" in entry.token                                        # a lone byte of a multi-byte character


def test_completion_echo_logprobs_cover_prompt_and_output(server, client, tiny_model):
  prompt = [9, 40, 77, 120, 3, 250]
  out = client.completions.create(model=tiny_model.name, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
  gen, ref = hf_greedy(tiny_model, prompt, 5)
  choice, ids = out.choices[0], prompt + gen
  lp = choice.logprobs
  assert out.object == "text_completion" and len(lp.tokens) == len(ids)
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # nothing predicts the first token
  assert choice.text.startswith(httpx.post(server[0] + "/detokenize", json={"tokens": prompt}).json()["prompt"])
  for i in range(1, len(ids)):
    row = ref[i - 1]
    assert abs(lp.token_logprobs[i] - row[ids[i]]) < LOGPROB_TOL
    top2 = np.sort(row)[::-1][:2]   # keyed by text, two tokens that read the same share one entry: the likelier
    assert max(lp.top_logprobs[i].values()) == pytest.approx(top2[0], abs=LOGPROB_TOL)
    # the two likeliest and, as OpenAI does, the token itself (up to 3 entries)
    assert len(lp.top_logprobs[i]) <= 3 and lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(row[ids[i]], abs=LOGPROB_TOL)
    assert all(np.isclose(v, [*top2, row[ids[i]]], atol=LOGPROB_TOL).any() for v in lp.top_logprobs[i].values())
  assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
  assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 5


def test_several_prompts_n_and_seed(server, client):
  name = client.models.list().data[0].id
  out = client.completions.create(model=name, prompt=["Hello", "The quick"], n=3, max_tokens=6, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True})
  assert sorted(c.index for c in out.choices) == list(range(6))       # prompt_index * n + completion_index
  again = client.completions.create(model=name, prompt=["Hello", "The quick"], n=3, max_tokens=6, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
  text = lambda r: {c.index: c.text for c in r.choices}
  assert text(out) == text(again)                                    # a seed reproduces every completion
  assert len({text(out)[i] for i in range(3)}) > 1                   # the n completions differ from each other
  other = client.completions.create(model=name, prompt=["Hello", "The quick"], n=3, max_tokens=6, temperature=1.0, seed=8,
                                    extra_body={"ignore_eos": True})
  assert text(other) != text(out)
  assert out.usage.completion_tokens == 36


def test_sixteen_concurrent_streams_equal_offline(server, offline, tiny_model):
  import asyncio
  vocab = offline.llm_engine.model_config.vocab_size
  rng = np.random.default_rng(3)
  prompts = [rng.integers(4, vocab, int(n)).tolist() for n in rng.integers(3, 60, 16)]
  want = [o.outputs[0].text for o in offline.generate([{"prompt_token_ids": p} for p in prompts],
                                                       SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]

  async def all_streams():
    client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", timeout=120, max_retries=0)
    async def one(prompt):
      stream = await client.completions.create(model=tiny_model.name, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
      return "".join([c.choices[0].text async for c in stream if c.choices])
    return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=120)

  assert asyncio.run(all_streams()) == want


def test_client_hanging_up_frees_its_blocks(server):
  """A client that closes its stream mid-answer: the request is aborted (not left to run its 200 tokens) and its KV
  blocks freed. The engine is held between two steps while the client hangs up, so the request cannot end first
  (200 tokens of a tiny model take about 0.1 s: once, on a loaded machine, no scrape of /metrics in 15 s saw it run)."""
  url, engine = server
  generated = metric(url, "tinyvllm:generation_tokens_total")
  body = {"messages": MESSAGES, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
  held, release = threading.Event(), threading.Event()
  def hold(e):   # in the engine thread, between two steps
    state = len(e.scheduler.running), e.block_manager.num_free, e.block_manager.num_blocks
    held.set()
    release.wait(30)
    return state
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
      lines = r.iter_lines()
      for _ in range(6): next(lines)                                # a few frames: the request is running
      state = pool.submit(engine.engine.call, hold)
      assert held.wait(30)
    time.sleep(0.5)   # the connection is closed: the server sees it go and queues the abort, before the engine steps on
    release.set()
    running, free, total = state.result(timeout=30)
  assert running == 1 and free < total
  assert wait_until(lambda: metric(url, "tinyvllm:num_requests_running") == 0 and metric(url, "tinyvllm:kv_cache_usage_perc") == 0)
  assert metric(url, "tinyvllm:generation_tokens_total") - generated < 100   # aborted, not run to its 200 tokens
  free, total = engine.engine.call(lambda e: (e.block_manager.num_free, e.block_manager.num_blocks))
  assert free == total


def test_metrics_move_as_requests_run(server, client):
  url = server[0]
  before = {k: metric(url, f"tinyvllm:{k}") for k in ("generation_tokens_total", "prompt_tokens_total")}
  done_before = metric(url, "tinyvllm:request_success_total", finished_reason="length")
  ttft_before = metric(url, "tinyvllm:time_to_first_token_seconds_count")
  out = client.completions.create(model=client.models.list().data[0].id, prompt="Hello world", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
  assert metric(url, "tinyvllm:generation_tokens_total") - before["generation_tokens_total"] == 7
  assert metric(url, "tinyvllm:prompt_tokens_total") - before["prompt_tokens_total"] == out.usage.prompt_tokens
  assert metric(url, "tinyvllm:request_success_total", finished_reason="length") == done_before + 1
  assert metric(url, "tinyvllm:time_to_first_token_seconds_count") == ttft_before + 1
  assert metric(url, "tinyvllm:num_requests_running") == 0 and metric(url, "tinyvllm:num_requests_waiting") == 0


def test_stop_strings_bias_and_openai_extras(server, client, tiny_model, offline):
  base = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
  stop = base[4:6]
  out = client.chat.completions.create(model=tiny_model.name, messages=MESSAGES, temperature=0, max_completion_tokens=12,
                                       stop=[stop], user="someone", extra_body={"ignore_eos": True})
  choice = out.choices[0]
  assert choice.message.content == base[:base.index(stop)] and choice.finish_reason == "stop"
  assert choice.model_extra["stop_reason"] == stop                     # vLLM's extra field
  token = 77                                                           # a bias of +100 makes one token certain
  out = client.completions.create(model=tiny_model.name, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(token): 100},
                                  logprobs=0, extra_body={"ignore_eos": True})
  assert out.choices[0].logprobs.tokens == [offline.get_tokenizer().token_to_str(token)] * 3


def test_one_log_line_per_request(server, client, tiny_model, caplog):
  with caplog.at_level("INFO", logger="tinyvllm.server"):
    out = client.completions.create(model=tiny_model.name, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
  lines = [r.getMessage() for r in caplog.records if out.id in r.getMessage()]
  assert len(lines) == 1 and "ok" in lines[0] and "+ 3 output tokens" in lines[0] and "TTFT" in lines[0]


def test_plain_request_of_a_client_that_hung_up_is_aborted(server):
  """A non-streaming client that gives up: its request is aborted (the engine is held meanwhile, so the client
  surely leaves first) and never runs a step."""
  url, engine = server
  done_before = sum(metric(url, "tinyvllm:request_success_total", finished_reason=r) for r in ("length", "stop"))
  gate = threading.Event()
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    held = pool.submit(engine.engine.call, lambda e: gate.wait(60))
    with pytest.raises(httpx.ReadTimeout):
      httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 50, "ignore_eos": True}, timeout=0.5)
    time.sleep(0.3)                                                    # the server sees the disconnect and queues the abort
    gate.set()
    held.result(60)
  assert wait_until(lambda: engine.engine.call(lambda e: not e.has_unfinished_requests()))
  assert sum(metric(url, "tinyvllm:request_success_total", finished_reason=r) for r in ("length", "stop")) == done_before
  free, total = engine.engine.call(lambda e: (e.block_manager.num_free, e.block_manager.num_blocks))
  assert free == total


def test_idle_server_uses_no_cpu(server):
  time.sleep(0.5)
  start = time.process_time()
  time.sleep(1.0)
  assert time.process_time() - start < 0.2        # a loop polling for work would burn a whole core (~1.0 s)


def test_tokenize_and_detokenize(server, offline):
  url = server[0]
  tok = offline.get_tokenizer()
  r = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
  assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
  assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"], False)


# **** errors ****

def post(url: str, path: str, body, headers=None) -> httpx.Response:
  content = body if isinstance(body, (bytes, str)) else json.dumps(body)
  return httpx.post(url + path, content=content, headers={"content-type": "application/json", **(headers or {})}, timeout=60)


@pytest.mark.parametrize("path, body, status, param, words", [
  ("/v1/chat/completions", b'{"messages": [', 400, None, "not valid JSON"),
  ("/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-4"}, 404, "model", "does not exist"),
  ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, 400, "temperature", "temperature"),
  ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, 400, "temperature", "valid number"),
  ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, 400, "top_p", "(0, 1]"),
  # the fixture model's template never reads tools: refused, not dropped (tool calling itself: tests/test_tools.py)
  ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "no tool support"),
  ("/v1/chat/completions", {"messages": MESSAGES, "functions": [{"name": "f"}]}, 400, "functions", "not supported"),
  ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "yaml"}}, 400, "response_format", "'json_schema'"),
  ("/v1/chat/completions", {"messages": MESSAGES, "temprature": 0.5}, 400, "temprature", "unknown field"),
  ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs", "logprobs=true"),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages", "only text"),
  ("/v1/chat/completions", {}, 400, "messages", "required"),
  ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1000}, 400, "max_tokens", "context length"),
  ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"999999": 5}}, 400, "messages", "outside the vocabulary"),
  ("/v1/completions", {"prompt": "word " * 300}, 400, "prompt", "max_model_len"),
  ("/v1/completions", {"prompt": [10**7]}, 400, "prompt", "outside the vocabulary"),
  ("/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
  ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
  ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", ">= 1"),
  ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", "seed"),
  ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", "string"),
  ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream=true"),
])
def test_errors_have_status_and_openai_body(server, path, body, status, param, words):
  r = post(server[0], path, body)
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and words in err["message"]
  assert err["type"] == "invalid_request_error"


def test_prompt_too_long_names_both_lengths(server):
  r = post(server[0], "/v1/completions", {"prompt": [5] * 300})
  assert r.status_code == 400 and "300 tokens" in r.json()["error"]["message"] and "256" in r.json()["error"]["message"]


def test_unknown_route_is_openai_shaped(server):
  r = httpx.get(server[0] + "/v1/nothing")
  assert r.status_code == 404 and "error" in r.json()


def test_api_key(tiny_model):
  app = create_app(EngineConfig(model=str(tiny_model), block_size=8, num_kv_blocks=64), api_key="sekrit")
  with serve_in_thread(app) as url:
    body = {"prompt": "Hi", "max_tokens": 2}
    assert post(url, "/v1/completions", body).status_code == 401
    r = post(url, "/v1/completions", body, {"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(url, "/v1/completions", body, {"authorization": "Bearer sekrit"}).status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    good = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0, timeout=60)
    assert good.completions.create(model=good.models.list().data[0].id, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_queue_full_is_503(tiny_model):
  """With --max-waiting-requests 1, a request that finds one waiting is refused with 503 until the queue drains.
  The engine thread is held in a call meanwhile, so the first request stays queued however fast the model is."""
  app = create_app(EngineConfig(model=str(tiny_model), block_size=8, num_kv_blocks=64), max_waiting_requests=1)
  engine = app.state.engine.engine
  with serve_in_thread(app) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
    gate = threading.Event()
    held = pool.submit(engine.call, lambda e: gate.wait(60))
    first = pool.submit(post, url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
    assert wait_until(lambda: engine.num_waiting == 1)
    r = post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "server_error"
    gate.set()
    held.result(60)
    assert first.result(60).status_code == 200
    assert post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


# **** the command line ****

def test_serve_command(tiny_model, tmp_path):
  """`python -m tinyvllm.serve MODEL --port 0` loads, captures its pass shapes when asked (`--warmup on`; a GPU's
  default), says where it listens, answers, and stops on SIGINT."""
  env = {**os.environ, "DEV": "CPU"}
  proc = subprocess.Popen([sys.executable, "-m", "tinyvllm.serve", str(tiny_model), "--port", "0", "--num-kv-blocks", "32",
                           "--block-size", "8", "--served-model-name", "tiny", "--warmup", "on", "--max-num-seqs", "4",
                           "--max-num-batched-tokens", "32"], stderr=subprocess.PIPE, text=True, env=env)
  try:
    url, before = None, []
    deadline = time.time() + 120
    while url is None and time.time() < deadline:
      line = proc.stderr.readline()
      if not line: break
      m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
      if m: url = m.group(1)
      else: before.append(line)
    assert url, "the server never said where it listens"
    # decode batches of 1, 2 and 4; packed prefill passes of 8, 12, 16, 24 and 32 tokens
    assert any(re.search(r"captured 8 pass shapes before serving", line) for line in before), before
    assert wait_until(lambda: _ok(url + "/health"), 30)
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
  finally:
    proc.send_signal(signal.SIGINT)
    code = proc.wait(30)
  rest = proc.stderr.read()
  assert code == 0 and "Traceback" not in rest and "Finished server process" in rest


def _ok(url: str) -> bool:
  try: return httpx.get(url, timeout=2).status_code == 200
  except httpx.HTTPError: return False


@pytest.mark.parametrize("args, words", [
  (["--chat-template", "/no/such/template.jinja"], "--chat-template"),
  (["--block-size", "7"], "block_size"),
  (["/no/such/model.gguf"], "does not exist"),
])
def test_serve_command_bad_input_is_one_line(tiny_model, args, words):
  cmd = [sys.executable, "-m", "tinyvllm.serve", "--port", "0", *args]
  if not any(a.startswith("/no/such/model") for a in args): cmd.insert(3, str(tiny_model))
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "DEV": "CPU"})
  assert r.returncode == 2 and "Traceback" not in r.stderr and words in r.stderr.strip().splitlines()[-1]


def test_speculative_metrics(tiny_model):
  app = create_app(EngineConfig(model=str(tiny_model), block_size=8, num_kv_blocks=64, draft_model="self:1", speculation="always"))
  with serve_in_thread(app) as url:
    r = post(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    drafted, accepted = metric(url, "tinyvllm:spec_decode_num_draft_tokens_total"), metric(url, "tinyvllm:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    assert drafted % 4 == 0                                  # 4 drafts proposed per speculative step


def test_prefix_cache_in_usage_and_metrics(server, client, tiny_model):
  url = server[0]
  messages = [{"role": "system", "content": "12345 67890 3.14159 " + "Answer briefly. " * 12}, {"role": "user", "content": "Hello world"}]
  hits_before = metric(url, "tinyvllm:prefix_cache_hits_total")
  queries_before = metric(url, "tinyvllm:prefix_cache_queries_total")
  first = client.chat.completions.create(model=tiny_model.name, messages=messages, max_tokens=2, temperature=0)
  second = client.chat.completions.create(model=tiny_model.name, messages=messages, max_tokens=2, temperature=0)
  first_cached, cached = first.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens_details.cached_tokens
  assert first_cached <= 8                                                    # at most the chat template's opening block
  assert cached == (second.usage.prompt_tokens - 1) // 8 * 8 > first_cached  # every full block but the last token's
  assert metric(url, "tinyvllm:prefix_cache_hits_total") - hits_before == first_cached + cached
  assert metric(url, "tinyvllm:prefix_cache_queries_total") - queries_before == 2 * second.usage.prompt_tokens


def test_null_fields_mean_their_defaults(server):
  """OpenAI lets clients send null for most fields (some SDKs do): null is the default, never a 400."""
  url = server[0]
  nulls = {"n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None, "temperature": None, "top_p": None,
           "stop": None, "seed": None, "logit_bias": None, "user": None, "ignore_eos": None, "min_tokens": None}
  r = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "logprobs": None, "top_logprobs": None, **nulls})
  assert r.status_code == 200 and len(r.json()["choices"]) == 1
  r = post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "echo": None, "logprobs": None, **nulls})
  assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


def test_continuous_usage_in_completion_streams(server):
  body = {"prompt": "Hi", "max_tokens": 5, "stream": True, "ignore_eos": True, "temperature": 0,
          "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
  with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60) as r:
    chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
  counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
  assert counts == sorted(counts) and counts[-1] == 5 and not chunks[-1]["choices"]


# **** structured output ****

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"], "properties": {
  "name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
  "x-guidance": {"whitespace_flexible": False}}   # a random model could write whitespace forever; llguidance's option


def test_response_format_json_schema_through_the_openai_client(server, client, tiny_model):
  import jsonschema
  out = client.chat.completions.create(model=tiny_model.name, messages=MESSAGES, temperature=1.0, n=4, max_tokens=100, seed=3,
                                       response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                                              "strict": True}})
  assert len(out.choices) == 4
  for choice in out.choices:
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
  # streamed: the deltas join to a valid document too
  chunks = client.chat.completions.create(model=tiny_model.name, messages=MESSAGES, temperature=1.0, max_tokens=100, seed=4, stream=True,
                                          response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
  jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), PERSON)


def test_response_format_json_object_and_structured_outputs_on_completions(server, client, tiny_model, offline):
  # +100 on "{" and "}" makes each certain wherever the grammar allows it: "{}" at once, where the bias alone would
  # repeat braces until max_tokens
  braces = {str(offline.get_tokenizer().encode(b, add_special_tokens=False)[0]): 100 for b in "{}"}
  out = client.completions.create(model=tiny_model.name, prompt="Hello", max_tokens=8, logit_bias=braces, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})   # vLLM's, on completions too
  assert out.choices[0].text == "{}" and out.choices[0].finish_reason == "stop"
  out = client.completions.create(model=tiny_model.name, prompt=["Hello", "The quick"], n=3, max_tokens=20, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": r"[a-z]{2,4}-[0-9]{2}"}})
  assert len(out.choices) == 6 and all(re.fullmatch(r"[a-z]{2,4}-[0-9]{2}", c.text) for c in out.choices)
  out = client.chat.completions.create(model=tiny_model.name, messages=MESSAGES, max_tokens=10, temperature=1.0, n=5,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
  assert {c.message.content for c in out.choices} <= {"yes", "no"}


@pytest.mark.parametrize("path, body, param, words", [
  ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
   "response_format", "response_format.json_schema.schema: invalid JSON schema: Invalid type: foo"),
  ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
   "json_schema.schema must be a JSON schema"),
  ("/v1/completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "structured_outputs.regex: invalid regular expression"),
  ("/v1/completions", {"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs", "invalid grammar"),
  ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
  ("/v1/completions", {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag is not supported"),
  ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "not both"),
  ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
])
def test_structured_output_errors_are_400s(server, path, body, param, words):
  base = {"messages": MESSAGES} if "chat" in path else {"prompt": "Hi"}
  r = post(server[0], path, {**base, **body})
  assert r.status_code == 400, r.text
  err = r.json()["error"]
  assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"


def test_a_failing_model_pass_answers_500_naming_the_cause(server, client):
  """A pass that raises on the device: the error response (plain and streamed) names the cause, the next request is
  served as before."""
  url, engine = server
  def boom(*a, **kw): raise RuntimeError("CUDA Error 1, invalid argument (injected)")
  execute = engine.engine.call(lambda e: e.runner.execute)
  engine.engine.call(lambda e: setattr(e.runner, "execute", boom))
  try:
    with pytest.raises(openai.InternalServerError, match="generation failed: RuntimeError: CUDA Error 1, invalid argument") as e:
      client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=4)
    assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "stream": True}, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "CUDA Error 1" in events[-1]["error"]["message"]
  finally: engine.engine.call(lambda e: setattr(e.runner, "execute", execute))
  assert client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=4).choices[0].message.content


def test_merged_streams_hold_still_while_the_writer_sends():
  """merge_streams over two streams of deltas (a completions request with two prompts): the running total handed to
  the writer must not change while the writer sends it, though the other stream's pump runs meanwhile (it once did:
  text went out twice or never, and a finish was lost). Fake streams of 20 one-character deltas arriving at once."""
  import asyncio
  from tinyvllm.entrypoints.openai.serving import RunningTotals, merge_streams
  from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

  class Deltas:
    def __init__(self, rid: str): self.rid, self.i = rid, 0
    def __aiter__(self): return self
    async def __anext__(self):
      if self.i == 20: raise StopAsyncIteration
      await asyncio.sleep(0)
      self.i += 1
      return RequestOutput(self.rid, "p", [1], [CompletionOutput(0, str(self.i % 10), [self.i], finish_reason="length" if self.i == 20 else None)],
                           self.i == 20, RequestMetrics(0.0))
    async def aclose(self): pass

  async def read() -> dict:
    seen = {}
    async for i, out in merge_streams([RunningTotals(Deltas("a")), RunningTotals(Deltas("b"))]):
      text, tokens = out.outputs[0].text, list(out.outputs[0].token_ids)
      for _ in range(5): await asyncio.sleep(0)   # a slow client: the send awaits, the pumps run
      assert (out.outputs[0].text, out.outputs[0].token_ids) == (text, tokens)
      seen[i] = (text, tokens, out.outputs[0].finish_reason)
    return seen
  want = ("".join(str(i % 10) for i in range(1, 21)), list(range(1, 21)), "length")
  assert asyncio.run(read()) == {0: want, 1: want}
