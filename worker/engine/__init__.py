"""The engine: scheduler, KV-cache manager, model runner and the model, with no Redis.

`EngineCore` (engine_core.py) steps it; the worker process one package up wraps it with IO
threads, and `llmq generate` drives it in-process. Nothing here imports redis (a test checks).
"""
