"""Router settings, loaded once from OMNIPIPE_ROUTER_* variables and CLI flags."""

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from omnipipe.api.constants import CREDENTIAL_ENV
from omnipipe.api.keys import SecretKey

MIB = 1024 * 1024


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="OMNIPIPE_ROUTER_",
        frozen=True,
        use_attribute_docstrings=True,
        populate_by_name=True,
    )

    pipeline_file: str = "/etc/omnipipe/pipeline.yaml"
    """The pipeline: an OmniPipeline manifest or the operator's resolved pipeline.yaml."""
    host: str = "0.0.0.0"
    """Bind address."""
    port: int = 8000
    """HTTP port of the OpenAI-compatible API."""
    api_key: SecretKey = None
    """When set, clients must send `Authorization: Bearer <key>` (a Secret in Kubernetes)."""
    admin_api_key: SecretKey = None
    """When set, `/admin` takes `Authorization: Bearer <key>` with this key instead of
    api_key (which then no longer opens it)."""
    pipeline_credential: SecretKey = Field(default=None, validation_alias=CREDENTIAL_ENV)
    """The pipeline's shared credential, sent on every call to a worker's control API
    (read from OMNIPIPE_PIPELINE_CREDENTIAL, the variable the workers read too)."""
    replicas_file: str | None = None
    """Static discovery (local mode): JSON {stage: [control URLs]}. Unset: DNS of the
    stages' headless Services."""
    cluster_domain: str = "svc.cluster.local"
    """DNS suffix for headless Service discovery."""
    request_timeout_seconds: float = 300.0
    """Longest a request may take end to end before the client gets 504."""
    max_body_bytes: int = 25 * 1024 * 1024
    """Largest request body accepted (413 above it)."""
    max_queue_per_replica: int = 64
    """A replica with this many requests in flight is full; all full means 429."""
    wake_wait_seconds: float = 60.0
    """How long a request waits for a stage with no ready replica (scaled to zero, or
    starting) before the client gets 503 with Retry-After."""
    poll_interval_seconds: float = 1.0
    """How often replicas' /ready (readiness and load) is polled."""
    discovery_interval_seconds: float = 5.0
    """How often the stages' replica lists are re-resolved."""
    video_store: str | None = Field(default=None, pattern=r"^(redis|rediss|unix)://")
    """The Redis that keeps a video pipeline's jobs, and a voice-cloning pipeline's
    uploaded voices, shared by every router replica (redis://host:6379/0); required when
    the pipeline makes videos (without it a cloning pipeline keeps no voices)."""
    max_voices: int = Field(default=32, ge=1, le=100_000)
    """Most voices a cloning pipeline keeps (/v1/audio/voices): a clip is up to 10 MiB,
    in the Redis that keeps video jobs too."""
    video_timeout_seconds: float = Field(default=3600.0, gt=0)
    """Longest one run of a video job may take (the stages' request timeout for it)."""
    video_jobs_per_replica: int = Field(default=2, ge=0, le=64)
    """Video jobs one router replica runs at once (the stages batch what they get); 0:
    this replica answers the API and leaves the jobs to the others."""
    video_max_bytes: int = Field(default=256 * MIB, ge=1, le=512 * MIB)
    """Largest finished video a job keeps in the store (Redis's largest value is 512 MiB);
    a job whose MP4 is bigger fails, its error naming both sizes."""
    video_lease_seconds: float = Field(default=10.0, ge=3, le=600)
    """How long a replica that stopped renewing holds its running video jobs before
    another replica queues them again."""
