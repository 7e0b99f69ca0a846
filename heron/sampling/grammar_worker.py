"""The grammar compiler's child process: it proves that a constraint compiles, so that a native crash or hang
costs one request, never the engine core.

xgrammar's compilers are native code: a deep enough schema overflows their stack and kills the process (a chain
of 5,000 nested ``$ref``s does), and some inputs compile for seconds. ``GrammarWorker.check`` compiles one
constraint at a time in a child (``python -m heron.sampling.grammar_worker``: a plain subprocess, so a user's
script is not re-imported as multiprocessing's "spawn" would), on a thread with a ``WORKER_STACK_BYTES`` stack.
If the child dies or runs past the timeout, that is logged once, only that constraint fails, and the next check
starts a new child.

The child answers only whether the constraint compiled (or why not); the caller then compiles it itself, on a
larger stack (compiling is deterministic). Shipping the compiled grammar back (``CompiledGrammar.
serialize_json``) would cost more than compiling: its size grows with rules x states (each rule's FSM carries
the whole FSM), so a 12 KB schema of 60 nested objects that compiles in 22 ms serializes to 63 MB in 2.6 s and
loads back in 1.2 s (49k-token vocabulary).

``HERON_GRAMMAR_COMPILE_HOOK=module:function`` replaces the child's compile function (tests simulate crashes
and slow compiles with it); it takes and returns what ``compile_grammar`` does.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import xgrammar as xgr

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 30.0
_START_TIMEOUT_S = 120.0
WORKER_STACK_BYTES = 8 * 2**20  # the usual main-thread stack, on which grammars were compiled before
COMPILE_HOOK_ENV = "HERON_GRAMMAR_COMPILE_HOOK"
# xgrammar's C++ errors start with "[hh:mm:ss] file.cc:line: " and sometimes "Check failed: (...) is false: "
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")

CompileFn = Callable[[xgr.GrammarCompiler, str, str, bool], xgr.CompiledGrammar]


def compile_grammar(compiler: xgr.GrammarCompiler, kind: str, spec: str, any_whitespace: bool
                    ) -> xgr.CompiledGrammar:
    """Compile one constraint: ``kind`` is "json" (a schema), "json_object", "regex" or "grammar" (EBNF)."""
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_grammar(spec)


def clean_error(error: Exception) -> str:
    """The first line of a compiler error, without xgrammar's source location."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _XGR_PREFIX.sub("", first)


class CompilerCrashed(Exception):
    """The child died or ran past the timeout on a constraint; the message says which."""


class GrammarWorker:
    """The compile child, seen from the core: started on first use, started again after a death."""

    def __init__(self, tokenizer_info_json: str, timeout: float = COMPILE_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._info = tokenizer_info_json.encode()
        self._proc: subprocess.Popen | None = None
        self._jobs: Connection | None = None
        self._results: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The child's pid (None when none is running)."""
        return self._proc.pid if self._proc is not None else None

    def check(self, kind: str, spec: str, any_whitespace: bool) -> str | None:
        """None if the constraint compiles, else why not; raises CompilerCrashed if the child died or timed out."""
        if self._proc is not None and self._proc.poll() is not None:
            logger.warning("the grammar compiler process (pid %d) exited while idle (%s)", self._proc.pid,
                           self._stop())
        try:
            if self._proc is None:
                self._start()
            self._jobs.send((kind, spec, any_whitespace))
            if self._results.poll(self.timeout):
                return self._results.recv()
        except (EOFError, OSError):
            pid, status = self.pid, self._stop()
            logger.error("the grammar compiler process (pid %s) died (%s) compiling a %s constraint; that request "
                         "fails, the next grammar starts a new process", pid, status, kind)
            raise CompilerCrashed(f"crashed ({status})") from None
        logger.error("the grammar compiler process (pid %d) took longer than %g s on a %s constraint; killed it",
                     self.pid, self.timeout, kind)
        self._stop(kill=True)
        raise CompilerCrashed(f"took longer than {self.timeout:g} s")

    def close(self) -> None:
        """Stop the child (it exits when its pipe closes)."""
        self._stop()

    def _start(self) -> None:
        job_r, job_w = os.pipe()
        result_r, result_w = os.pipe()
        self._jobs = Connection(job_w, readable=False)
        self._results = Connection(result_r, writable=False)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(job_r), str(result_w)],
                                          pass_fds=(job_r, result_w), stdin=subprocess.DEVNULL)
        finally:
            os.close(job_r)  # the child's ends: closed here, so its death shows as the end of the pipe
            os.close(result_w)
        self._jobs.send_bytes(self._info)
        if not self._results.poll(_START_TIMEOUT_S):
            raise EOFError  # hung while starting: handled as a death
        self._results.recv()  # ready: the compile timeout starts now, not while xgrammar is imported

    def _stop(self, kill: bool = False) -> str:
        """Close the pipes and reap the child (killing it now if ``kill``, else if it does not exit); how it
        ended."""
        for conn in (self._jobs, self._results):
            if conn is not None:
                conn.close()
        self._jobs = self._results = None
        proc, self._proc = self._proc, None
        if proc is None:
            return "not started"
        if kill:
            proc.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        code = proc.returncode
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _compile_hook() -> CompileFn:
    hook = os.environ.get(COMPILE_HOOK_ENV)
    if not hook:
        return compile_grammar
    module, _, name = hook.partition(":")
    return getattr(importlib.import_module(module), name)


def _error(compile_fn: CompileFn, compiler: xgr.GrammarCompiler, kind: str, spec: str, any_whitespace: bool
           ) -> str | None:
    try:
        compile_fn(compiler, kind, spec, any_whitespace)
    except Exception as e:  # noqa: BLE001 - xgrammar's errors for invalid input are RuntimeErrors and subclasses
        return clean_error(e)
    return None


def main() -> None:
    """The child: read the tokenizer info, then answer one compile at a time until its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    jobs = Connection(int(sys.argv[1]), writable=False)
    results = Connection(int(sys.argv[2]), readable=False)
    compile_fn = _compile_hook()
    try:
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(jobs.recv_bytes().decode()),
                                       cache_enabled=False)
    except EOFError:
        return
    results.send(None)
    threading.stack_size(WORKER_STACK_BYTES)  # the compile thread's, whatever this process's main stack is
    with ThreadPoolExecutor(max_workers=1) as thread:
        while True:
            try:
                kind, spec, any_whitespace = jobs.recv()
            except EOFError:
                return
            results.send(thread.submit(_error, compile_fn, compiler, kind, spec, any_whitespace).result())


if __name__ == "__main__":
    main()
