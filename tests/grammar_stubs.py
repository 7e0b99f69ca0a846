"""A grammar compile function that misbehaves on cue, for the compile child (``HERON_GRAMMAR_COMPILE_HOOK``).

A constraint containing ``ABORT`` makes the child abort, as a native crash would; one containing ``SLOW``
compiles ``SLOW_S`` seconds late. Light to import: the child imports it, with tests/ on its PYTHONPATH.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import xgrammar as xgr

from heron.sampling.grammar_worker import COMPILE_HOOK_ENV, compile_grammar

ABORT = "abort-the-compiler"
SLOW = "slow-to-compile"
SLOW_S = 3.0


def compile_or_misbehave(compiler: xgr.GrammarCompiler, kind: str, spec: str, any_whitespace: bool
                         ) -> xgr.CompiledGrammar:
    if ABORT in spec:
        os.abort()
    if SLOW in spec:
        time.sleep(SLOW_S)
    return compile_grammar(compiler, kind, spec, any_whitespace)


def stub_env() -> dict[str, str]:
    """The environment under which compile children (of this process or of its children) use the stub."""
    path = [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {COMPILE_HOOK_ENV: "grammar_stubs:compile_or_misbehave", "PYTHONPATH": os.pathsep.join(path)}
