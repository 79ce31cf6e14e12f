"""The JSON files beside an HF tokenizer (tokenizer_config.json, special_tokens_map.json, generation_config.json,
chat_template.jinja/.json): special-token texts, add_bos/add_eos, extra EOS ids and the chat template. Both HF
kinds (tokenizer.json and SentencePiece's tokenizer.model) read them the same way."""
from __future__ import annotations
import json
from pathlib import Path
from typing import Any

from tinyvllm.model.tokenizer.errors import TokenizerError


def read_json(path: Path) -> dict:
  if not path.is_file(): return {}
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise TokenizerError(f"{path}: cannot read: {e}") from None
  if not isinstance(data, dict): raise TokenizerError(f"{path}: expected a JSON object")
  return data


def _content(token: Any) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
  return token.get("content") if isinstance(token, dict) else token if isinstance(token, str) else None


def read_hf_meta(d: Path) -> dict[str, Any]:
  """What the JSON files beside an HF tokenizer say: special-token texts, add_bos, EOS ids, chat template."""
  config = read_json(d / "tokenizer_config.json")
  special_map = read_json(d / "special_tokens_map.json")
  generation = read_json(d / "generation_config.json")
  template = config.get("chat_template")
  if (d / "chat_template.json").is_file(): template = read_json(d / "chat_template.json").get("chat_template", template)
  if (d / "chat_template.jinja").is_file(): template = (d / "chat_template.jinja").read_text(encoding="utf-8")
  if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default", next(iter(named.values()), None))
  gen_eos = generation.get("eos_token_id")
  return {
    "bos": _content(config.get("bos_token")) or _content(special_map.get("bos_token")),
    "eos": _content(config.get("eos_token")) or _content(special_map.get("eos_token")),
    "add_bos": config.get("add_bos_token"), "add_eos": bool(config.get("add_eos_token", False)),
    "added": {int(k): v for k, v in (config.get("added_tokens_decoder") or {}).items()},
    "eos_ids": [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or []),
    "chat_template": template if isinstance(template, str) else None,
  }
