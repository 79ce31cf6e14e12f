"""Tool calling: each format's parser on literal outputs written as each family documents them, the grammars that
force valid calls (checked with llguidance on strings that do and do not satisfy the schemas), and the server
driven by the `openai` client on a tiny random checkpoint whose chat template reads tools (Hermes style, as Qwen's):
forced calls are valid whatever the weights, streamed calls equal plain ones, a two-turn loop renders the call and
its result, and every malformed request is a 400 naming its field."""
from __future__ import annotations
import json
from typing import Literal   # the Agents SDK reads a function tool's annotations from this module
import httpx
import openai
import pytest
from conftest import serve_in_thread
from tinyvllm.config import EngineConfig
from tinyvllm.entrypoints.openai.api_server import create_app
from tinyvllm.sampling_params import StructuredOutputsParams
from tinyvllm.tools import FORMATS, check_tools, detect_format, scan_calls, streamable

# bounded strings and numbers: a random-weight model under the grammar must finish a call within max_tokens
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                                                            "days": {"type": "integer", "minimum": 0,
                                                                                                     "maximum": 9}},
                                                           "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}

# a Hermes-style template (Qwen2.5's shape): tools in the system turn, calls in <tool_call> blocks, results as tool turns
HERMES_TEMPLATE = (
  "{% if tools %}<|im_start|>system\nYou may call these functions:\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
  "Answer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
  "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
  "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
  "</tool_call>{% endfor %}<|im_end|>\n{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
  "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# **** parsers, on outputs written as each format's documentation shows them ****

@pytest.mark.parametrize("fmt,text,content,calls", [
  ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
   "Let me check.", [("get_weather", {"city": "Paris", "days": 2})]),
  ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Oslo", "days": 1}}\n</tool_call>', None, [("get_time", {}), ("get_weather", {"city": "Oslo", "days": 1})]),
  ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None,
   [("get_weather", {"city": "Paris", "days": 2})]),
  ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}', None,
   [("get_time", {}), ("get_weather", {"city": "Rome", "days": 3})]),
  ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "get_time", "arguments": {}}]',
   None, [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
  ("json", '{"name": "get_weather", "arguments": {"city": "Lima", "days": 5}}', None, [("get_weather", {"city": "Lima", "days": 5})]),
  ("json", '[{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),
])
def test_parsers_read_each_format(fmt, text, content, calls):
  got_content, got = FORMATS[fmt].parse(text)
  assert got_content == content
  assert [(c.name, json.loads(c.arguments)) for c in got] == calls
  assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("fmt,text", [
  ("hermes", "The weather is fine."), ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'),
  ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'),
  ("llama3_json", "Sure: {not json}"), ("mistral", "[TOOL_CALLS] nothing"), ("json", '{"city": "Paris"}'), ("json", "Hello"),
])
def test_text_that_is_not_a_call_stays_content(fmt, text):
  assert FORMATS[fmt].parse(text) == (text, [])


def test_hermes_calls_among_other_text():
  """Calls after a reasoning model's thoughts that mention the tag, text after the calls (kept as content), and a
  string argument holding the closing tag."""
  call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
  content, calls = FORMATS["hermes"].parse("<think>\nI could use a <tool_call> block.\n</think>\n\n" + call)
  assert [c.name for c in calls] == ["get_time"] and "I could use" in content
  content, calls = FORMATS["hermes"].parse(call + "\n\nI will wait for the result.")
  assert [c.name for c in calls] == ["get_time"] and content == "I will wait for the result."
  tricky = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b", "days": 1}}\n</tool_call>'
  assert json.loads(FORMATS["hermes"].parse(tricky)[1][0].arguments)["city"] == "a</tool_call>b"


def test_mistral_args_spelling():
  """Mistral Small 3.x's spelling: [TOOL_CALLS]name[ARGS]{...} per call ([CALL_ID]id in history); its grammar."""
  from tinyvllm.tools import MISTRAL_ARGS
  text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}'
  content, calls = MISTRAL_ARGS.parse(text)
  assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}),
                                                                                       ("get_time", {})]
  assert MISTRAL_ARGS.parse('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]')[1][0].name == "get_time"   # the older spelling
  assert MISTRAL_ARGS.parse("[TOOL_CALLS]get_weather[ARGS]{broken")[1] == []
  assert MISTRAL_ARGS.scan('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa') == [("get_weather", '{"city": "Pa', False)]
  assert detect_format("... '[TOOL_CALLS]' + name + '[ARGS]' ...") is MISTRAL_ARGS


