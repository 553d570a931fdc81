"""LoRA adapters over the one base model (vLLM v1's multi-LoRA serving, on CPU).

- lora_error.py     LoraError: why an adapter cannot be served (torch-free, for the gate)
- adapter.py        LoraAdapter: an adapter's low-rank pairs, fused like the base's projections
- peft_adapter.py   PEFT folders (adapter_config.json + adapter_model.safetensors)
- gguf_adapter.py   llama.cpp's GGUF LoRA files
- lora_manager.py   LoraManager: the adapter directory, loads on first use, the LRU
- lora_batch.py     LoraBatch: a step's rows per adapter, and the grouped low-rank add

Nothing is imported here: the gate and the engine's types import lora_error alone, without
torch.
"""
