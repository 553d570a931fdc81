"""PEFT's adapter folder (adapter_config.json + adapter_model.safetensors) -> LoraAdapter.

References: PEFT `LoraConfig` (r, lora_alpha, use_rslora, rank_pattern / alpha_pattern,
target_modules) and `save_pretrained` (tensor names
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, A [r, in], B [out, r]);
PEFT `utils/other.py` `get_pattern_key` (how a pattern key picks a module).

Everything that would change the output in a way llmq does not compute is refused by name
(DoRA, trained biases, modules_to_save such as a resized head), not silently dropped.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from llmq.worker.engine.lora.adapter import LoraAdapter, LoraPart, fuse_parts, scaling
from llmq.worker.engine.lora.lora_error import LoraError
from llmq.worker.engine.model.arch import ModelArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR_RE = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight")


def is_peft_adapter(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def load_peft_adapter(name: str, path: Path, arch: ModelArchConfig, max_rank: int
                      ) -> LoraAdapter:
    """LoraError naming the adapter and the problem when it cannot be served."""
    try:
        config_bytes = (path / CONFIG_FILE).read_bytes()
        config = json.loads(config_bytes)
    except (OSError, ValueError) as e:
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    _check_config(name, config)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraError(f"adapter {name!r}: no {WEIGHTS_FILE} (only safetensors weights are "
                        "read, never pickled .bin files)")
    try:
        data = weights_path.read_bytes()
        tensors = load_safetensors(data)
    except (OSError, SafetensorError, ValueError) as e:
        raise LoraError(f"adapter {name!r}: {WEIGHTS_FILE} is corrupt: {e}") from None
    # NOTE: the files' hash, not the name, roots the prefix-cache hashes: an adapter replaced
    # on disk under the same name never reuses the old one's KV.
    digest = hashlib.sha256(config_bytes + data).digest()
    return fuse_parts(name, _parts(name, config, tensors), arch, max_rank,
                      int.from_bytes(digest[:16], "little"))


def _check_config(name: str, config: dict[str, Any]) -> None:
    where = f"adapter {name!r}: {CONFIG_FILE}"
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise LoraError(f"{where}: DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{where}: trained biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise LoraError(f"{where}: modules_to_save {config['modules_to_save']} (whole trained "
                        "modules, not low-rank ones) are not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise LoraError(f"{where}: `{key}` must be a positive number, got {value!r}")


def _pattern_value(patterns: dict[str, Any], module_name: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the first key that matches the module's name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module_name):
            return value
    return default


def _parts(name: str, config: dict[str, Any], tensors: dict[str, Any]) -> list[LoraPart]:
    pairs: dict[tuple[int, str], dict[str, Any]] = {}
    for tensor_name, tensor in tensors.items():
        m = _TENSOR_RE.fullmatch(tensor_name)
        if m is None:
            raise LoraError(f"adapter {name!r}: unexpected tensor {tensor_name!r} (llmq applies "
                            "LoRA to the decoder layers' q/k/v/o and gate/up/down projections)")
        if tensor.dim() != 2 or 0 in tensor.shape:
            raise LoraError(f"adapter {name!r}: {tensor_name} has shape {tuple(tensor.shape)}, "
                            "not a matrix")
        pairs.setdefault((int(m.group(1)), f"{m.group(2)}.{m.group(3)}"), {})[m.group(4)] = tensor
    alphas, use_rslora = config.get("alpha_pattern") or {}, bool(config.get("use_rslora"))
    parts = []
    for (layer, block_module), pair in sorted(pairs.items()):
        module = block_module.split(".")[1]
        if set(pair) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(pair)} "
                            "without its pair")
        rank = pair["A"].shape[0]
        module_name = f"base_model.model.model.layers.{layer}.{block_module}"
        alpha = _pattern_value(alphas, module_name, config["lora_alpha"])
        parts.append(LoraPart(layer, module, pair["A"], pair["B"],
                              scaling(float(alpha), rank, use_rslora)))
    return parts
