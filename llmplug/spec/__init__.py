"""Speculative decoding: proposers of draft tokens and the exact rejection sampler that verifies them."""
