"""The sketch family: what omnipipe needs to know of it, importing only omnipipe.api (the
operator and the router import this module too)."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

MODEL_TYPE = "omnipipe_sketch"

FAMILY = Family(
    name="sketch",
    description="Sketch: Qwen-Image's stage graph under a name and a checkpoint of its own.",
    pipelines=(
        PipelineType(
            name="sketch-image",
            description="Text to image: encode (AR) -> denoise (DiT, true CFG) -> decode (VAE).",
            example_models=("tiny://sketch-image",),
            checkpoints=(MODEL_TYPE,),
            stages=(
                StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS),
                StageDefaults("denoise", Role.DENOISER, Engine.DIFFUSERS, inputs=("encode",)),
                StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("denoise",)),
            ),
            stage_classes={
                (Role.TEXT_ENCODER, Engine.TRANSFORMERS): "omnipipe_sketch.stages:SketchEncode",
                (Role.DENOISER, Engine.DIFFUSERS): "omnipipe_sketch.stages:SketchDenoise",
                (Role.VAE_DECODER, Engine.DIFFUSERS): "omnipipe_sketch.stages:SketchDecode",
            },
        ),
    ),
    tiny_models={"sketch-image": "omnipipe_sketch.tiny:build_sketch_image"},
)