def test_mistral_args_grammar(tiny_model):
  from tinyvllm.model.tokenizer import load_tokenizer
  from tinyvllm.structured_output.compiler import GrammarCompiler
  from tinyvllm.tools import MISTRAL_ARGS
  tok = load_tokenizer(tiny_model)
  compiler = GrammarCompiler(tok, tok.vocab_size)
  def accepts(grammar, text):
    matcher = compiler.compile(StructuredOutputsParams(grammar=grammar)).new_state().matcher
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
  both, one = MISTRAL_ARGS.grammar([WEATHER, TIME], True), MISTRAL_ARGS.grammar([TIME], False)
  assert accepts(both, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{}')
  assert not accepts(both, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 12}')
  assert not accepts(both, '[TOOL_CALLS]get_date[ARGS]{}')
  assert accepts(one, "[TOOL_CALLS]get_time[ARGS]{}") and not accepts(one, "[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_time[ARGS]{}")


def test_scan_calls_follows_a_call_as_it_is_written():
  text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa{r}\\"is", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_ti'
  assert scan_calls(text) == [("get_weather", '{"city": "Pa{r}\\"is", "days": 2}', True)]   # braces in strings do not count
  cut = text[:text.index(', "days"')]
  assert scan_calls(cut) == [("get_weather", '{"city": "Pa{r}\\"is"', False)]
  assert scan_calls('[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"ci') == \
    [("get_time", "{}", True), ("get_weather", '{"ci', False)]
  assert scan_calls('{"name": "get_time", "parameters": {}}', "parameters") == [("get_time", "{}", True)]
  _, calls = FORMATS["hermes"].parse(text[:text.rindex("\n<tool_call>")])
  assert calls[0].arguments == '{"city": "Pa{r}\\"is", "days": 2}'   # the arguments as written


def test_streams_hold_back_what_may_become_a_call():
  hermes, llama = FORMATS["hermes"], FORMATS["llama3_json"]
  assert streamable(hermes, "Let me see <tool_") == len("Let me see ")
  assert streamable(hermes, "Let me see <tool_call>\n{") == len("Let me see ")
  assert streamable(hermes, "a < b") == len("a < b")
  assert streamable(llama, "  ") == 0 and streamable(llama, "Paris is") == len("Paris is")


def test_format_detection_and_tool_checks():
  assert detect_format(HERMES_TEMPLATE).name == "hermes" and detect_format("[TOOL_CALLS]").name == "mistral"
  assert detect_format("<|python_tag|>").name == "llama3_json" and detect_format(None).name == "json"
  assert check_tools([WEATHER, TIME]) == [WEATHER, TIME]
  for bad, where in [([{"type": "fn", "function": {"name": "x"}}], r"tools\[0\].type"), ([{"type": "function"}], r"tools\[0\].function"),
                     ([{"type": "function", "function": {"name": "a b"}}], r"tools\[0\].function.name"),
                     ([WEATHER, WEATHER], r"tools\[1\].function.name 'get_weather' is given twice"),
                     ([{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}], "describe an object"), ([], "non-empty")]:
    with pytest.raises(ValueError, match=where): check_tools(bad)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_grammars_accept_valid_calls_only(tiny_model, fmt):
  """llguidance on the grammar of each format: a call with arguments that satisfy the schema is a complete sentence;
  a wrong argument type, a missing required argument or an unknown tool is refused."""
  from tinyvllm.model.tokenizer import load_tokenizer
  from tinyvllm.structured_output.compiler import GrammarCompiler
  tok = load_tokenizer(tiny_model)
  compiler = GrammarCompiler(tok, tok.vocab_size)
  f = FORMATS[fmt]
  def call(name, args): return {"name": name, f.arguments_key: args}
  def written(*calls) -> str:
    if fmt == "hermes": return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    if fmt == "llama3_json": return "; ".join(json.dumps(c) for c in calls)
    if fmt == "mistral": return "[TOOL_CALLS]" + json.dumps(list(calls))
    return json.dumps(calls[0] if len(calls) == 1 else list(calls))
  def accepts(grammar: str, text: str) -> bool:
    matcher = compiler.compile(StructuredOutputsParams(grammar=grammar)).new_state().matcher
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
  both = f.grammar([WEATHER, TIME], parallel=True)
  assert accepts(both, written(call("get_weather", {"city": "Paris", "days": 2})))
  assert accepts(both, written(call("get_weather", {"city": "Paris", "days": 2}), call("get_time", {})))
  assert not accepts(both, written(call("get_weather", {"city": "Paris", "days": "two"})))
  assert not accepts(both, written(call("get_weather", {"city": "Paris", "days": 12})))   # past the schema's maximum
  assert not accepts(both, written(call("get_weather", {"city": "Paris"})))
  assert not accepts(both, written(call("get_date", {})))
  untyped = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}}}
  assert not accepts(f.grammar([untyped], parallel=False), written(call("f", "hello")))   # parameters describe an object
  one = f.grammar([TIME], parallel=False)
  assert accepts(one, written(call("get_time", {}))) and not accepts(one, written(call("get_time", {}), call("get_time", {})))


