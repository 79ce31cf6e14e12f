"""LLMEngine: requests in, RequestOutputs out. `step()` = schedule -> run the model -> sample and postprocess."""
from __future__ import annotations
import dataclasses, itertools, os, time
from dataclasses import dataclass
import numpy as np
from tinygrad import Device
from tinyvllm import sampler
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.model_runner import ModelRunner, WorkItem
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence
from tinyvllm.engine.spec_decode import SpeculativeDecoder
from tinyvllm.kernels import Kernels, default_dtype, resolve_backend
from tinyvllm.model.llama import Llama
from tinyvllm.model.tokenizer import load_tokenizer
from tinyvllm.model.weights import load_checkpoint
from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams


@dataclass
class Request:
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  seqs: list[Sequence]
  metrics: RequestMetrics

  @property
  def finished(self) -> bool: return all(s.is_finished for s in self.seqs)


class LLMEngine:
  def __init__(self, config: EngineConfig):
    self.config = config
    self.device = Device.DEFAULT
    ckpt = load_checkpoint(config.model, config.quantization)
    self.model_config = ckpt.config
    self.tokenizer = load_tokenizer(ckpt.path)
    dtype = default_dtype(self.device) if config.dtype == "auto" else config.dtype
    model_max = ckpt.config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > model_max:
      raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's context length {model_max}")
    max_model_len = config.max_model_len or model_max
    dtype_size = 4 if dtype == "float32" else 2
    block_bytes = ModelRunner.kv_bytes_per_block(ckpt.config, config.block_size, dtype_size)
    weight_bytes = sum(a.nbytes for a in ckpt.tensors.values())
    num_blocks = config.num_kv_blocks or self._blocks_from_memory(block_bytes, weight_bytes, max_model_len)
    capacity = num_blocks * config.block_size
    if max_model_len > capacity:
      if config.max_model_len is not None:
        raise ConfigError(f"max_model_len={max_model_len} needs {-(-max_model_len // config.block_size)} KV blocks of "
                          f"{config.block_size} tokens but the cache has num_kv_blocks={num_blocks}; "
                          f"raise num_kv_blocks or lower max_model_len")
      max_model_len = capacity   # one sequence must always fit alone, or preemption could not make progress
    self.max_model_len = max_model_len
    self.kernel_backend = resolve_backend(config.kernel_backend, self.device)
    self.kernels = Kernels(self.kernel_backend, self.device)
    model = self._build_model(ckpt.config, ckpt.tensors, dtype)
    self.runner = ModelRunner(model, num_blocks, config.block_size, max_model_len, self.device)
    self.block_manager = BlockManager(num_blocks, config.block_size, config.watermark)
    self.spec: SpeculativeDecoder | None = None
    if config.draft_model is not None:
      draft = self._load_draft(config.draft_model, ckpt, dtype)
      # as many draft blocks as target blocks: a draft table never outgrows its target table, so the draft pool
      # cannot run dry while the target's has room
      self.spec = SpeculativeDecoder(ModelRunner(draft, num_blocks, config.block_size, max_model_len, self.device),
                                     BlockManager(num_blocks, config.block_size, 0.0), config.num_speculative_tokens,
                                     always=config.speculation == "always")
    del ckpt
    self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                               lookahead_tokens=config.num_speculative_tokens if self.spec else 0)
    self.requests: dict[str, Request] = {}
    self._request_counter = itertools.count()
    self._seed_stream = np.random.default_rng(config.seed)
    self.eos_token_ids = set(self.tokenizer.eos_token_ids)

  def _build_model(self, cfg, tensors, dtype: str) -> Llama:
    self.kernels.check_model(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, self.config.block_size, dtype)
    return Llama(cfg, tensors, dtype, self.device, self.kernels, self.max_model_len)

  def _load_draft(self, name: str, target, dtype: str) -> Llama:
    """The draft model: any checkpoint LLM loads with the same vocabulary, or "self:N", the target's first N layers
    (with its final norm and LM head): a cheap draft that needs no second checkpoint."""
    if name.startswith("self:"):
      n = int(name[5:]) if name[5:].isdigit() else 0
      if not 0 < n < target.config.num_hidden_layers:
        raise ConfigError(f"draft_model={name!r}: N must be between 1 and {target.config.num_hidden_layers - 1}")
      keep = {k: v for k, v in target.tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
      return self._build_model(dataclasses.replace(target.config, num_hidden_layers=n), keep, dtype)
    draft = load_checkpoint(name)
    draft_tok = load_tokenizer(draft.path)
    same = draft.config.vocab_size == target.config.vocab_size and draft_tok.vocab_size == self.tokenizer.vocab_size and \
      all(draft_tok.piece(i) == self.tokenizer.piece(i) for i in range(self.tokenizer.vocab_size))
    if not same:
      raise ConfigError(f"draft model {name} has a different vocabulary from the target "
                        f"({draft.config.vocab_size} vs {target.config.vocab_size} tokens or different token strings); "
                        f"speculative decoding needs the same tokenizer")
    return self._build_model(draft.config, draft.tensors, dtype)

  def _blocks_from_memory(self, block_bytes: int, weight_bytes: int, max_model_len: int) -> int:
    """A share of the memory left after the weights, but no more than max_num_seqs full-length sequences."""
    try: available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # macOS has no SC_AVPHYS_PAGES: take the physical memory minus the weights
      available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    by_memory = int(self.config.kv_cache_memory_fraction * max(0, available - weight_bytes)) // block_bytes
    by_need = self.config.max_num_seqs * -(-max_model_len // self.config.block_size)
    blocks = min(by_memory, by_need)
    if blocks < 2: raise ConfigError(f"not enough free memory for a KV cache ({available >> 20} MiB available); "
                                     f"set num_kv_blocks explicitly")
    return blocks

  # ---- requests ----

  def add_request(self, prompt: str | dict | list[int], params: SamplingParams | None = None,
                  request_id: str | None = None) -> str:
    """Queue a request. Raises ValueError (naming the problem) for a bad prompt; queued requests are unaffected."""
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams): raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    text, ids = self._tokenize(prompt)
    request_id = request_id if request_id is not None else str(next(self._request_counter))
    if request_id in self.requests: raise ValueError(f"request id {request_id!r} is already in use")
    if not ids: raise ValueError("the prompt is empty: it has no tokens")
    bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
    if bad: raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.model_config.vocab_size - 1})")
    if len(ids) >= self.max_model_len:
      raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                       f"it must be shorter to leave room for at least one generated token")
    metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(ids))
    seqs = []
    for i in range(params.n):
      seed = [params.seed, i] if params.seed is not None else self._seed_stream.integers(2**63)
      seqs.append(Sequence(request_id, i, ids, params, np.random.default_rng(seed),
                           self.tokenizer.detokenizer(ids, skip_special_tokens=params.skip_special_tokens), metrics))
    self.requests[request_id] = Request(request_id, text, ids, seqs, metrics)
    for seq in seqs: self.scheduler.add(seq)
    return request_id

  def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str): return prompt, self.tokenizer.encode(prompt)
    if isinstance(prompt, dict):
      if "prompt_token_ids" in prompt: return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
      if "prompt" in prompt: return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
      raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt): return None, [int(t) for t in prompt]
    raise TypeError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

  def abort_request(self, request_id: str) -> None:
    req = self.requests.pop(request_id, None)
    for seq in req.seqs if req else []:
      if not seq.is_finished: self._finish(seq, "abort", None)

  def has_unfinished_requests(self) -> bool: return self.scheduler.has_unfinished()

  # ---- the loop ----

  def step(self) -> list[RequestOutput]:
    """One target forward pass over the scheduled batch (with speculation: preceded by the draft's passes).
    Returns the outputs of the requests it advanced."""
    sched = self.scheduler.schedule()
    if self.spec:
      for seq in sched.preempted: self.spec.release(seq)   # a preempted sequence recomputes both caches
    if sched.is_empty:
      if self.scheduler.has_unfinished(): raise RuntimeError("scheduler made no progress with requests waiting")
      return []
    now = time.perf_counter()
    for seq in sched.decodes + [c.seq for c in sched.prefills]:
      if seq.metrics.first_scheduled_time is None: seq.metrics.first_scheduled_time = time.time()
    decodes, speculated, proposals = sched.decodes, [], []
    if self.spec and decodes and self.spec.policy.should_speculate(len(decodes)):
      proposals = self.spec.propose(decodes, self._penalized) or []
      if proposals: decodes, speculated = [], decodes
    decode_logits, prefill_logits, verify_logits = self.runner.execute(
      [WorkItem(s.block_table, s.num_computed_tokens, s.token_ids[-1:]) for s in decodes],
      [WorkItem(c.seq.block_table, c.seq.num_computed_tokens, c.seq.token_ids[c.seq.num_computed_tokens:][:c.num_tokens])
       for c in sched.prefills],
      [WorkItem(s.block_table, s.num_computed_tokens, s.token_ids[-1:] + p.drafts) for s, p in zip(speculated, proposals)])
    touched = {}
    for seq, logits in zip(decodes, decode_logits):
      seq.num_computed_tokens += 1
      seq.metrics.num_target_steps += 1
      self._append_token(seq, logits)
      touched[seq.request_id] = None
    for chunk, logits in zip(sched.prefills, prefill_logits):
      complete = chunk.completes_prompt
      chunk.seq.num_computed_tokens += chunk.num_tokens
      if complete:
        chunk.seq.metrics.num_target_steps += 1
        self._append_token(chunk.seq, logits)
      touched[chunk.seq.request_id] = None
    accepted = 0
    for seq, proposal, logits in zip(speculated, proposals, verify_logits):
      accepted += self._accept(seq, proposal, logits)
      touched[seq.request_id] = None
    if self.spec and sched.decodes and not sched.prefills:   # a step that also prefilled says nothing about either cost
      seconds = time.perf_counter() - now
      if speculated: self.spec.policy.record_spec(len(speculated), len(speculated) * self.spec.k, accepted, seconds)
      else: self.spec.policy.record_plain(len(decodes), seconds)
    return [self._output(self.requests[rid]) for rid in touched if rid in self.requests]

  def _penalized(self, seq: Sequence, logits: np.ndarray, extra: list[int] = ()) -> np.ndarray:
    """Logits after penalties, as if `extra` tokens had already been appended to seq."""
    p = seq.params
    banned = sorted(self.eos_token_ids | set(p.stop_token_ids or [])) if seq.num_output_tokens + len(extra) < p.min_tokens else None
    return sampler.apply_penalties(logits, seq.token_ids + list(extra), seq.num_prompt_tokens, p, banned)

  def _append_token(self, seq: Sequence, logits: np.ndarray) -> None:
    self._record(seq, sampler.sample(self._penalized(seq, logits), seq.params, seq.generator), logits)

  def _accept(self, seq: Sequence, proposal, logits: np.ndarray) -> int:
    """Verify one speculated run: logits `[k+1, V]` are the target's at the last token and at each draft.
    Appends the accepted drafts and one more token, stops at any stop rule, rolls both caches back to the
    tokens that stand. Returns the number of drafts accepted."""
    drafts, k, start = proposal.drafts, len(proposal.drafts), seq.num_computed_tokens
    processed = [self._penalized(seq, logits[i], drafts[:i]) for i in range(k + 1)]
    if seq.params.greedy:
      tokens = sampler.speculative_accept_greedy([int(np.argmax(x)) for x in processed], drafts)
    else:
      p = np.stack([sampler.probabilities(x, seq.params) for x in processed])
      tokens = sampler.speculative_accept(p, proposal.q, drafts, seq.generator)
    m = seq.metrics
    m.num_draft_tokens, m.num_accepted_tokens, m.num_target_steps = m.num_draft_tokens + k, m.num_accepted_tokens + len(tokens) - 1, m.num_target_steps + 1
    recorded = 0
    for i, token in enumerate(tokens):
      self._record(seq, token, logits[i])
      recorded += 1
      if seq.is_finished: break
    if not seq.is_finished:
      # K/V stand for the last token and the drafts that were kept; the newest token has none yet
      seq.num_computed_tokens = start + recorded
      self.block_manager.truncate(seq.block_table, seq.num_computed_tokens)
      self.spec.rollback(seq, seq.num_computed_tokens)
    return len(tokens) - 1

  def _record(self, seq: Sequence, token: int, logits: np.ndarray | None) -> None:
    """Append a sampled token and apply every stop rule. Shared with speculative decoding."""
    p, m = seq.params, seq.metrics
    if seq.logprobs is not None and logits is not None:
      lp = sampler.log_softmax(logits)
      seq.logprobs.append({t: Logprob(v, r, self.tokenizer.token_to_str(t)) for t, v, r in sampler.top_logprobs(lp, token, p.logprobs)})
      seq.cumulative_logprob += float(lp[token])
    seq.token_ids.append(token)
    if m.first_token_time is None: m.first_token_time = time.time()
    m.num_generated_tokens += 1
    delta = seq.detokenizer.add(token)
    seq.text += delta
    if token in self.eos_token_ids and not p.ignore_eos:
      return self._finish(seq, "stop", None)
    if p.stop_token_ids and token in p.stop_token_ids: return self._finish(seq, "stop", token)
    if p.stop_strings and self._hit_stop_string(seq, len(delta)): return
    if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens: return self._finish(seq, "length", None)
    if seq.num_tokens >= self.max_model_len: return self._finish(seq, "length", None)

  def _hit_stop_string(self, seq: Sequence, new_chars: int) -> bool:
    for stop in seq.params.stop_strings:   # only a match that overlaps the new text can be new
      at = seq.text.find(stop, max(0, len(seq.text) - new_chars - len(stop) + 1))
      if at >= 0:
        seq.text = seq.text[:at + (len(stop) if seq.params.include_stop_str_in_output else 0)]
        self._finish(seq, "stop", stop)
        return True
    return False

  def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
    if reason != "stop" or not isinstance(stop_reason, str): seq.text += seq.detokenizer.flush()
    self.scheduler.finish(seq, reason, stop_reason)
    if self.spec: self.spec.release(seq)
    seq.metrics.finished_time = time.time()

  def _output(self, req: Request) -> RequestOutput:
    outs = [CompletionOutput(s.index, self._visible_text(s), s.output_token_ids, s.cumulative_logprob if s.logprobs is not None else None,
                             s.logprobs, s.finish_reason, s.stop_reason) for s in req.seqs]
    if req.finished: self.requests.pop(req.request_id, None)
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished, req.metrics)

  @staticmethod
  def _visible_text(seq: Sequence) -> str:
    """While running, hold back a tail that could still turn into a stop string, so streams never show it."""
    if seq.is_finished or not seq.params.stop_strings: return seq.text
    hold = 0
    for stop in seq.params.stop_strings:
      for k in range(min(len(stop) - 1, len(seq.text)), 0, -1):
        if seq.text.endswith(stop[:k]): hold = max(hold, k); break
    return seq.text[:len(seq.text) - hold]
