"""llmq.worker: the engine core (engine/, no Redis) and the worker process around it.

The process layer here reads requests from Redis on IO threads that share one `WorkerContext`,
feeds them through the engine's gate (`InputProcessor`) to `EngineCore` on the busy loop
(`Worker`, worker.py), and writes every token back (`ResultWriter`). docs/architecture.md maps
the modules and the import rules between the two layers.
"""