def test_a_marker_that_is_one_token_is_asked_for_as_that_token(tiny_model):
  """Mistral's [TOOL_CALLS] is a single special token in its vocabulary: the forced grammar asks for that token, not
  for its spelling in pieces (here the tiny vocabulary's special <|im_start|>, id 2, stands in for it)."""
  from tinyvllm.model.tokenizer import load_tokenizer
  from tinyvllm.structured_output.compiler import GrammarCompiler
  tok = load_tokenizer(tiny_model)
  grammar = FORMATS["mistral"].grammar([TIME], False, token_of=lambda text: 2)
  assert grammar.startswith("start: <[2]> calls")
  matcher = GrammarCompiler(tok, tok.vocab_size).compile(StructuredOutputsParams(grammar=grammar)).new_state().matcher
  ids = [2] + tok.encode('[{"name": "get_time", "arguments": {}}]', add_special_tokens=False)
  assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_generic_format_writes_tool_history_as_turns():
  from tinyvllm.tools import prepare_chat
  history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                             "function": {"name": "get_time", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
  messages, extra = prepare_chat(history, [TIME], "{% for m in messages %}{{ m.content }}{% endfor %}", generic=True)
  assert messages[0]["role"] == "system" and "get_time" in messages[0]["content"] and not extra
  assert messages[-2] == {"role": "assistant", "content": '{"name": "get_time", "arguments": {}}'}
  assert messages[-1] == {"role": "user", "content": "Result of call call_1: noon"}


async def _collect(agen) -> list[dict]:
  return [json.loads(f.split("data: ", 1)[1]) for f in [x async for x in agen] if "data: {" in f]


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_streamed_content_before_a_call_equals_the_answer(tiny_model, endpoint):
  """Outputs merged by a lagging client (the last one carries text not sent yet), blanks before a call: the streamed
  content is the answer's content exactly, and a call after blanks alone opens no message (review findings)."""
  import asyncio
  from tinyvllm.entrypoints.openai.serving import ServerSettings
  from tinyvllm.entrypoints.openai.serving_chat import OpenAIServingChat
  from tinyvllm.entrypoints.openai.serving_responses import OpenAIServingResponses, ResponsesRequest, output_items
  from tinyvllm.entrypoints.openai.protocol import ChatCompletionRequest
  from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
  call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
  class FakeStream:
    def __init__(self, texts): self.texts = texts
    def __aiter__(self): return self._gen()
    async def _gen(self):
      for k, t in enumerate(self.texts):
        done = k == len(self.texts) - 1
        yield RequestOutput("r", None, [1, 2], [CompletionOutput(0, t, list(range(k + 1)), finish_reason="stop" if done else None)],
                            done, RequestMetrics(arrival_time=0.0))
    async def aclose(self): pass
  class FakeEngine:
    def get_tokenizer(self): return None
  chat = OpenAIServingChat.__new__(OpenAIServingChat)
  chat.settings, chat.tokenizer = ServerSettings("m", "p"), None
  fmt = FORMATS["hermes"]
  for texts in (["\nI'll", "\nI'll check." + call], ["\n", "\n" + call], ["Hello  ", "Hello  there\n\n<tool_", "Hello  there\n\n" + call]):
    want, calls = fmt.parse(texts[-1])
    if endpoint == "chat":
      body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "stream": True, "tools": [TIME]})
      frames = asyncio.run(_collect(chat._stream(body, "id", 0.0, FakeStream(texts), fmt)))
      got = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f.get("choices"))
      names = [tc["function"]["name"] for f in frames if f.get("choices") for tc in f["choices"][0]["delta"].get("tool_calls") or []
               if "name" in tc.get("function", {})]
      assert got == (want or "") and names == ["get_time"]
    else:
      body = ResponsesRequest.model_validate({"input": "hi", "stream": True, "tools": [{"type": "function", "name": "get_time"}]})
      responses = OpenAIServingResponses(chat)
      frames = asyncio.run(_collect(responses._stream(body, "resp_x", 0.0, FakeStream(texts), fmt, lambda items: None)))
      got = "".join(f["delta"] for f in frames if f["type"] == "response.output_text.delta")
      final = frames[-1]["response"]["output"]
      plain = output_items(texts[-1], fmt)
      assert got == (want or "") and [i["type"] for i in final] == [i["type"] for i in plain]


