"""Speculative decoding: proposers (n-gram, draft model, self-draft), rejection sampling, the adaptive policy."""
