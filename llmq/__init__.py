"""llmq: a Redis-streams-backed batch inference worker pool.

The package's code lives in the repository's top-level folders (protocol/, broker/, worker/,
gateway/, cli/, jobs/); the links in this folder make them the subpackages `llmq.*` for Python,
mypy and editors alike, with no mapping a tool has to know about.
"""

__version__ = "0.1.0"
