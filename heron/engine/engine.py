"""The engine: ``step()`` = schedule, run the model, sample, append tokens, retire finished requests."""

from __future__ import annotations

import logging
import time

import torch

from heron.config import EngineConfig
from heron.engine.block_manager import BlockManager
from heron.engine.detokenizer import Detokenizer, find_stop_string, visible_text
from heron.engine.memory import kv_cache_budget, num_kv_blocks, resolve_device, resolve_dtype
from heron.engine.model_runner import ModelRunner, RunItem
from heron.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from heron.engine.scheduler import Scheduler
from heron.engine.sequence import Request, SeqStatus, Sequence
from heron.errors import ConfigError, EngineOverloadedError, InvalidRequestError, PromptTooLongError
from heron.model.loader import load_model
from heron.sampling.sampler import Sampler, SamplingRow, gather_logprobs
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Engine:
    """Synchronous engine over one model. Not thread-safe: drive it from one thread (see AsyncEngine)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config.model, self.dtype, self.device, config.max_model_len, config.tokenizer,
                            config.chat_template)
        self.hf_config = loaded.hf_config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.model_name = config.served_model_name or config.model
        self.vocab_size = self.hf_config.vocab_size
        self.max_model_len = self._max_model_len(config)
        self.runner = ModelRunner(loaded.model, config.block_size, self.device)
        self.block_manager = BlockManager(self._num_blocks(), config.block_size, config.enable_prefix_caching)
        self.runner.allocate_kv_cache(self.block_manager.num_blocks, self.dtype)
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._structured = None
        self.counters = EngineStats()
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB), max_model_len %d",
                    self.block_manager.num_blocks, config.block_size,
                    self.block_manager.num_blocks * config.block_size,
                    self.runner.kv_cache.numel() * self.runner.kv_cache.element_size() / 2**20, self.max_model_len)

    def _max_model_len(self, config: EngineConfig) -> int:
        model_max = getattr(self.hf_config, "max_position_embeddings", None) or 4096
        if config.max_model_len is None:
            return model_max
        if config.max_model_len > model_max:
            raise ConfigError(f"--max-model-len {config.max_model_len} exceeds the model's maximum of {model_max}")
        return config.max_model_len

    def _num_blocks(self) -> int:
        per_block = self.runner.bytes_per_block(self.dtype)
        peak = self._profile_activations() if self.device.type == "cuda" else 0
        budget = kv_cache_budget(self.config, self.device, peak)
        return num_kv_blocks(self.config, budget, per_block, self.max_model_len)

    def _profile_activations(self) -> int:
        """Peak activation memory of the largest step, measured with a throwaway KV pool (CUDA)."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-tokens // self.config.block_size)
        self.runner.allocate_kv_cache(blocks, self.dtype)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        dummy = Request("profile", None, [0] * tokens, SamplingParams(max_tokens=1), 0, RequestMetrics(0.0))
        seq = Sequence(dummy, 0, dummy.prompt_token_ids, None)
        seq.block_table = list(range(blocks))
        self.runner.execute([RunItem(seq, tokens, 1)])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        self.runner.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    # ---- requests -----------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages with the model's (or ``--chat-template``'s) template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; pass --chat-template or use completions")
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request; raises InvalidRequestError/PromptTooLongError before queueing."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests are waiting; retry later")
        token_ids = self.encode(prompt)
        self._validate(token_ids, params)
        grammars = [self._compile_grammar(params) for _ in range(params.n)]
        req = Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, priority,
                      RequestMetrics(arrival_time or time.time()))
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        seq = Sequence(req, 0, token_ids, self._generator(params, 0), grammars[0])
        req.seqs.append(seq)
        req.pending_grammars = grammars[1:]
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(f"This model's maximum context length is {self.max_model_len} tokens, but "
                                     f"the prompt has {n} tokens (at least one must be left for the output)",
                                     param="prompt")
        if self.block_manager.blocks_needed(n + 1) > self.block_manager.num_blocks:
            raise PromptTooLongError(f"the prompt has {n} tokens but the KV cache holds only "
                                     f"{self.block_manager.num_blocks * self.config.block_size}", param="prompt")
        if params.best_of > params.n:
            raise InvalidRequestError("best_of > n is not supported", param="best_of")
        params.update_from_tokenizer(self.tokenizer)
        params.verify_token_ids(self.vocab_size)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(params.seed + index)

    def _compile_grammar(self, params: SamplingParams):
        if params.guided_decoding is None:
            return None
        if self._structured is None:
            from heron.sampling.structured import StructuredOutputCompiler

            self._structured = StructuredOutputCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._structured.compile(params.guided_decoding)

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks now; its final output comes with the next step."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if seq.status != SeqStatus.FINISHED:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        req.metrics.finished_time = time.time()
        self._count_finished(req)
        self._aborted.append(self._output(req, finished=True))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # ---- the step -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of every request that progressed or ended."""
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs
        self.counters.max_running_seen = max(self.counters.max_running_seen, len(self.scheduler.running))
        self.runner.copy_blocks(sched.block_copies)
        items = [RunItem(s.seq, s.num_new_tokens, self._num_logits(s.seq, s.num_new_tokens))
                 for s in sched.scheduled]
        logits = self.runner.execute(items)
        now = time.time()
        rows, seqs, touched = [], [], {}
        offset = 0
        for item in items:
            seq, req = item.seq, item.seq.request
            touched[req.request_id] = req
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.counters.prompt_tokens += min(item.num_new_tokens,
                                                   seq.num_prompt_tokens - seq.num_computed_tokens)
            if req.prompt_logprobs is not None and seq.index == 0 and not seq.is_prefill_done:
                self._add_prompt_logprobs(seq, logits[offset:offset + item.num_logits])
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens == len(seq):
                for s in [seq, *self._fork_children(seq)]:
                    rows.append(offset + item.num_logits - 1)
                    seqs.append(s)
            offset += item.num_logits
        self._sample_and_append(logits, rows, seqs, now)
        for req in touched.values():
            outputs.append(self._output(req, finished=req.finished))
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _num_logits(self, seq: Sequence, num_new: int) -> int:
        if seq.request.prompt_logprobs is not None and seq.index == 0 and not seq.is_prefill_done:
            return num_new
        return 1 if seq.num_computed_tokens + num_new == len(seq) else 0

    def _add_prompt_logprobs(self, seq: Sequence, chunk_logits: torch.Tensor) -> None:
        """Logits at position p score prompt token p+1; add those not scored before (recompute repeats them)."""
        plp = seq.request.prompt_logprobs
        first = len(plp) - 1 - seq.num_computed_tokens  # chunk row scoring the next unscored prompt token
        last = min(chunk_logits.shape[0], seq.num_prompt_tokens - 1 - seq.num_computed_tokens)
        if first < 0 or last <= first:
            return
        targets = seq.token_ids[len(plp):len(plp) + last - first]
        plp.extend(gather_logprobs(chunk_logits[first:last], torch.tensor(targets, device=chunk_logits.device),
                                   seq.params.prompt_logprobs))

    def _fork_children(self, seq: Sequence) -> list[Sequence]:
        """At the end of the prompt, a request with n > 1 forks its other samples, sharing the prompt blocks."""
        req = seq.request
        if len(req.seqs) >= req.params.n or seq.num_output_tokens:
            return []
        children = []
        for i, grammar in enumerate(req.pending_grammars, start=1):
            child = seq.fork(i, self._generator(req.params, i), grammar)
            self.block_manager.fork(seq, child)
            self.scheduler.add_running(child)
            req.seqs.append(child)
            children.append(child)
        return children

    def _sample_and_append(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence], now: float) -> None:
        if not rows:
            return
        sampling_rows = [SamplingRow(s.params, s.request.prompt_token_ids, s.output_token_ids, s.generator,
                                     s.grammar) for s in seqs]
        result = self.sampler(logits[rows], sampling_rows)
        for seq, token, lp in zip(seqs, result.token_ids, result.logprobs, strict=True):
            self._append_token(seq, token, lp, now)

    def _append_token(self, seq: Sequence, token: int, lp, now: float) -> None:
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp.logprob
        if seq.grammar is not None:
            seq.grammar.accept_token(token)
        metrics = seq.request.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        self.counters.generation_tokens += 1
        new_text = self.detokenizer.append(seq, token)
        self._check_stop(seq, token, new_text)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            if seq.request.finished:
                metrics.finished_time = now
                self._count_finished(seq.request)

    def _check_stop(self, seq: Sequence, token: int, new_text: str) -> None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                return self._finish(seq, "stop", None)
            if token in p.stop_token_ids:
                if not p.include_stop_str_in_output and new_text:
                    seq.detok.text = seq.detok.text[: len(seq.detok.text) - len(new_text)]
                return self._finish(seq, "stop", token)
            found = find_stop_string(seq.detok.text, len(new_text), p.stop) if new_text and p.stop else None
            if found:
                stop, idx = found
                seq.detok.text = seq.detok.text[: idx + (len(stop) if p.include_stop_str_in_output else 0)]
                return self._finish(seq, "stop", stop)
        if seq.grammar is not None and seq.grammar.is_terminated():
            return self._finish(seq, "stop", None)
        if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or len(seq) >= self.max_model_len:
            self._finish(seq, "length", None)

    @staticmethod
    def _finish(seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def _count_finished(self, req: Request) -> None:
        reason = req.seqs[0].finish_reason or "abort"
        self.counters.finished_by_reason[reason] = self.counters.finished_by_reason.get(reason, 0) + 1

    def _output(self, req: Request, finished: bool) -> RequestOutput:
        want_lp = req.params.logprobs is not None
        outs = [CompletionOutput(
            index=s.index, text=visible_text(s), token_ids=s.output_token_ids,
            cumulative_logprob=s.cumulative_logprob if want_lp else None,
            logprobs=list(s.logprobs) if want_lp else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in req.seqs]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, req.metrics,
                             req.prompt_logprobs, req.num_cached_tokens)

    # ---- stats --------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of queue sizes, KV usage and the running counters."""
        c = self.counters
        c.num_running = len(self.scheduler.running)
        c.num_waiting = len(self.scheduler.waiting)
        c.kv_cache_usage = self.block_manager.usage
        c.num_blocks_total = self.block_manager.num_blocks
        c.num_blocks_free = self.block_manager.num_free_blocks
        c.prefix_cache_queries = self.block_manager.prefix_queries
        c.prefix_cache_hits = self.block_manager.prefix_hits
        c.num_preemptions = self.scheduler.num_preemptions
        return EngineStats(**{**vars(c), "finished_by_reason": dict(c.finished_by_reason)})
