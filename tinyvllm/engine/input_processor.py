"""Input processing: prompts (text, token ids, chat messages) -> validated EngineRequests.

Runs in the caller's thread, before anything is queued: a bad prompt or parameter raises here (ValueError or
TypeError naming the problem) and never reaches the engine core.
"""
from __future__ import annotations
import numbers, time
from collections.abc import Sequence as SequenceABC
from typing import Any
from tinyvllm.engine.request import EngineRequest
from tinyvllm.model.tokenizer import Tokenizer, TokenizerError
from tinyvllm.outputs import RequestMetrics
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.structured_output import GrammarCompiler


class InputProcessor:
  def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int):
    self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
    self.grammars = GrammarCompiler(tokenizer, vocab_size)

  def process(self, request_id: str, prompt, params: SamplingParams | None = None,
              arrival_time: float | None = None) -> EngineRequest:
    """Tokenize and validate one prompt: a string, a list of token ids, or {"prompt": ..., "prompt_token_ids": ...}."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams): raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    if not isinstance(request_id, str): raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
    text, ids = self.tokenize(prompt)
    self.check_prompt(ids)
    self.check_params(params)
    # compiled here, in the caller's thread: an invalid schema, regex or grammar is refused before anything is queued
    grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs is not None else None
    metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time, num_prompt_tokens=len(ids))
    return EngineRequest(request_id, text, ids, params, metrics, grammar)

  def tokenize(self, prompt) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str): return prompt, self.tokenizer.encode(prompt)
    if isinstance(prompt, dict):
      if "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str): raise TypeError(f"prompt text must be a string, got {type(text).__name__}")
        return text, token_ids(prompt["prompt_token_ids"])
      if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str): raise TypeError(f"prompt text must be a string, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
      raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, SequenceABC) and not isinstance(prompt, (bytes, bytearray)): return None, token_ids(prompt)
    raise TypeError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

  def check_prompt(self, ids: list[int]) -> None:
    if not ids: raise ValueError("the prompt is empty: it has no tokens")
    bad = [t for t in ids if not 0 <= t < self.vocab_size]
    if bad: raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
    if len(ids) >= self.max_model_len:
      raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                       f"it must be shorter to leave room for at least one generated token")

  def check_params(self, params: SamplingParams) -> None:
    """What only the model can tell: token ids in the parameters must be in its vocabulary."""
    for name, ids in (("stop_token_ids", params.stop_token_ids or ()), ("logit_bias", params.logit_bias or ())):
      bad = [t for t in ids if t >= self.vocab_size]
      if bad: raise ValueError(f"SamplingParams.{name}: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

  def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, continue_final_message: bool = False,
                  chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None) -> dict:
    """Apply the chat template. Returns {"prompt", "prompt_token_ids"}: the template writes the special tokens, so
    the text is encoded without adding BOS again. `continue_final_message` leaves the last (assistant) message
    open for the model to continue instead of starting a new turn."""
    messages = check_messages(messages)
    if continue_final_message and add_generation_prompt:
      raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    if continue_final_message and not messages[-1]["content"]:
      raise ValueError("continue_final_message needs a final message with content to continue")
    try:
      text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                chat_template=chat_template, **(template_kwargs or {}))
    except TokenizerError as e: raise ValueError(str(e)) from None
    if continue_final_message:   # cut after the final message's content, dropping the template's end of turn
      final = messages[-1]["content"]
      at = text.rfind(final)
      if at < 0: raise ValueError("continue_final_message: the chat template does not write the final message's content as given")
      text = text[:at + len(final)]
    return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}


def token_ids(ids) -> list[int]:
  """A list of token ids, checked: integers only (a float such as 1.7 is refused, not truncated)."""
  if isinstance(ids, (str, bytes)) or not (isinstance(ids, SequenceABC) or hasattr(ids, "tolist")):
    raise TypeError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
  ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
  bad = next((t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
  if bad is not None: raise TypeError(f"prompt token ids must be integers, got {bad!r}")
  return [int(t) for t in ids]


def check_messages(messages) -> list[dict]:
  """Chat messages: a list of {"role": str, "content": str or a list of text parts}. Text parts are joined, so
  templates see plain strings; anything else (images, audio) is refused by name."""
  if not isinstance(messages, list) or not messages: raise ValueError("messages must be a non-empty list of {role, content} dicts")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise ValueError(f"messages[{i}] must be a dict with a string 'role'")
    content = m.get("content")
    if isinstance(content, list):
      parts = []
      for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
          raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported, got type {kind!r}")
        parts.append(part["text"])
      content = "\n".join(parts)
    elif content is None: content = ""
    elif not isinstance(content, str):
      raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}")
    out.append({**m, "content": content})
  return out
