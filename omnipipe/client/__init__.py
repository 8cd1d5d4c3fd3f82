"""The Python API, shaped like vLLM-Omni's `AsyncOmni` and `Omni`:

    async with AsyncOmni(model="tiny://qwen2.5-omni") as omni:
        async for out in omni.generate("hello", output_modalities=["text", "audio"]):
            print(out.stage, out.final_output_type, out.text or len(out.audio), out.finished)

`AsyncOmni(model=...)` or `AsyncOmni(stage_configs_path=FILE)` starts the pipeline on this
machine (`omnipipe serve`: the router and the stage workers as processes);
`AsyncOmni(base_url=...)` attaches to a running router or a cluster's endpoint. Either
way a request takes the router's path through the stage workers (/v1/omni/generate),
not a second engine in this process."""

from omnipipe.client.async_omni import AsyncOmni, Prompt
from omnipipe.client.local_serve import STOP_SECONDS
from omnipipe.client.sync_omni import Omni
from omnipipe.client.types import (
    DuplicateRequestId,
    Modality,
    OmniError,
    OmniRequestOutput,
    OmniResult,
)

__all__ = [
    "STOP_SECONDS",
    "AsyncOmni",
    "DuplicateRequestId",
    "Modality",
    "Omni",
    "OmniError",
    "OmniRequestOutput",
    "OmniResult",
    "Prompt",
]
