"""One stage of an OmniPipeline, and the models a stage is made of.

Apart from the spec's root so that the stage-graph rules (api/pipelines.py), which
read stages, sit below the spec whose validator runs them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, model_validator

from omnipipe.api import constants as c
from omnipipe.api.acceleration import Acceleration
from omnipipe.api.roles import Engine, Role
from omnipipe.api.spec_base import DnsLabel, Quantity, SpecModel

ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
TAINT_EFFECT_PATTERN = r"^(NoSchedule|PreferNoSchedule|NoExecute)$"


class Metric(StrEnum):
    INFLIGHT = "inflight"
    QUEUE_WAIT_P90 = "queue-wait-p90"
    KV_CACHE_USAGE = "kv-cache-usage"
    VIDEO_JOBS = "video-jobs"
    FIRST_AUDIO_P90 = "first-audio-p90"
    PROMQL = "promql"


class ScalingMode(StrEnum):
    NATIVE = "native"
    KEDA = "keda"
    HPA = "hpa"


class Resources(SpecModel):
    """Compute resources of one replica of a stage."""

    cpu: Quantity | None = None
    """CPU request and limit, as a Kubernetes quantity ("2", "500m"). It also sizes the
    worker's thread pools (torch, OpenMP): one thread per core, at least one."""
    memory: Quantity | None = None
    """Memory request and limit, as a Kubernetes quantity ("16Gi")."""
    gpus: Annotated[int, Field(ge=0, le=64)] | None = None
    """Number of GPUs per replica, requested as nvidia.com/gpu. 0 runs on the CPU."""


class EnvVar(SpecModel):
    """An environment variable of the stage's container, as in a Pod spec."""

    name: Annotated[
        str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    ]
    """Variable name."""
    value: str | None = None
    """Literal value."""
    value_from: dict[str, Any] | None = None
    """Source of the value (secretKeyRef, configMapKeyRef, fieldRef), as in a Pod spec."""


class Toleration(SpecModel):
    """A toleration of the stage's pods, as in a Pod spec."""

    key: str | None = None
    """Taint key the toleration applies to; empty matches all keys."""
    operator: Annotated[str, Field(pattern=r"^(Exists|Equal)$")] | None = None
    """Exists or Equal (the default)."""
    value: str | None = None
    """Taint value the toleration matches."""
    effect: Annotated[str, Field(pattern=r"^(NoSchedule|PreferNoSchedule|NoExecute)$")] | None = (
        None
    )
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: int | None = None
    """How long a NoExecute taint is tolerated before eviction."""


class MediaLimits(SpecModel):
    """What one chat request's images, audio and video may hold, checked from each item's
    header (a video's demuxed packets) before it is decoded (a thinker stage's budget). A
    limit left unset is the tighter of its default and what the loaded model takes (its
    context, its processor); one set here wins."""

    max_images: Annotated[int, Field(ge=0, le=256)] = 16
    """Most images in one request. Unset: 16, or fewer where the model's context cannot
    hold more images at their smallest token cost."""
    max_image_pixels: Annotated[int, Field(ge=1, le=1_000_000_000)] = 64_000_000
    """Most pixels of all the request's images together (one image at most this many)."""
    max_audio_clips: Annotated[int, Field(ge=0, le=256)] = 16
    """Most audio clips in one request."""
    max_audio_seconds: Annotated[float, Field(gt=0, le=3600)] = 300.0
    """Most seconds of all the request's audio clips together (a video's sound track among
    them when use_audio_in_video is set). Unset: 300, or fewer where the model's context
    cannot hold more at its audio encoder's tokens per second."""
    max_audio_clip_seconds: Annotated[float, Field(gt=0, le=3600)] = 300.0
    """Most seconds of one audio clip. Unset: 300, or less where the model's processor
    keeps only the start of a longer clip (Whisper's chunk_length when it truncates)."""
    max_video_frames: Annotated[int, Field(ge=0, le=768)] = 768
    """Most frames a request's video keeps once sampled (at the request's fps, 2 a second
    by default); a video that keeps more is refused before its frames are decoded. Unset:
    768 (the sampler's own cap), or fewer where the model's context, or a vLLM engine's
    encoder cache of one item, cannot hold more frames at their smallest token cost."""
    min_sample_rate: Annotated[int, Field(ge=1, le=384_000)] = 8_000
    """Lowest sample rate of a clip: a lower one is resampled into many more samples than
    its bytes suggest (a 1 Hz clip of 350 bytes became 16,000 floats a byte)."""
    max_sample_rate: Annotated[int, Field(ge=1, le=384_000)] = 192_000
    """Highest sample rate of a clip."""

    @model_validator(mode="after")
    def _rates(self) -> MediaLimits:
        if self.min_sample_rate > self.max_sample_rate:
            raise ValueError("media.minSampleRate must be <= media.maxSampleRate")
        return self