# **** the server ****

@pytest.fixture(scope="module")
def tool_server(tiny_model_factory):   # the "long" checkpoint: tools in the prompt take a few hundred of its tiny vocabulary's tokens
  app = create_app(EngineConfig(model=str(tiny_model_factory("long")), block_size=16, num_kv_blocks=512, max_model_len=1024),
                   chat_template=HERMES_TEMPLATE)
  with serve_in_thread(app) as url:
    yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def plain_server(tiny_model):   # the fixture model's own template: no tool support
  app = create_app(EngineConfig(model=str(tiny_model), block_size=8, num_kv_blocks=64, max_model_len=256))
  with serve_in_thread(app) as url: yield url


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_weather(args: dict) -> bool:
  return set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 6 and args["days"] in range(10)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_are_valid_and_stream_alike(tool_server, choice):
  url, client = tool_server
  kw = dict(model=client.models.list().data[0].id, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, temperature=0,
            max_tokens=120, parallel_tool_calls=False)
  out = client.chat.completions.create(**kw)
  c = out.choices[0]
  assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
  call = c.message.tool_calls[0]
  assert call.type == "function" and call.id.startswith("call_")
  args = json.loads(call.function.arguments)
  if isinstance(choice, dict): assert call.function.name == "get_weather"
  assert call.function.name in ("get_weather", "get_time") and (valid_weather(args) if call.function.name == "get_weather" else args == {})
  # streamed: the call's id and name first (empty arguments), then its arguments; the same call as the plain answer
  chunks = list(client.chat.completions.create(**kw, stream=True))
  deltas = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]
  assert deltas[0][0].function.name == call.function.name and deltas[0][0].function.arguments == "" and deltas[0][0].id
  assert "".join(d[0].function.arguments or "" for d in deltas) == call.function.arguments
  assert len(deltas) > 3   # a forced call streams as it is written: its arguments in several fragments
  assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]


def test_parallel_calls_none_and_auto(tool_server):
  url, client = tool_server
  model = client.models.list().data[0].id
  out = client.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0,
                                       seed=3, max_tokens=200, n=4)
  for c in out.choices:   # every completion a list of one or more valid calls
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
      args = json.loads(call.function.arguments)
      assert valid_weather(args) if call.function.name == "get_weather" else (call.function.name == "get_time" and args == {})
  none = client.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER], tool_choice="none", max_tokens=8,
                                        extra_body={"ignore_eos": True})
  assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
  auto = client.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER], max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
  assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content   # random weights: prose


