"""Speculative decoding: propose draft tokens cheaply, verify them in one forward pass."""
