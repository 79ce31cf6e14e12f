"""Tokenizers: GGUF-embedded vocabularies, HF `tokenizer.json`, SentencePiece `tokenizer.model`; chat templates;
incremental detokenization. One module per kind, all building the one `Tokenizer` class of `base`:

  base           Tokenizer (encode/decode, the byte table, special ids), split_special, end-of-turn tokens
  hf, spm, gguf  the loaders: HF tokenizer.json, SentencePiece tokenizer.model, GGUF (SPM-style and byte-level BPE)
  hf_config      the JSON files beside an HF tokenizer
  byte_level     GPT-2's byte alphabet
  chat_template  jinja2 as HF transformers renders chat templates
  detokenizer    IncrementalDetokenizer (streaming text)
  loader         load_tokenizer: which kind a path holds

    tok = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    det = tok.detokenizer()
    text = "".join(det.add(t) for t in generated_ids) + det.flush()
"""
from tinyvllm.model.tokenizer.base import END_OF_TURN_TOKENS, Tokenizer, split_special
from tinyvllm.model.tokenizer.byte_level import byte_level_decoder, decode_byte_level
from tinyvllm.model.tokenizer.chat_template import compile_chat_template
from tinyvllm.model.tokenizer.detokenizer import IncrementalDetokenizer
from tinyvllm.model.tokenizer.errors import TokenizerError
from tinyvllm.model.tokenizer.loader import load_tokenizer

__all__ = ["END_OF_TURN_TOKENS", "IncrementalDetokenizer", "Tokenizer", "TokenizerError", "byte_level_decoder",
           "compile_chat_template", "decode_byte_level", "load_tokenizer", "split_special"]
