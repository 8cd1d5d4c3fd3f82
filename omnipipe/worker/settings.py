"""Worker settings, loaded once from OMNIPIPE_WORKER_* variables and CLI flags."""

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from omnipipe.api.constants import CREDENTIAL_ENV
from omnipipe.api.keys import SecretKey


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="OMNIPIPE_WORKER_",
        frozen=True,
        use_attribute_docstrings=True,
        populate_by_name=True,
    )

    pipeline_file: str = "/etc/omnipipe/pipeline.yaml"
    """The pipeline: an OmniPipeline manifest or the operator's resolved pipeline.yaml."""
    stage: str = ""
    """Which stage of the pipeline this worker runs."""
    group: str = ""
    """Or which colocated group (spec.placement): every stage of it, in this process."""
    transfer_ports: tuple[int, ...] = ()
    """A group's transfer listeners, one per stage in the group's order; unset: from
    transfer_port up (8101, 8102, ...)."""
    host: str = "0.0.0.0"
    """Bind address of the control API and the transfer listener."""
    port: int = 8100
    """Control API port: submit, cancel, events, /health, /ready, /metrics, /drain."""
    transfer_port: int = 8101
    """Port of the tensor transfer listener."""
    advertise_host: str = "127.0.0.1"
    """Host other stages use to reach this worker's transfer listener (the pod IP)."""
    max_batch: int | None = Field(default=None, ge=1)
    """Overrides the stage's maxBatch: most requests run together in one engine call."""
    threads: int | None = Field(default=None, ge=1, le=1024)
    """CPU threads of the stage's engine (torch, OpenMP, MKL, tokenizers). Unset: the
    stage's resources.cpu, else the CPUs this process may use. `omnipipe serve` sets it to
    the worker's share of the machine."""
    device: str = "auto"
    """Torch device: auto picks cuda when the stage has GPUs and CUDA is present."""
    drain_timeout_seconds: float = 110.0
    """How long a drain waits for in-flight requests before giving up."""
    credential: SecretKey = Field(default=None, validation_alias=CREDENTIAL_ENV)
    """The pipeline's shared credential (OMNIPIPE_PIPELINE_CREDENTIAL, no prefix: the
    router reads the same variable). When set, every control call but /health, /ready
    and /metrics must carry it in the X-Omnipipe-Credential header."""
    mailbox_max_bytes: int = 1 << 30
    """Most bytes of inputs the transfer mailbox holds; a message past it is refused."""
    model_path: str | None = None
    """The stage's weights, already on disk: the operator's read-only mount of a weights
    claim or image (spec.weights). When set, the worker loads them from here and never
    downloads."""
    profile_dir: str = "/tmp/omnipipe-profiles"
    """Where stop_profile writes the torch profiler's trace (a Chrome trace JSON file
    per call, named in the response)."""
    profile_max_seconds: float = Field(default=60.0, gt=0, le=3600)
    """A profile stops by itself after this long (its trace written; the next
    stop_profile answers it, saying why)."""
    profile_max_megabytes: int = Field(default=512, ge=1, le=65536)
    """... or once the process has grown by this many MiB since it started: the profiler
    keeps every event in host memory until it stops."""
    stall_seconds: float = 300.0
    """An engine call that makes no progress for this long marks the worker not ready
    (the router stops sending it work) until it moves again."""
