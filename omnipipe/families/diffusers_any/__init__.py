"""Any diffusers pipeline, run whole as one stage: the path for a model that no family
splits into stages (Stable Diffusion 3, Sana, CogVideoX, AudioLDM and the rest of
diffusers' catalogue). What the pipeline makes decides its type and so its endpoint:
images (/v1/images/generations), edits of an input image with an optional mask
(/v1/images/edits), videos (/v1/videos jobs) or audio (/v1/audio/generate). A model
named alone gets the type its class makes (classes.type_for_class); a spec may name
any of the four for any diffusers checkpoint, and a class the named type cannot serve is
refused at load, naming the type that can."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

HERE = "omnipipe.families.diffusers_any"
# Each type is this one stage: the checkpoint's pipeline, whole.
WHOLE = (StageDefaults("pipeline", Role.DENOISER, Engine.DIFFUSERS),)
RUNS = (Role.DENOISER, Engine.DIFFUSERS)

FAMILY = Family(
    name="diffusers",
    description="Any diffusers pipeline run whole as one stage (the fallback for a model "
    "with no family): images, image edits, videos or audio, as the pipeline makes them.",
    pipelines=(
        PipelineType(
            name="diffusers",
            description=(
                "One stage: the checkpoint's own diffusers pipeline, whole (its encoders, "
                "its denoising loop and its decoder in one process), text to image; "
                "requests of one size and settings share its batch."
            ),
            example_models=(
                "stabilityai/stable-diffusion-3.5-medium",
                "Efficient-Large-Model/Sana_1600M_1024px_diffusers",
                "tiny://sd3",
                "tiny://sana",
            ),
            any_diffusers_checkpoint=True,
            type_for_class=f"{HERE}.classes:type_for_class",
            stages=WHOLE,
            stage_classes={RUNS: f"{HERE}.stage:WholePipelineStage"},
        ),
        PipelineType(
            name="diffusers-edit",
            description=(
                "One stage: a diffusers image-to-image or inpainting pipeline, whole (a "
                "text-to-image checkpoint runs as diffusers' AutoPipelineForImage2Image "
                "and AutoPipelineForInpainting make it), at /v1/images/edits with one "
                "image and an optional mask."
            ),
            example_models=("stabilityai/stable-diffusion-3.5-medium", "tiny://sd3"),
            takes_mask=True,
            edits=True,
            edit_image_roles=frozenset({Role.DENOISER}),
            stages=WHOLE,
            stage_classes={RUNS: f"{HERE}.edit:WholeEditStage"},
            requests=f"{HERE}.edit_requests:EXTENSIONS",
        ),
        PipelineType(
            name="diffusers-video",
            description=(
                "One stage: a diffusers text-to-video pipeline, whole, its frames an MP4, "
                "served at /v1/videos as jobs."
            ),
            example_models=("THUDM/CogVideoX-5b", "tiny://cogvideox"),
            makes_video=True,
            stages=WHOLE,
            stage_classes={RUNS: f"{HERE}.video:WholeVideoStage"},
            requests=f"{HERE}.video_requests:EXTENSIONS",
        ),
        PipelineType(
            name="diffusers-audio",
            description=(
                "One stage: a diffusers text-to-audio pipeline, whole (AudioLDM's, "
                "MusicLDM's), served at /v1/audio/generate."
            ),
            example_models=("cvssp/audioldm-s-full-v2", "tiny://audioldm"),
            makes_audio=True,
            stages=WHOLE,
            stage_classes={RUNS: f"{HERE}.audio:WholeAudioStage"},
            requests=f"{HERE}.audio_requests:EXTENSIONS",
        ),
    ),
    tiny_models={
        "sd3": f"{HERE}.tiny:build_sd3",
        "sana": f"{HERE}.tiny:build_sana",
        "cogvideox": f"{HERE}.tiny_video:build_cogvideox",
        "audioldm": f"{HERE}.tiny_audio:build_audioldm",
    },
    requests=f"{HERE}.requests:EXTENSIONS",
)
