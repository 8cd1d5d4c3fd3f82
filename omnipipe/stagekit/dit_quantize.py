"""A DiT's linear weights in 8 bits through torchao (acceleration.quantization).

torchao swaps each nn.Linear's weight for a quantized tensor subclass in place; the
module's forward is unchanged, so batching, CFG-parallel and step caching see the same
transformer. It runs on the CPU and on CUDA alike."""

from __future__ import annotations

from typing import Any

from omnipipe.api.acceleration import Quantization


def quantize_weights(transformer: Any, settings: Quantization) -> None:
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )

    configs = {
        "int8-weight-only": Int8WeightOnlyConfig,
        "int8-dynamic": Int8DynamicActivationInt8WeightConfig,
        "float8-weight-only": Float8WeightOnlyConfig,
    }
    quantize_(transformer, configs[settings.method]())
