"""llmq.gateway: `llmq serve`, an OpenAI-compatible HTTP gateway in front of an llmq pool.

Stateless (everything it knows is in Redis, so any number of replicas may run behind a load
balancer); imports llmq.broker and the ASGI stack only, never torch or llmq.worker.
"""