def test_two_turn_agent_loop_renders_the_call_and_its_result(tool_server):
  url, client = tool_server
  model = client.models.list().data[0].id
  first = client.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER], tool_choice="required", temperature=0,
                                         max_tokens=120, parallel_tool_calls=False)
  assert first.choices[0].finish_reason == "tool_calls"
  call = first.choices[0].message.tool_calls[0]
  history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
  second = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=6,
                                          extra_body={"ignore_eos": True})
  assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
  rendered = httpx.post(url + "/detokenize", json={"tokens": httpx.post(url + "/tokenize", json={"messages": history}).json()["tokens"]}).json()
  assert f'"name": "{call.function.name}"' in rendered["prompt"] and "sunny, 21 C" in rendered["prompt"]
  assert '"arguments": {"city": ' in rendered["prompt"]   # the arguments written as an object, not as a JSON string


@pytest.mark.parametrize("body,param,words", [
  ({"tools": [{"type": "fn", "function": {"name": "x"}}]}, "tools", "tools[0].type"),
  ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
  ({"tool_choice": "required"}, "tool_choice", "needs tools"),
  ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
  ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
    "tool_choice": "required"}, "tools", "tools"),
  ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "forces a tool call"),
])
def test_bad_tool_requests_are_400s(tool_server, body, param, words):
  url, _ = tool_server
  r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body}, timeout=60)
  assert r.status_code == 400, r.text
  err = r.json()["error"]
  assert err["param"] == param and words in err["message"]


def test_a_refused_request_leaves_one_log_line(tool_server, caplog):
  import logging
  with caplog.at_level(logging.INFO, logger="tinyvllm.server"):
    r = httpx.post(tool_server[0] + "/v1/chat/completions", json={"messages": MESSAGES, "tool_choice": "required"}, timeout=60)
  assert r.status_code == 400
  lines = [rec.getMessage() for rec in caplog.records if "refused" in rec.getMessage()]
  assert len(lines) == 1 and "400 (param tool_choice)" in lines[0] and "needs tools" in lines[0]


def test_a_template_without_tools_says_so(plain_server):
  r = httpx.post(plain_server + "/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 4}, timeout=60)
  assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "no tool support" in r.json()["error"]["message"]
  history = MESSAGES + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                              "function": {"name": "get_weather", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
  r = httpx.post(plain_server + "/v1/chat/completions", json={"messages": history, "max_tokens": 4}, timeout=60)
  assert r.status_code == 400 and "does not write them" in r.json()["error"]["message"]   # never dropped silently


def test_llm_chat_with_tools(tiny_model_factory):
  """The Python API: LLM.chat(tools=...) renders them through the template; the format's grammar forces a call,
  which the format's parser reads back; a template without tools refuses them."""
  from tinyvllm import LLM, SamplingParams
  llm = LLM(str(tiny_model_factory("long")), block_size=16, num_kv_blocks=256, max_model_len=1024)
  try:
    fmt = FORMATS["hermes"]
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(grammar=fmt.grammar([WEATHER], False)))
    out = llm.chat(MESSAGES, params, tools=[WEATHER], chat_template=HERMES_TEMPLATE, use_tqdm=False)[0]
    assert "get_weather" in out.prompt and out.outputs[0].finish_reason == "stop"
    content, calls = fmt.parse(out.outputs[0].text)
    assert content is None and [c.name for c in calls] == ["get_weather"] and valid_weather(json.loads(calls[0].arguments))
    with pytest.raises(ValueError, match="no tool support"): llm.chat(MESSAGES, tools=[WEATHER], use_tqdm=False)
    # the EOS that ends an answer is not its text, even with special tokens kept (a parser must see only the call)
    kept = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=120, skip_special_tokens=False, structured_outputs=params.structured_outputs),
                    tools=[WEATHER], chat_template=HERMES_TEMPLATE, use_tqdm=False)[0].outputs[0]
    assert kept.finish_reason == "stop" and kept.text == out.outputs[0].text and fmt.parse(kept.text)[1]
    with pytest.raises(ValueError, match=r"tools\[0\].type"): llm.chat(MESSAGES, tools=[{"type": "x"}], use_tqdm=False)
  finally:
    llm.shutdown()


# **** the Responses API ****

