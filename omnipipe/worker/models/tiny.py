"""tiny://NAME models: the real architectures with tiny random weights, written once to a
cache directory and then loaded by the same from_pretrained path as real checkpoints.

Weights are deterministic (fixed seeds), so every worker process that builds the model
gets the same bytes; a file lock keeps concurrent workers from building it twice.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from omnipipe.api.from_model import is_hub_id

log = logging.getLogger(__name__)
TINY_SCHEME = "tiny://"
# Bump when a builder changes, so stale caches are rebuilt.
# 9: built by `omnipipe fetch`, marked with its .omnipipe-complete.
TINY_FORMAT = "9-fetch"


def default_cache_dir() -> Path:
    base = os.environ.get("OMNIPIPE_CACHE_DIR") or Path.home() / ".cache" / "omnipipe"
    return Path(base) / "tiny"


def tiny_qwen_image_transformer() -> Any:
    import torch
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )


def tiny_qwen_image_vae() -> Any:
    import torch
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    # The released VAE's shape (8x down, three stages, temporal downsampling as released)
    # with few channels: the DiT then sees as many tokens as the real model at a size, and
    # a 2048x2048 decode stays seconds on a CPU.
    return AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )


def tiny_qwen_image_text_encoder(**vision_token_ids: Any) -> Any:
    """Qwen2.5-VL at the size both tiny Qwen-Image checkpoints use; the edit encoder,
    which sees images, names its tokenizer's vision tokens."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"},
                "rope_theta": 1000000.0,
                "vocab_size": 512,
            },
            vision_config={
                "depth": 2,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": 16,
            },
            **vision_token_ids,
        )
    )


def _build_qwen_image(target: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from omnipipe.worker.models.tokenizer import save_byte_tokenizer

    transformer = tiny_qwen_image_transformer()
    vae = tiny_qwen_image_vae()
    text_encoder = tiny_qwen_image_text_encoder()
    tokenizer = save_byte_tokenizer(target / "tokenizer")
    pipe = QwenImagePipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )
    cast(Any, pipe).save_pretrained(str(target))


def _build_qwen_image_edit(target: Path) -> None:
    from omnipipe.worker.models.tiny_image_edit import build_qwen_image_edit

    build_qwen_image_edit(target)


def _build_qwen25_omni(target: Path) -> None:
    from omnipipe.worker.models.tiny_omni import build_qwen25_omni

    build_qwen25_omni(target)


def _build_qwen3_omni(target: Path) -> None:
    from omnipipe.worker.models.tiny_qwen3_omni import build_qwen3_omni

    build_qwen3_omni(target)


def _build_bagel(target: Path) -> None:
    from omnipipe.worker.models.tiny_bagel import build_bagel

    build_bagel(target)


BUILDERS: dict[str, Callable[[Path], None]] = {
    "qwen-image": _build_qwen_image,
    "qwen-image-edit": _build_qwen_image_edit,
    "qwen2.5-omni": _build_qwen25_omni,
    "qwen3-omni": _build_qwen3_omni,
    "bagel": _build_bagel,
}


def resolve_model_path(model: str, cache_dir: Path | None = None) -> str:
    """A path or hub id that from_pretrained accepts; builds tiny:// models on first use,
    through `omnipipe fetch` (the same path the operator's fetch Job takes), under a file
    lock so that concurrent workers build once."""
    if not model.startswith(TINY_SCHEME):
        if Path(model).expanduser().is_dir() or is_hub_id(model):
            return model
        # Never taken for a Hub id (diffusers would try the network, then say so).
        raise FileNotFoundError(f"model {model}: no such directory, and not a Hugging Face id")
    name = model.removeprefix(TINY_SCHEME)
    if name not in BUILDERS:
        raise ValueError(f"unknown tiny model {model!r}; available: {', '.join(BUILDERS)}")
    # Imported here: fetch builds tiny models with this module's BUILDERS.
    from omnipipe.worker.models.fetch import COMPLETE, fetch

    root = (cache_dir or default_cache_dir()) / f"{name}-v{TINY_FORMAT}"
    if (root / COMPLETE).exists():
        return str(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with (root.parent / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / COMPLETE).exists():
            log.info("building %s with random weights in %s", model, root)
            fetch(model, root)
    return str(root)
