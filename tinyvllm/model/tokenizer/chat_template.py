"""Chat templates, rendered with jinja2 the way HF transformers renders them."""
from __future__ import annotations
import datetime, json

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tinyvllm.model.tokenizer.errors import TokenizerError


def compile_chat_template(source: str, name: str = "model") -> jinja2.Template:
  """Compile a chat template in the environment HF transformers uses: sandboxed, trim_blocks, lstrip_blocks,
  loop controls, `raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII text as is."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

  def raise_exception(message: str):
    raise TokenizerError(f"chat template of {name}: {message}")

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  def strftime_now(fmt: str) -> str: return datetime.datetime.now().strftime(fmt)

  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
  try:
    return env.from_string(source)
  except jinja2.TemplateError as e:
    raise TokenizerError(f"chat template of {name} does not compile: {e}") from None