def test_responses_text_tools_and_continuation(tool_server):
  """client.responses.create: text with instructions (equal to the chat answer of the same conversation), a forced
  function call, then its output sent back with previous_response_id, streamed and not."""
  url, client = tool_server
  model = client.models.list().data[0].id
  r = client.responses.create(model=model, input="What is the weather in Paris?", instructions="Be brief.", max_output_tokens=6,
                              temperature=0)
  chat = client.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."}] + MESSAGES, max_tokens=6,
                                        temperature=0)
  assert r.object == "response" and r.id.startswith("resp_") and r.output_text == chat.choices[0].message.content
  assert r.status in ("completed", "incomplete") and r.usage.output_tokens == chat.usage.completion_tokens
  tools = [{"type": "function", **WEATHER["function"]}]
  called = client.responses.create(model=model, input="What is the weather in Paris?", tools=tools, tool_choice="required",
                                   parallel_tool_calls=False, temperature=0, max_output_tokens=120)
  calls = [item for item in called.output if item.type == "function_call"]
  assert len(calls) == 1 and calls[0].name == "get_weather" and valid_weather(json.loads(calls[0].arguments))
  follow = client.responses.create(model=model, previous_response_id=called.id, tools=tools, tool_choice="none", max_output_tokens=4,
                                   input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
  assert follow.previous_response_id == called.id and follow.output[0].type == "message"
  # streamed: the same call, through the Responses API's events
  events = list(client.responses.create(model=model, input="What is the weather in Paris?", tools=tools, tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_output_tokens=120, stream=True))
  kinds = [e.type for e in events]
  assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
  args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
  assert "".join(args) == calls[0].arguments and events[-1].response.output[-1].name == "get_weather"
  assert len(args) > 3 and kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
  text_events = list(client.responses.create(model=model, input="What is the weather in Paris?", instructions="Be brief.",
                                             max_output_tokens=6, temperature=0, stream=True))
  assert "".join(e.delta for e in text_events if e.type == "response.output_text.delta") == r.output_text


@pytest.mark.parametrize("body,status,param", [
  ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
  ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
  ({"input": [{"type": "image", "url": "x"}]}, 400, "input"),
  ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
  ({"input": "hi", "temprature": 1}, 400, "temprature"),
])
def test_bad_responses_requests(tool_server, body, status, param):
  r = httpx.post(tool_server[0] + "/v1/responses", json=body, timeout=60)
  assert r.status_code == status, r.text
  assert r.json()["error"]["param"] == param


# **** agent frameworks, as their users drive a local server ****

def test_openai_agents_sdk_default_responses_path(tool_server):
  """The OpenAI Agents SDK's default model (the Responses API, streamed) with a function tool: the turn is forced to
  call it, the SDK parses the call and runs the function with the arguments we sent, and (stop_on_first_tool: a
  random-weight model never ends a text turn on its own) its result is the run's final output."""
  agents = pytest.importorskip("agents", reason="openai-agents is not installed")
  from openai import AsyncOpenAI
  url, client = tool_server
  agents.set_tracing_disabled(True)
  seen = []
  @agents.function_tool
  def get_weather(city: Literal["Paris", "Oslo"], days: Literal[1, 2, 3]) -> str:
    """Weather in a city."""
    seen.append((city, days))
    return "sunny"
  model = agents.OpenAIResponsesModel(model=client.models.list().data[0].id,
                                      openai_client=AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0))
  agent = agents.Agent(name="weather", instructions="Answer about the weather.", tools=[get_weather], model=model,
                       tool_use_behavior="stop_on_first_tool",
                       model_settings=agents.ModelSettings(tool_choice="required", max_tokens=120, temperature=0))
  result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
  assert len(seen) == 1 and seen[0][0] in ("Paris", "Oslo") and seen[0][1] in (1, 2, 3)
  assert result.final_output == "sunny"


def test_langchain_bind_tools(tool_server):
  lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
  url, client = tool_server
  llm = lc.ChatOpenAI(base_url=url + "/v1", api_key="unused", model=client.models.list().data[0].id, temperature=0, max_tokens=120)
  message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
  assert [c["name"] for c in message.tool_calls] == ["get_weather"] and valid_weather(message.tool_calls[0]["args"])


# **** the families' own chat templates (llama.cpp keeps copies in its sources: the llama-cpp-python sdist) ****

