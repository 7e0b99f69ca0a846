"""The engine core: schedule, run the model, sample, append tokens, report deltas. Token ids only.

``EngineCore.step()`` never touches text or HTTP: the front end (``engine/processor.py``,
``engine/output_processor.py``) tokenizes, detokenizes and checks stop strings. A step can append several
tokens to a sequence (speculative decoding, ``heron/spec_decode``): with draft tokens attached (``Proposer``),
its k+1 verification rows are scored in the same forward as everything else; drafts without a draft
distribution are accepted while the target's own samples equal them (exact for greedy and for one-hot drafts
such as n-gram's), drafts sampled from a draft model's q by rejection sampling. Accepted tokens are checked for
stops one by one, and the KV slots of rejected drafts are rolled back. ``SpeculationPolicy`` picks each step's
number of drafts from measured step times.

A failure that belongs to one request (its sampling row, grammar or stop checks) ends that request with
``finish_reason="error"``; only a failure of the forward pass itself takes the core down.

A pooling engine (``runner="pooling"``) schedules its requests the same way but never samples them: each prompt
chunk's final hidden states are folded into the request's vector (``engine/pooling.py``), and the request ends,
freeing its blocks, when its prompt is computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from heron.attention.backend import get_attention_backend
from heron.config import EngineConfig
from heron.distributed.executor import make_executor
from heron.engine.block_manager import BlockManager
from heron.engine.grammar_queue import GrammarQueue
from heron.engine.memory import check_kv_capacity, kv_cache_budget, num_kv_blocks, resolve_dtype
from heron.engine.messages import CoreInfo, EngineCoreOutput, EngineCoreRequest, RequestRejection
from heron.engine.outputs import EngineStats
from heron.engine.pooling import PoolingState
from heron.engine.request import Request, SeqStatus, Sequence
from heron.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from heron.errors import ConfigError, EngineOverloadedError, InvalidRequestError, PromptTooLongError
from heron.quantization.kv import resolve_kv_cache_dtype
from heron.quantization.summary import describe_weights
from heron.sampling.sampler import Sampler, SamplingRow, TokenLogprobs, gather_logprobs
from heron.sampling_params import SamplingParams
from heron.spec_decode.build import load_draft, make_proposer
from heron.spec_decode.draft import Draft
from heron.spec_decode.policy import SpeculationPolicy
from heron.spec_decode.rejection_sampler import rejection_sample
from heron.worker.worker import load_runner, rank_device

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_SLICE = 256  # prompt positions turned into logits at once: bounds memory to slice x vocab
CALIBRATION_MAX_TOKENS = 512  # largest step timed at start for the speculation cost model


class Proposer(Protocol):
    """Proposes draft tokens for running sequences after each step (speculative decoding)."""

    def propose(self, seqs: list[Sequence], limits: list[int]) -> dict[int, list[int] | Draft]:
        """At most ``limits[i]`` draft tokens for ``seqs[i]``, by sequence id (sequences left out get none)."""


class SchedulerStalledError(RuntimeError):
    """Work was pending but the scheduler planned nothing: a bug, reported instead of spinning."""


class EngineCore:
    """Owns the model, the KV pool, the scheduler and the sampler of one engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.executor = None
        if config.tensor_parallel_size > 1:  # ranks 1..N-1 start and join before anything loads
            self.executor = make_executor(config, torch.get_num_threads())
        try:
            if self.executor:
                self.executor.start()
            self._build(config)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig) -> None:
        self.device = rank_device(config, 0)
        self.dtype = resolve_dtype(config.dtype, self.device)
        backend = get_attention_backend(config.attention_backend, self.device)
        # an fp8 pool the backend cannot read is refused before the weights load
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, backend)
        loaded, self.runner, self.max_model_len = load_runner(config, self.device, self.dtype, backend)
        if self.executor:
            self.executor.wait_until_loaded()
            self.runner.peers = self.executor
        self.hf_config = loaded.hf_config
        self.tokenizer = loaded.tokenizer  # only for compiling grammars against the vocabulary
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = self.hf_config.vocab_size
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(f"--max-num-batched-tokens ({config.max_num_batched_tokens}) is smaller than "
                              f"--max-model-len ({self.max_model_len}) without chunked prefill: a long prompt "
                              "could never be scheduled; raise it, lower --max-model-len or enable chunked prefill")
        spec = config.speculative
        self.draft = spec and load_draft(spec, self.runner, config.model, self.vocab_size, self.dtype,
                                         self.max_model_len, config.max_num_seqs, config.max_num_batched_tokens)
        self.policy = spec and SpeculationPolicy(spec.num_speculative_tokens, spec.disable_by_batch_size,
                                                 spec.min_acceptance_rate)
        if self.policy:
            self._calibrate(self.policy)
        num_blocks = self._num_blocks()
        check_kv_capacity(num_blocks, config.block_size, self.max_model_len, self._bytes_per_block(), self.kv_dtype)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner.allocate_kv_cache(num_blocks, self.kv_dtype, config.calculate_kv_scales)
        if self.draft and not self.draft.shares_target_kv:
            self.draft.runner.allocate_kv_cache(num_blocks, self.kv_dtype, config.calculate_kv_scales)
            # the draft's blocks have the target's ids: every copy-on-write copies both pools
            self.runner.kv_caches.extend(self.draft.runner.kv_caches)
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids)
        self.proposer: Proposer | None = spec and make_proposer(spec, self.draft, self.runner, self.sampler,
                                                                self.block_manager)
        self.pooler_config = config.pooler
        self.requests: dict[str, Request] = {}
        self.grammars = GrammarQueue(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.counters = EngineStats()
        self.info = CoreInfo(config.served_model_name or config.model, self.max_model_len, self.vocab_size,
                             sorted(self.eos_token_ids), num_blocks, config.block_size)
        logger.info("%s; KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB), max_model_len %d; KV %s, %d-byte "
                    "elements; %s, %s attention", describe_weights(loaded.model), num_blocks, config.block_size,
                    num_blocks * config.block_size, self.runner.kv_cache_bytes / 2**20, self.max_model_len, str(self.kv_dtype).removeprefix("torch."),
                    self.kv_dtype.itemsize, str(self.dtype).removeprefix("torch."), self.runner.backend.name)
        if spec:
            logger.info("speculative decoding: %s, up to %d tokens per step, %s; %s",
                        self.draft.description if self.draft else
                        f"n-gram prompt lookup (n = {spec.prompt_lookup_min}..{spec.prompt_lookup_max})",
                        spec.num_speculative_tokens,
                        f"{spec.rejection_sample_method} rejection sampling" if self.draft
                        else "drafts accepted while they equal the target's samples",
                        f"off from {spec.disable_by_batch_size} running sequences" if spec.disable_by_batch_size
                        else "adaptive (cost model from measured step times)")

    def _bytes_per_block(self) -> int:
        """Bytes of one block in every pool: the target's, and a draft model's of the same block ids."""
        draft = self.draft.runner.bytes_per_block(self.kv_dtype) if self.draft and not self.draft.shares_target_kv else 0
        return self.runner.bytes_per_block(self.kv_dtype) + draft

    def _num_blocks(self) -> int:
        per_block = self._bytes_per_block()
        peak = self._profile_activations() if self.device.type == "cuda" else 0
        budget = kv_cache_budget(self.config, self.device, peak)
        return num_kv_blocks(self.config, budget, per_block, self.max_model_len)

    def _profile_activations(self) -> int:
        """Peak activation memory of the largest step, measured with a throwaway KV pool (CUDA)."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-tokens // self.config.block_size)
        self.runner.allocate_kv_cache(blocks, self.kv_dtype)  # no scales from the probe's dummy tokens
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        probe = ScheduledSeq(-1, [0] * tokens, 0, 1, list(range(blocks)), True, num_prompt_rows=tokens)
        self.runner.execute(SchedulerOutput(seqs=[probe]))
        self.runner.execute(SchedulerOutput(freed_seq_ids=[-1]))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        self.runner.free_kv_cache()
        torch.cuda.empty_cache()
        return peak

    def _calibrate(self, policy: SpeculationPolicy) -> None:
        """Time steps of 1, 2, 4, ... tokens (logits for every one, as a verification step has) in a throwaway
        pool, so the speculation cost model knows what a bigger step costs before it ever takes one."""
        sizes = [2**i for i in range(CALIBRATION_MAX_TOKENS.bit_length())
                 if 2**i <= min(CALIBRATION_MAX_TOKENS, self.config.max_num_batched_tokens, self.max_model_len)]
        blocks = -(-sizes[-1] // self.config.block_size)
        self.runner.allocate_kv_cache(blocks, self.kv_dtype)
        for n in [1, *sizes]:  # the first step warms up
            probe = ScheduledSeq(-1, [0] * n, 0, n, list(range(blocks)), True)
            start = time.perf_counter()
            self.runner.compute_logits(self.runner.execute(SchedulerOutput(seqs=[probe])))
            policy.observe_step(n, time.perf_counter() - start)
        self.runner.execute(SchedulerOutput(freed_seq_ids=[-1]))
        self.runner.free_kv_cache()

    # ---- requests -----------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest, wait_for_grammar: bool = False) -> bool:
        """Queue a tokenized request; raises InvalidRequestError (nothing queued) if it cannot run. One whose
        grammar is not compiled yet waits for it off the step loop and False is returned: ``admit_compiled``
        admits or rejects it later (unless ``wait_for_grammar``: then the compile is awaited here)."""
        token_ids = request.prompt_token_ids
        if request.request_id in self.requests or request.request_id in self.grammars:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        num_waiting = len(self.scheduler.waiting) + len(self.grammars)
        if num_waiting >= self.config.max_waiting_requests:
            raise EngineOverloadedError(f"{num_waiting} requests are waiting; retry later")
        params = self._sampling_params(request)
        self._validate(token_ids, params, pooling=request.pooling_params is not None)
        req = Request(request.request_id, list(token_ids), params, request.priority,
                      request.arrival_time or time.time())
        if request.pooling_params is not None:
            req.pooling = PoolingState.of(request.pooling_params, self.pooler_config, len(token_ids))
        if params.guided_decoding is None:
            self._queue(req, None)
            return True
        compiled = self.grammars.compile(params.guided_decoding)
        if not (wait_for_grammar or compiled.done()):
            self.grammars.park(req, compiled)
            return False
        self._queue(req, compiled.result())
        return True

    def admit_compiled(self) -> tuple[list[str], list[RequestRejection]]:
        """Queue the requests whose grammar compiled since the last call; reject those whose compile failed."""
        admitted, rejected = [], []
        for req, compiled in self.grammars.take_ready():
            try:
                self._queue(req, compiled.result())
            except Exception as e:  # noqa: BLE001 - the front end raises it to the client
                if not isinstance(e, InvalidRequestError):
                    logger.exception("compiling the grammar of request %s failed", req.request_id)
                rejected.append(RequestRejection(req.request_id, type(e).__name__, str(e),
                                                 getattr(e, "param", None)))
            else:
                admitted.append(req.request_id)
        return admitted, rejected

    def _queue(self, req: Request, compiled: xgr.CompiledGrammar | None) -> None:
        """Give each sample its own grammar state; queue the first sample (the others fork after the prompt)."""
        grammars = [None] * req.params.n
        if compiled is not None:
            from heron.sampling.structured import GrammarState  # xgrammar loads only when a grammar is used

            grammars = [GrammarState(compiled) for _ in grammars]
        seq = Sequence(req, 0, req.prompt_token_ids, self._seed(req.params, 0), grammars[0])
        req.seqs.append(seq)
        req.pending_grammars = grammars[1:]
        self.requests[req.request_id] = req
        self.scheduler.add(seq)

    def _sampling_params(self, request: EngineCoreRequest) -> SamplingParams:
        """The request's sampling parameters (a pooling request's are the neutral defaults); refuses a request
        of the kind this engine does not run."""
        pooling = request.pooling_params is not None
        if pooling and self.config.runner != "pooling":
            raise InvalidRequestError("this engine generates text; pooling (embeddings) needs an engine started "
                                      "with runner='pooling' (heron serve --runner pooling)")
        if not pooling and self.config.runner == "pooling":
            raise InvalidRequestError("this engine was started with runner='pooling' (--runner pooling): it "
                                      "pools prompts into vectors and cannot generate text")
        if not pooling and request.sampling_params is None:
            raise InvalidRequestError("a request needs sampling_params or pooling_params")
        return SamplingParams() if pooling else request.sampling_params

    def _validate(self, token_ids: list[int], params, pooling: bool = False) -> None:
        param = "input" if pooling else "prompt"  # the name the pooling endpoints give it
        if not token_ids:
            raise InvalidRequestError(f"the {param} is empty", param=param)
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise InvalidRequestError(f"{param} token ids must be in [0, {self.vocab_size})", param=param)
        output_room = 0 if pooling else 1  # a generated sequence needs a position for its first output token
        if len(token_ids) + output_room > self.max_model_len:
            why = " (at least one must be left for the output)" if output_room else ""
            raise PromptTooLongError(f"This model's maximum context length is {self.max_model_len} tokens, but "
                                     f"the {param} has {len(token_ids)} tokens{why}", param=param)
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n must be at most --max-num-seqs ({self.config.max_num_seqs}), "
                                      f"got {params.n}", param="n")
        if params.best_of > params.n:
            raise InvalidRequestError("best_of > n is not supported", param="best_of")
        if params.bad_words and params.bad_words_token_ids is None:  # the front end tokenizes them, not the core
            raise InvalidRequestError("bad_words reached the engine core untokenized", param="bad_words")
        params.verify_token_ids(self.vocab_size)

    @staticmethod
    def _seed(params, index: int) -> int | None:
        """Sample ``index``'s seed: the request's seed + index (vLLM's), wrapped as a seed only names a stream."""
        return None if params.seed is None else (params.seed + index) % 2**64

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stop requests wherever they are and free their blocks now; the front end already knows."""
        for request_id in request_ids:
            req = self.requests.pop(request_id, None)
            if req is None:
                self.grammars.remove(request_id)
                continue
            for seq in req.seqs:
                if seq.status != SeqStatus.FINISHED:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
            self._count_finished(req)

    def stop_samples(self, samples: Iterable[tuple[str, int]]) -> None:
        """End samples that the front end stopped (a stop string), freeing their blocks; no output follows."""
        for request_id, index in samples:
            req = self.requests.get(request_id)
            if req is None or index >= len(req.seqs) or req.seqs[index].status == SeqStatus.FINISHED:
                continue
            seq = req.seqs[index]
            seq.finish_reason, seq.stop_reason = "stop", None
            self.scheduler.finish(seq)
            if req.finished:
                self._count_finished(req)
                del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        """Whether any request is in the core, those waiting for their grammar included."""
        return bool(self.requests) or len(self.grammars) > 0

    def has_work_to_step(self) -> bool:
        """Whether ``step()`` has requests to run (those waiting for their grammar are not yet scheduled)."""
        return bool(self.requests)

    def wait_handles(self) -> list:
        """What becomes readable when a grammar finishes compiling or a tensor-parallel rank dies: a loop idle on
        its commands waits on these too."""
        return self.grammars.handles + (self.executor.wait_handles if self.executor else [])

    def check_health(self) -> None:
        """Raise ``WorkerDiedError`` if a tensor-parallel rank has died (the engine cannot step without it)."""
        if self.executor:
            self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (a single-process core holds nothing to release)."""
        if self.executor:
            self.executor.shutdown()

    # ---- the step -----------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step; returns the deltas of every sample that progressed or ended."""
        start = time.perf_counter()
        sched, seqs = self.scheduler.schedule()
        if not sched.seqs:
            if self.scheduler.has_unfinished():
                raise SchedulerStalledError(f"nothing scheduled with {len(self.scheduler.running)} running and "
                                            f"{len(self.scheduler.waiting)} waiting sequences")
            self.runner.execute(sched)  # releases rows of sequences that ended
            return []
        self.counters.max_running_seen = max(self.counters.max_running_seen, len(self.scheduler.running))
        hidden = self.runner.execute(sched)
        touched: dict[str, Request] = {}
        sample_seqs, sample_rows = [], []
        offset = 0
        for s in sched.seqs:
            seq = seqs[s.seq_id]
            touched[seq.request.request_id] = seq.request
            self._count_prompt_tokens(seq, len(s.token_ids))
            if seq.index == 0 and seq.request.wants_prompt_logprobs:
                self._guard(seq.request, self._add_prompt_logprobs, seq, s, hidden[offset:offset + s.num_logits])
            if seq.status != SeqStatus.RUNNING:  # its request failed just now
                offset += s.num_logits
                continue
            seq.num_computed_tokens += len(s.token_ids)  # drafts included until verified (see _accept)
            if seq.request.pooling is not None:
                self._guard(seq.request, self._pool, seq, s, hidden[offset:offset + s.num_logits])
            elif s.start_pos + len(s.token_ids) == len(seq) + len(seq.spec_token_ids):
                rows_here = 1 + len(seq.spec_token_ids)
                first = offset + s.num_logits - rows_here
                for seq_ in [seq, *self._fork_children(seq)]:
                    sample_seqs.append(seq_)
                    sample_rows.append(range(first, first + rows_here))
            else:
                self.block_manager.cache_full_blocks(seq)
            offset += s.num_logits
        self._sample_and_append(hidden, sample_seqs, sample_rows)
        outputs = [out for req in touched.values() for out in self._outputs(req)]
        if self.policy and sum(s.num_logits for s in sched.seqs) == sched.num_tokens:
            # a decode/verification step (no prompt chunk): what the cost model compares
            self.policy.observe_step(sched.num_tokens, time.perf_counter() - start)
        self._propose()
        return outputs

    def _count_prompt_tokens(self, seq: Sequence, num_new: int) -> None:
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            self.counters.prompt_tokens += min(num_new, seq.num_prompt_tokens - seq.num_computed_tokens)

    def _add_prompt_logprobs(self, seq: Sequence, s: ScheduledSeq, hidden: torch.Tensor) -> None:
        """Score the prompt tokens this chunk predicts (logits at position p score token p + 1), a slice of
        positions at a time; tokens scored before a preemption are not scored again."""
        req = seq.request
        first_pos = max(s.start_pos, req.num_prompt_logprobs)
        end_pos = min(s.start_pos + len(s.token_ids), seq.num_prompt_tokens - 1)
        for lo in range(first_pos, end_pos, PROMPT_LOGPROBS_SLICE):
            hi = min(lo + PROMPT_LOGPROBS_SLICE, end_pos)
            logits = self.runner.compute_logits(hidden[lo - s.start_pos:hi - s.start_pos])
            targets = torch.tensor(req.prompt_token_ids[lo + 1:hi + 1], device=logits.device)
            req.new_prompt_logprobs.extend(gather_logprobs(logits, targets, req.params.prompt_logprobs))
            req.num_prompt_logprobs = hi

    def _pool(self, seq: Sequence, s: ScheduledSeq, rows: torch.Tensor) -> None:
        """Fold a prompt chunk's hidden states into the request's vector; once the whole prompt is computed the
        request ends (nothing is sampled) and its blocks are freed."""
        seq.request.pooling.add(rows, s.start_pos + len(s.token_ids))
        self.block_manager.cache_full_blocks(seq)
        if seq.is_prefill_done:
            seq.finish_reason = "stop"
            self.scheduler.finish(seq)
            self._count_finished(seq.request)

    def _fork_children(self, seq: Sequence) -> list[Sequence]:
        """At the end of the prompt, a request with n > 1 forks its other samples, sharing the prompt blocks."""
        req = seq.request
        if len(req.seqs) >= req.params.n or seq.num_output_tokens:
            return []
        self.block_manager.cache_full_blocks(seq)
        children = []
        for i, grammar in enumerate(req.pending_grammars, start=1):
            child = seq.fork(i, self._seed(req.params, i), grammar)
            self.block_manager.fork(seq, child)
            self.scheduler.add_running(child)
            req.seqs.append(child)
            children.append(child)
        req.pending_grammars = []
        return children

    def _sample_and_append(self, hidden: torch.Tensor, seqs: list[Sequence], rows: list[range]) -> None:
        """Sample each sequence's rows (its drafts' verification rows, then one more) and append what holds.
        Drafts with a draft distribution go through rejection sampling, the others through the sampler."""
        if not seqs:
            return
        flat = [r for rr in rows for r in rr]
        logits = self.runner.compute_logits(hidden[flat])
        sampling_rows = [SamplingRow(seq.params, seq.request.prompt_token_ids, seq.output_view(seq.spec_token_ids[:j]),
                                     seq.generator_for(len(seq) + j, logits.device), seq.grammar)
                         for seq, rr in zip(seqs, rows, strict=True) for j in range(len(rr))]
        spans, at = [], 0
        for rr in rows:
            spans.append(range(at, at + len(rr)))
            at += len(rr)
        plain = [i for i, (seq, span) in enumerate(zip(seqs, spans, strict=True)) if seq.spec_probs is None
                 for i in span]
        everything = len(plain) == len(sampling_rows)  # no rejection sampling this step: no copy of the logits
        tokens, logprobs, failed = self._sample(logits if everything else logits[plain],
                                                sampling_rows if everything else [sampling_rows[i] for i in plain]) \
            if plain else ([], [], {})
        by_row = {i: j for j, i in enumerate(plain)}
        for seq, span in zip(seqs, spans, strict=True):
            if seq.status == SeqStatus.FINISHED:
                continue  # its request failed earlier in this loop
            if seq.spec_probs is not None:
                self._guard(seq.request, self._verify_sampled_drafts, seq, logits[span.start:span.stop],
                            sampling_rows[span.start:span.stop])
            elif any(by_row[i] in failed for i in span):
                self._fail(seq.request, failed[next(by_row[i] for i in span if by_row[i] in failed)])
            else:
                self._guard(seq.request, self._accept, seq, [tokens[by_row[i]] for i in span],
                            [logprobs[by_row[i]] for i in span])

    def _verify_sampled_drafts(self, seq: Sequence, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Rejection-sample drafts drawn from a draft distribution against the target's, then append."""
        p = self.sampler.distribution(logits, rows)
        emitted = rejection_sample(p, seq.spec_probs.to(p.device), seq.spec_token_ids,
                                   lambda j, salt: seq.generator_for(len(seq) + j, p.device, salt))
        logprobs = [None] * len(emitted)
        if seq.params.logprobs is not None:
            targets = torch.tensor(emitted, device=logits.device)
            logprobs = gather_logprobs(logits[:len(emitted)], targets, seq.params.logprobs)
        self._accept(seq, emitted, logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]
                ) -> tuple[list[int], list[TokenLogprobs | None], dict[int, str]]:
        """Sample every row at once; if that fails, row by row, so a row's failure fails only its request."""
        try:
            out = self.sampler(logits, rows)
            return out.token_ids, out.logprobs, {}
        except Exception:  # noqa: BLE001 - isolated below
            logger.warning("batched sampling failed; sampling row by row to isolate the failing request")
        tokens, logprobs, failed = [0] * len(rows), [None] * len(rows), {}
        for i, row in enumerate(rows):
            try:
                out = self.sampler(logits[i:i + 1], [row])
                tokens[i], logprobs[i] = out.token_ids[0], out.logprobs[0]
            except Exception as e:  # noqa: BLE001 - reported as this request's error
                failed[i] = f"sampling failed: {type(e).__name__}: {e}"
        return tokens, logprobs, failed

    def _accept(self, seq: Sequence, sampled: list[int], logprobs: list[TokenLogprobs | None]) -> None:
        """Append sampled tokens while they confirm the drafts (the first mismatch is the model's own token),
        checking stops token by token; then roll back the slots of rejected drafts."""
        drafts = seq.spec_token_ids
        accepted = 0  # drafts confirmed by the model's own samples
        for j, token in enumerate(sampled):
            self._append_token(seq, token, logprobs[j])
            if j >= len(drafts) or token != drafts[j]:
                break
            accepted += 1
            if seq.finish_reason is not None:
                break
        seq.clear_drafts()
        if drafts:
            self._count_verification(seq, len(drafts), accepted)
        seq.num_computed_tokens = len(seq) - 1  # every token but the newest has its keys and values
        seq.num_draft_computed = min(seq.num_draft_computed, len(seq) - 1)  # a draft's KV past that is stale
        if len(seq.block_table) > self.block_manager.blocks_needed(len(seq)):
            self.block_manager.truncate(seq, len(seq))  # free the slots of rejected (or unverified) drafts
        # hashed before a finish frees them too, so a request that ends at its first token (max_tokens=1)
        # still leaves its prompt's blocks in the prefix cache
        self.block_manager.cache_full_blocks(seq)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            if seq.request.finished:
                self._count_finished(seq.request)

    def _count_verification(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        if len(c.accepted_per_position) < num_drafts:
            c.accepted_per_position.extend([0] * (num_drafts - len(c.accepted_per_position)))
        for i in range(num_accepted):
            c.accepted_per_position[i] += 1
        seq.num_drafts_verified += num_drafts
        seq.num_drafts_accepted += num_accepted
        if self.policy:
            self.policy.observe_verification(num_drafts, num_accepted)

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> None:
        seq.token_ids.append(token)
        if lp is not None:
            seq.new_logprobs.append(lp)
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            raise RuntimeError(f"the grammar rejected sampled token {token}")
        self.counters.generation_tokens += 1
        self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                seq.finish_reason = "stop"
                return
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
        if seq.grammar is not None and seq.grammar.is_terminated():
            seq.finish_reason = "stop"
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or len(seq) >= self.max_model_len:
            seq.finish_reason = "length"

    def _guard(self, req: Request, fn, *args) -> None:
        """Run ``fn(*args)`` for one request; an exception fails that request only."""
        if req.finished:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported as this request's error
            logger.exception("request %s failed", req.request_id)
            self._fail(req, f"{type(e).__name__}: {e}")

    def _fail(self, req: Request, error: str) -> None:
        for seq in req.seqs:
            if seq.status != SeqStatus.FINISHED:
                seq.finish_reason, seq.error = "error", error
                self.scheduler.finish(seq)
        self._count_finished(req)

    def _count_finished(self, req: Request) -> None:
        reason = req.seqs[0].finish_reason or "abort"
        self.counters.finished_by_reason[reason] = self.counters.finished_by_reason.get(reason, 0) + 1

    def _outputs(self, req: Request) -> list[EngineCoreOutput]:
        outs = []
        prompt_lps, req.new_prompt_logprobs = req.new_prompt_logprobs, []
        for seq in req.seqs:
            new = seq.take_new_tokens()
            ending = seq.finish_reason is not None and not seq.finish_reported
            if not new and not ending and not (prompt_lps and seq.index == 0):
                continue
            seq.finish_reported = seq.finish_reason is not None
            lps, seq.new_logprobs = seq.new_logprobs, []
            outs.append(EngineCoreOutput(
                req.request_id, seq.index, new, lps if req.params.logprobs is not None else None,
                prompt_lps if seq.index == 0 and req.params.prompt_logprobs is not None else None,
                seq.finish_reason, seq.stop_reason, req.num_cached_tokens or 0, seq.error,
                req.pooling.output if req.pooling is not None else None))
        if req.finished:
            self.requests.pop(req.request_id, None)
        return outs

    def _propose(self) -> None:
        """Attach drafts to running decode sequences: as many per sequence as the policy finds worth verifying
        next step, within each one's remaining budget. Grammar-constrained requests decode plainly."""
        if self.proposer is None:
            return
        # past the prompt (forks never inherit draft slots), and not still holding drafts a full step left out
        decoding = [s for s in self.scheduler.running if s.is_prefill_done and s.num_computed_tokens == len(s) - 1
                    and s.grammar is None and not s.spec_token_ids]
        k = self._num_drafts(decoding)
        if not k:
            return
        chosen, limits = [], []
        for seq in decoding:
            room = min(k, self.max_model_len - len(seq) - 1)
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            if room > 0 and (self.policy is None
                             or self.policy.drafts_for(seq.num_drafts_verified, seq.num_drafts_accepted)):
                chosen.append(seq)
                limits.append(room)
        if not chosen:
            return
        start = time.perf_counter()
        try:
            proposals = self.proposer.propose(chosen, limits)
        except Exception:  # noqa: BLE001 - drafts are an optimization: decode plainly, keep serving
            logger.exception("the %s proposer failed; these sequences decode without drafts this step",
                             type(self.proposer).__name__)
            return
        if self.policy:
            self.policy.observe_drafting(len(chosen), max(limits), time.perf_counter() - start)
        for seq, limit in zip(chosen, limits, strict=True):
            draft = proposals.get(seq.seq_id)
            if draft is None:
                continue
            if not isinstance(draft, Draft):
                draft = Draft(list(draft))
            seq.spec_token_ids = list(draft.token_ids[:limit])
            seq.spec_probs = None if draft.probs is None or not seq.spec_token_ids else draft.probs[:limit]

    def _num_drafts(self, decoding: list[Sequence]) -> int:
        """Draft tokens per sequence for the next step: the policy's choice (no policy: as many as proposed)."""
        if self.policy is None:
            return self.max_model_len
        # decodes and their drafts are scheduled before prompt chunks, which fill the rest of the budget
        prefilling = sum(s.num_pending_tokens for s in self.scheduler.running if not s.is_prefill_done)
        budget_left = self.config.max_num_batched_tokens - len(decoding)
        return self.policy.choose(len(decoding), max(0, min(prefilling, budget_left)))

    # ---- stats --------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of queue sizes, KV usage and the running counters."""
        c = self.counters
        c.num_running = len(self.scheduler.running)
        c.num_waiting = len(self.scheduler.waiting) + len(self.grammars)
        c.kv_cache_usage = self.block_manager.usage
        c.num_blocks_total = self.block_manager.num_blocks
        c.num_blocks_free = self.block_manager.num_free_blocks
        c.prefix_cache_queries = self.block_manager.prefix_queries
        c.prefix_cache_hits = self.block_manager.prefix_hits
        c.num_preemptions = self.scheduler.num_preemptions
        return EngineStats(**{**vars(c), "finished_by_reason": dict(c.finished_by_reason)})
