"""Names, label keys and ports that the operator, router and workers agree on."""

from typing import Final

GROUP: Final = "omnipipe.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "OmniPipeline"
PLURAL: Final = "omnipipelines"
SINGULAR: Final = "omnipipeline"
SHORT_NAMES: Final = ("omnip",)

LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_PIPELINE: Final = "omnipipe.io/pipeline"
LABEL_STAGE: Final = "omnipipe.io/stage"
# The pipeline revision (omnipipe.api.revision) a stage workload and its pods belong to.
LABEL_REVISION: Final = "omnipipe.io/revision"
# The revision of what an omnipipe made before revisions existed: stage Deployments
# `<pipeline>-<stage>` and the ConfigMap `<pipeline>-config`, with no revision label. An
# upgrade treats them as the serving revision and retires them once a real one is ready.
# A real revision is hex (api/revision.py), so it never reads "legacy".
LEGACY_REVISION: Final = "legacy"
ANNOTATION_CONFIG_HASH: Final = "omnipipe.io/config-hash"
# On a weights claim and its fetch Job (and the Job's pods): which cache they are.
LABEL_MODEL_CACHE: Final = "omnipipe.io/model-cache"
COMPONENT_WEIGHTS: Final = "weights"

APP_NAME: Final = "omnipipe"
MANAGER: Final = "omnipipe-operator"
COMPONENT_STAGE: Final = "stage"
COMPONENT_ROUTER: Final = "router"

ROUTER_PORT: Final = 8000
WORKER_CONTROL_PORT: Final = 8100
WORKER_TRANSFER_PORT: Final = 8101

# Pod-side path where the ConfigMap with the resolved pipeline is mounted.
CONFIG_DIR: Final = "/etc/omnipipe"
CONFIG_FILE: Final = "pipeline.yaml"

# Kubernetes object names are DNS-1035 labels: at most 63 characters.
MAX_OBJECT_NAME: Final = 63
# Longest suffix the operator appends to a pipeline name ("-router", "-config").
LONGEST_FIXED_SUFFIX: Final = len("-router")
DNS_LABEL_PATTERN: Final = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_STAGES: Final = 16
MAX_INPUTS: Final = 8
MAX_BATCH: Final = 256
MAX_BATCH_WAIT_MS: Final = 1000
# Batching defaults: every stage that batches runs up to DEFAULT_MAX_BATCH requests in
# one call; denoisers hold a short batch DEFAULT_DENOISER_BATCH_WAIT_MS for requests
# already on their way (bench/throughput.py measured the window).
DEFAULT_MAX_BATCH: Final = 8
DEFAULT_DENOISER_BATCH_WAIT_MS: Final = 20

# The per-pipeline credential: every worker control call and every transfer connection
# carries it. The operator keeps it in a Secret (key CREDENTIAL_SECRET_KEY) and passes it
# to the pods as CREDENTIAL_ENV; `omnipipe serve` generates one per run.
CREDENTIAL_ENV: Final = "OMNIPIPE_PIPELINE_CREDENTIAL"
# The Redis a video pipeline's routers keep their jobs in (the router's video_store
# setting): the operator and `omnipipe serve` hand it to the router by this name.
VIDEO_STORE_ENV: Final = "OMNIPIPE_ROUTER_VIDEO_STORE"
CREDENTIAL_HEADER: Final = "X-Omnipipe-Credential"
CREDENTIAL_SECRET_KEY: Final = "credential"

# How long the router and the workers keep an idle HTTP connection open. A client that
# keeps one longer than its server does can send a request on a connection the server
# is closing that instant, and the request fails as if the replica had died: so the
# router's pool to the workers lets one go well before a worker would, and the servers
# outlast the common clients (httpx 5 s, aiohttp 15 s, a cloud load balancer's 60 s).
SERVER_KEEP_ALIVE_SECONDS: Final = 75
UPSTREAM_KEEP_ALIVE_SECONDS: Final = 30