class Autoscaling(SpecModel):
    """Per-stage autoscaling from Prometheus metrics. The autoscaler then owns replicas."""

    min_replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    """Lowest replica count. 0 lets the stage scale to zero while idle."""
    max_replicas: Annotated[int, Field(ge=1, le=1000)]
    """Highest replica count."""
    metric: Metric = Metric.INFLIGHT
    """Signal to scale on: inflight (running plus waiting requests per ready replica),
    queue-wait-p90 (seconds), kv-cache-usage (fraction, vLLM stages), video-jobs (a video
    pipeline's unfinished jobs, queued or running, per replica), first-audio-p90 (seconds
    from a request's submission to the stage's first audio: a talker or code2wav stage) or
    promql (see query)."""
    target: Annotated[float, Field(gt=0)] | None = None
    """Target value of the metric per replica. Defaults depend on the metric."""
    query: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    """Raw PromQL expression giving the per-replica value, used when metric is promql."""
    scale_up_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 0
    """Window over which the lowest recommendation is taken before scaling up."""
    scale_down_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 300
    """Window over which the highest recommendation is taken before scaling down."""
    max_step: Annotated[int, Field(ge=1, le=100)] = 4
    """Most replicas added or removed by one decision."""
    tolerance: Annotated[float, Field(ge=0, le=1)] = 0.1
    """Relative distance from the target within which nothing changes."""
    mode: ScalingMode = ScalingMode.NATIVE
    """native: the operator scales from Prometheus; keda: emit a KEDA ScaledObject;
    hpa: emit a HorizontalPodAutoscaler on an external metric."""

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas must be <= autoscaling.maxReplicas")
        if self.metric is Metric.PROMQL and self.query is None:
            raise ValueError("autoscaling.query is required when autoscaling.metric is promql")
        return self


class Sampling(SpecModel):
    """Default sampling parameters of an autoregressive stage (thinker, talker). A request
    may override them per stage with sampling_params_list."""

    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    """Softmax temperature; 0 means greedy decoding."""
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    """Nucleus sampling: keep the smallest token set whose probability reaches top_p."""
    top_k: Annotated[int, Field(ge=0, le=100000)] | None = None
    """Keep only the top_k most likely tokens; 0 disables the cut."""
    max_tokens: Annotated[int, Field(ge=1, le=65536)] | None = None
    """Most tokens the stage generates for one request."""
    min_tokens: Annotated[int, Field(ge=0, le=65536)] | None = None
    """Fewest tokens before the stage may stop: its stop tokens are suppressed until then."""
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    """Penalty applied to tokens already generated; 1 disables it."""
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    """Seed of the stage's sampler, for reproducible output."""


class Stage(SpecModel):
    """One stage of the pipeline. For a known pipeline type, an entry whose name matches a
    default stage overrides only the fields it sets; other entries add stages."""

    name: DnsLabel
    """Stage name, a DNS label. It names the stage's Deployment: <pipeline>-<name>."""
    role: Role | None = None
    """What the stage does. Required for stages the pipeline type does not define."""
    engine: Engine | None = None
    """Inference engine: transformers, diffusers or vllm. Required for new stages."""
    model: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    """Model override for this stage; defaults to spec.model."""
    inputs: Annotated[list[DnsLabel], Field(max_length=c.MAX_INPUTS)] | None = None
    """Names of the upstream stages this stage consumes; each must come earlier."""
    replicas: Annotated[int, Field(ge=0, le=1000)] | None = None
    """Fixed replica count. Ignored when autoscaling is set."""
    resources: Resources | None = None
    """CPU, memory and GPUs per replica."""
    engine_args: dict[str, Any] | None = None
    """Free-form arguments passed to the engine (e.g. vLLM's max_model_len)."""
    sampling: Sampling | None = None
    """Default sampling parameters of this stage; requests may override them."""
    env: Annotated[list[EnvVar], Field(max_length=64)] | None = None
    """Extra environment variables of the stage's container."""
    node_selector: dict[str, str] | None = None
    """Node labels the stage's pods must match."""
    tolerations: Annotated[list[Toleration], Field(max_length=32)] | None = None
    """Tolerations of the stage's pods."""
    autoscaling: Autoscaling | None = None
    """Autoscaling policy. When set, the autoscaler owns the replica count."""
    max_batch: Annotated[int, Field(ge=1, le=c.MAX_BATCH)] | None = None
    """Most requests the stage runs together where it batches: a Qwen-Image denoiser runs
    requests of one image size as one forward per step, and requests join between steps.
    Default 8."""
    media: MediaLimits | None = None
    """Per-request budget of a chat stage's images, audio and video. A limit left unset is
    the tighter of its default and what the stage's model takes."""
    batch_wait_ms: Annotated[int, Field(ge=0, le=c.MAX_BATCH_WAIT_MS)] | None = None
    """How long a batching stage holds a batch that is not full for requests already sent
    to it whose inputs are still upstream. It never waits for requests nobody sent, so a
    lone request pays nothing. Default 20 for denoisers, 0 otherwise."""
    acceleration: Acceleration | None = None
    """A denoiser's acceleration: step caching (cache-dit), CFG-parallel over two devices and
    weight quantization (torchao). Off unless set."""