@pytest.fixture(scope="module")
def real_templates():
  from tinyvllm.model.fetch import FetchError, fetch_sdist_members
  try:
    root = fetch_sdist_members("llama-cpp-python", "0.3.36", r"^vendor/llama\.cpp/models/templates/.*\.jinja$")
  except FetchError as e: pytest.skip(f"package index unreachable: {e}")
  return root / "vendor" / "llama.cpp" / "models" / "templates"


@pytest.mark.parametrize("name,fmt", [("Qwen-Qwen2.5-7B-Instruct", "hermes"), ("Qwen-Qwen3-0.6B", "hermes"),
                                      ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes"),
                                      ("meta-llama-Llama-3.1-8B-Instruct", "llama3_json"), ("meta-llama-Llama-3.2-3B-Instruct", "llama3_json"),
                                      ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
                                      ("Mistral-Small-3.2-24B-Instruct-2506", "mistral"),
                                      ("microsoft-Phi-3.5-mini-instruct", None), ("google-gemma-2-2b-it", None)])
def test_real_templates_render_tools_and_their_history(real_templates, name, fmt):
  """Each family's published template: its format detected, and a turn with tools, an assistant call (OpenAI's id
  and JSON-text arguments) and its result rendered with the tool, the arguments as an object and the result; Mistral's
  gets 9-character call ids, the same in the call and in its result. Templates without tools refuse them."""
  from tinyvllm.model.tokenizer.chat_template import compile_chat_template
  from tinyvllm.tools import ToolTemplateError, prepare_chat, short_id
  source = (real_templates / f"{name}.jinja").read_text()
  history = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0123456789abcdef", "type": "function",
                                                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
             {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "sunny, 21 C"}]
  if fmt is None:
    with pytest.raises(ToolTemplateError, match="never reads"): prepare_chat(history, [WEATHER], source)
    return
  assert detect_format(source).name == fmt
  messages, extra = prepare_chat(history, [WEATHER], source)
  text = compile_chat_template(source, name).render(messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                                                   **extra)
  assert "get_weather" in text and "Weather in a city" in text and "sunny, 21 C" in text
  assert '"city": "Paris"' in text and '"{\\"city\\"' not in text   # the arguments as an object, never as a quoted string
  if fmt == "mistral": assert text.count(short_id("call_0123456789abcdef")) == 2 and len(short_id("call_0123456789abcdef")) == 9


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "meta-llama-Llama-3.1-8B-Instruct",
                                  "mistralai-Mistral-Nemo-Instruct-2407", "microsoft-Phi-3.5-mini-instruct", "google-gemma-2-2b-it"])
def test_real_templates_render_as_transformers_does(real_templates, tiny_model, name):
  """The families' chat templates through our renderer equal transformers' rendering of the same template with the
  same tokenizer (a plain conversation; Gemma's has no system role)."""
  from transformers import AutoTokenizer
  from tinyvllm.model.tokenizer import load_tokenizer
  source = (real_templates / f"{name}.jinja").read_text()
  chat = ([] if "gemma" in name else [{"role": "system", "content": "Be brief."}]) + [
    {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Ünïcödé and 3 numbers: 1, 2, 3"}]
  ours = load_tokenizer(tiny_model).apply_chat_template(chat, add_generation_prompt=True, chat_template=source)
  theirs = AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(chat, add_generation_prompt=True, chat_template=source, tokenize=False)
  assert ours == theirs


def test_pydantic_ai_default_output_type(tool_server):
  """pydantic-ai's default structured output (an output_type: a forced call of its `final_result` tool) validates
  into the type whatever the weights."""
  pai = pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed")
  from pydantic import BaseModel
  from pydantic_ai.models.openai import OpenAIChatModel
  from pydantic_ai.providers.openai import OpenAIProvider
  url, client = tool_server

  class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: Literal[1, 2, 3]

  model = OpenAIChatModel(client.models.list().data[0].id, provider=OpenAIProvider(base_url=url + "/v1", api_key="unused"))
  result = pai.Agent(model, output_type=Weather).run_sync("What is the weather in Paris?",
                                                          model_settings={"temperature": 0, "max_tokens": 120})
  assert isinstance(result.output, Weather) and result.output.city in ("Paris", "Oslo")
