"""A chat stage's media budget as its model allows it: each limit the spec leaves unset is
the tighter of its default and what the loaded model's processor and context take; one
the spec sets wins. The derived numbers are checked on the tiny models' real processors
and on processors built with the released checkpoints' preprocessor values."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from PIL import Image

from omnipipe.api.resolve import ResolvedPipeline
from omnipipe.api.spec import Role
from omnipipe.api.stage_spec import MediaLimits
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.bagel.config import understanding_image_tokens
from omnipipe.families.bagel.think import conversation
from omnipipe.families.qwen_omni.transformers.thinker import ThinkerStage
from omnipipe.stagekit.chat_media import processor_media, smallest_image_tokens
from omnipipe.stagekit.media import charge_media
from omnipipe.stagekit.media_limits import ModelMedia, effective_media
from omnipipe.stagekit.stage import StageInputError, StageJob
from tests.unit.test_media_budget import audio, image, messages, png, wav
from tests.unit.test_omni_stages import spec

pytestmark = pytest.mark.timeout(300)
LOGGER = "omnipipe.stagekit.media_limits"


def processor(model: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(resolve_model_path(model))


@pytest.fixture(scope="module")
def tiny25() -> Any:
    return processor("tiny://qwen2.5-omni")


@pytest.fixture(scope="module")
def tiny3() -> Any:
    return processor("tiny://qwen3-omni")


@pytest.fixture(scope="module")
def released25(tiny25: Any) -> Any:
    """Qwen2.5-Omni-7B's processor as its preprocessor_config.json sets it (min_pixels
    3136, max_pixels 12845056, patch 14, merge 2; Whisper at 16 kHz, chunk_length 300),
    with the tiny tokenizer: the numbers that matter are the processor's, not the text's."""
    from transformers import Qwen2_5OmniProcessor, Qwen2VLImageProcessor, WhisperFeatureExtractor

    return Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(
            min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2
        ),
        video_processor=tiny25.video_processor,
        feature_extractor=WhisperFeatureExtractor(feature_size=128, chunk_length=300),
        tokenizer=tiny25.tokenizer,
        chat_template=tiny25.chat_template,
    )


def image_tokens_of(proc: Any, size: tuple[int, int]) -> int:
    """What the processor really makes of one image of this size."""
    inputs = proc(text=[proc.image_token], images=[Image.new("RGB", size)], return_tensors="pt")
    token = proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    return int((inputs["input_ids"] == token).sum())


def test_the_tiny_processors_give_the_model_side_of_each_limit(tiny25: Any, tiny3: Any) -> None:
    # Qwen2.5-Omni: 28-pixel squares (patch 14, merge 2) from min_pixels 784: one token;
    # its Whisper extractor pads and truncates every clip to 30 s, 25 tokens a second; a
    # video's pair of frames (one temporal patch) at least 128 squares.
    assert processor_media(tiny25, 32768) == ModelMedia(32768, 1, 25.0, 30.0, 128, 2)
    # Qwen3-Omni: 32-pixel squares from min_pixels 1024; 13 tokens a second, no cut.
    assert processor_media(tiny3, 32768) == ModelMedia(32768, 1, 13.0, None, 128, 2)
    for proc in (tiny25, tiny3):
        assert image_tokens_of(proc, (28, 28)) == smallest_image_tokens(proc.image_processor)


def test_the_released_qwen25_omni_processor(released25: Any) -> None:
    model = processor_media(released25, 32768)
    assert model == ModelMedia(32768, 4, 25.0, 300.0, 128, 2)
    # 3136 pixels at the least: 4 tokens, and no image makes fewer.
    assert image_tokens_of(released25, (56, 56)) == 4
    assert image_tokens_of(released25, (20, 300)) >= 4
    # At its own 32768 tokens every limit but video stays at its default (510 frames of
    # 64 tokens fill 32640); at 4096, audio and video bind.
    defaults = effective_media(MediaLimits(), model)
    assert defaults.limits == MediaLimits().model_copy(update={"max_video_frames": 510})
    assert {n for n, s in defaults.sources.items() if s != "default"} == {"max_video_frames"}
    assert defaults.sources["max_video_frames"] == "context"
    short = effective_media(MediaLimits(), processor_media(released25, 4096))
    assert short.limits.max_audio_seconds == 163  # 4095 // 25
    assert short.sources["max_audio_seconds"] == "context"
    assert short.limits.max_images == 16  # 1023 images of 4 tokens would fit
    assert short.limits.max_video_frames == 62  # 4095 // 128 pairs


def test_a_short_context_derives_the_limits_and_logs_them_once(
    tiny25: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, LOGGER):
        media = effective_media(MediaLimits(), processor_media(tiny25, 256))
    lim = media.limits
    assert (lim.max_images, lim.max_audio_seconds, lim.max_audio_clip_seconds) == (16, 10, 30)
    assert media.sources["max_audio_seconds"] == "context"
    assert media.sources["max_audio_clip_seconds"] == "processor"
    assert media.sources["max_images"] == "default"  # 255 images of 1 token would fit
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "media limits: maxImages 16 (default), maxImagePixels 64000000 (default), "
        "maxAudioClips 16 (default), maxAudioSeconds 10 (context), maxAudioClipSeconds 30 "
        "(processor), minSampleRate 8000 (default), maxSampleRate 192000 (default); the "
        "model: context 256 tokens, an image 1 token or more, audio 25 tokens a second, "
        "clips cut at 30s, video 64 tokens a frame or more"
    ]


def test_a_refusal_by_a_derived_limit_names_the_limit_and_its_source(released25: Any) -> None:
    media = effective_media(MediaLimits(), processor_media(released25, 33))
    assert media.limits.max_images == 8  # 32 tokens, 4 an image
    with pytest.raises(StageInputError) as caught:
        charge_media(messages(*[image(png(4, 4))] * 9), media.budget())
    assert caught.value.message == (
        "messages[0].content[9]: more than 8 images in one request (maxImages, from the "
        "model's context: its 33 tokens hold at most 8 images of 4 tokens or more)"
    )
    assert caught.value.param == "messages"
    with pytest.raises(StageInputError) as caught:
        charge_media(messages(audio(wav(16000 * 2, 16000))), media.budget())
    assert caught.value.message == (
        "messages[0].content[1]: 2s takes the request's audio past its limit of 1s in all "
        "(maxAudioSeconds, from the model's context: its 33 tokens hold at most 1s of audio "
        "at 25 tokens a second)"
    )


def test_a_clip_past_what_the_processor_keeps_is_refused(tiny25: Any) -> None:
    media = effective_media(MediaLimits(), processor_media(tiny25, 32768))
    charge_media(messages(audio(wav(16000 * 30, 16000))), media.budget())
    with pytest.raises(StageInputError) as caught:
        charge_media(messages(audio(wav(16000 * 45, 16000))), media.budget())
    assert caught.value.message == (
        "messages[0].content[1]: the clip is 45.0s, past the limit of 30s a clip "
        "(maxAudioClipSeconds, from the model's processor: it keeps only the first 30s of "
        "a clip)"
    )
    assert caught.value.param == "messages[0].content[1]"


def test_a_limit_the_spec_sets_wins_with_a_warning_where_the_model_cannot_use_it(
    tiny25: Any, caplog: pytest.LogCaptureFixture
) -> None:
    given = MediaLimits.model_validate(
        {"maxAudioSeconds": 120, "maxAudioClipSeconds": 60, "maxImages": 4}
    )
    with caplog.at_level(logging.INFO, LOGGER):
        media = effective_media(given, processor_media(tiny25, 256))
    lim = media.limits
    assert (lim.max_audio_seconds, lim.max_audio_clip_seconds, lim.max_images) == (120, 60, 4)
    assert {n: media.sources[n] for n in given.model_fields_set} == {
        "max_audio_seconds": "spec",
        "max_audio_clip_seconds": "spec",
        "max_images": "spec",
    }
    # A refusal by the spec's own limit reads as before: only the unset video one is noted.
    assert set(media.notes) == {"max_video_frames"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "media.maxAudioSeconds 120 is more than the model takes (its context: its 256 tokens "
        "hold at most 10s of audio at 25 tokens a second); the spec's value stands: a request "
        "past it cannot fit and is refused for its length, once decoded",
        "media.maxAudioClipSeconds 60 is more than the model takes (its processor: it keeps "
        "only the first 30s of a clip); the spec's value stands: the processor drops what is "
        "past it",
    ]
    # A spec value under the model's (maxImages 4 of 255) is taken without a word.


def test_the_thinker_stage_charges_requests_against_its_derived_budget() -> None:
    path = resolve_model_path("tiny://qwen2.5-omni")
    short = spec("thinker", Role.THINKER, engine_args={"max_model_len": 256})
    stage = ThinkerStage(short, path, "cpu")
    stage.load()
    assert stage.media_limits.limits.max_audio_seconds == 10
    twelve = [{"role": "user", "content": [audio(wav(16000 * 12, 16000))]}]
    with pytest.raises(StageInputError, match=r"limit of 10s in all \(maxAudioSeconds, from"):
        stage.prepare(StageJob({"messages": twelve}, {}))
    # The spec's own 20 s wins: the clip passes the budget, and the context check refuses
    # the 300 audio tokens it becomes, as the load's warning said it would.
    given = short.model_copy(update={"media": MediaLimits(max_audio_seconds=20)})
    stage = ThinkerStage(given, path, "cpu")
    stage.load()
    assert stage.media_limits.sources["max_audio_seconds"] == "spec"
    with pytest.raises(StageInputError, match="this model's context is 256 tokens"):
        stage.open(StageJob({"messages": twelve}, {}))
    with torch.inference_mode():
        stage.open(StageJob({"messages": messages(audio(wav(16000 * 2, 16000)))}, {})).close()


def test_bagel_charges_images_against_its_context() -> None:
    path = resolve_model_path("tiny://bagel")
    assert understanding_image_tokens(path) == 16  # vit_max_num_patch_per_side 4, squared
    default = effective_media(MediaLimits(), ModelMedia(512, 16), ("image",))
    assert default.limits.max_images == 16  # 511 tokens would hold 31
    assert "Audio" not in default.summary()
    media = effective_media(MediaLimits(), ModelMedia(40, 16), ("image",))
    assert media.limits.max_images == 2
    params = {"messages": messages(*[image(png(8, 8))] * 3)}
    with pytest.raises(StageInputError, match=r"more than 2 images in one request \(maxImages"):
        conversation(params, media)


def test_a_written_pipeline_carries_only_the_limits_the_spec_sets() -> None:
    import yaml

    from omnipipe.api.loading import pipeline_yaml
    from omnipipe.api.resolve import resolve
    from omnipipe.api.resource import OmniPipeline

    resource = OmniPipeline.model_validate(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": "omni"},
            "spec": {
                "model": "tiny://qwen2.5-omni",
                "pipeline": "qwen2.5-omni",
                "stages": [{"name": "thinker", "media": {"maxImages": 16}}],
            },
        }
    )
    written = yaml.safe_load(pipeline_yaml(resolve(resource)))
    assert [s["media"] for s in written["stages"]] == [{"max_images": 16}, {}, {}]
    read = ResolvedPipeline.model_validate(written)
    # 16 is the default's value, but set: it stands against the model's.
    assert read.stage("thinker").media.model_fields_set == {"max_images"}
    assert read.stage("talker").media.model_fields_set == set()
    assert read == resolve(resource)


@pytest.mark.parametrize(
    ("cache", "frames", "source"),
    [(8192, 256, "encoder cache"), (None, 624, "context"), (1_000_000, 624, "context")],
)
def test_an_engines_encoder_cache_bounds_the_frames_where_it_is_tighter(
    cache: int | None, frames: int, source: str
) -> None:
    """vLLM refuses a media item of more tokens than its encoder cache holds, once it is
    decoded: where that bound is tighter than the context's, maxVideoFrames is it, and a
    clip past it is refused before any frame is decoded, naming the cache."""
    model = ModelMedia(
        20_000,
        video_patch_tokens=64,
        video_patch_frames=2,
        **({"encoder_cache_tokens": cache} if cache else {}),
    )
    effective = effective_media(MediaLimits(), model, ("image", "audio", "video"))
    assert effective.limits.max_video_frames == frames
    assert effective.sources["max_video_frames"] == source
    if source == "encoder cache":
        budget = effective.budget()
        with pytest.raises(StageInputError, match="its encoder holds 8192 tokens of one item"):
            budget.take_video(258, 129.0, "messages[0].content[0]")
        budget.take_video(256, 128.0, "messages[0].content[0]")
