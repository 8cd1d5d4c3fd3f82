"""Child object names and labels, built in one place so every component agrees."""

from omnipipe.api import constants as c


def stage_object_name(pipeline: str, stage: str) -> str:
    """Name of a stage's headless Service (every revision's ready pods) and scaler."""
    return f"{pipeline}-{stage}"


def stage_deployment_name(pipeline: str, stage: str, revision: str) -> str:
    """Name of one revision's Deployment of a stage. A Deployment name may be a DNS
    subdomain (253 characters), so the revision suffix needs no room in the 63. The
    legacy revision's is the name an omnipipe before revisions gave it."""
    if revision == c.LEGACY_REVISION:
        return stage_object_name(pipeline, stage)
    return f"{pipeline}-{stage}-{revision}"


def router_object_name(pipeline: str) -> str:
    """Name of the router's Deployment and Service."""
    return f"{pipeline}-router"


def config_object_name(pipeline: str, revision: str) -> str:
    """Name of the ConfigMap holding one revision's resolved pipeline: old pods keep
    reading their own revision's file while a new one rolls out."""
    return f"{pipeline}-config-{revision}"


def credential_secret_name(pipeline: str) -> str:
    """Name of the Secret holding the pipeline credential (key CREDENTIAL_SECRET_KEY)."""
    return f"{pipeline}-credential"


def weights_claim_name(pipeline: str, cache_key: str) -> str:
    """Name of the claim the operator fills with one model (weights.source cache). A
    claim's name may be a DNS subdomain, so the key needs no room in the 63."""
    return f"{pipeline}-weights-{cache_key}"


def fetch_job_name(pipeline: str, cache_key: str) -> str:
    """Name of the Job that fills one claim. The Job controller copies it into a label
    value, so it must fit in 63: the pipeline name is cut where it must be, and the key
    (a hash that covers the whole pipeline name) keeps it unique."""
    suffix = f"-fetch-{cache_key}"
    return f"{pipeline[: c.MAX_OBJECT_NAME - len(suffix)]}{suffix}"


def stage_network_policy_name(pipeline: str) -> str:
    """Name of the NetworkPolicy that admits traffic to the pipeline's stage pods."""
    return f"{pipeline}-stages"


def common_labels(pipeline: str, component: str) -> dict[str, str]:
    """Labels on every child object of a pipeline."""
    return {
        c.LABEL_NAME: c.APP_NAME,
        c.LABEL_INSTANCE: pipeline,
        c.LABEL_COMPONENT: component,
        c.LABEL_MANAGED_BY: c.MANAGER,
        c.LABEL_PIPELINE: pipeline,
    }


def stage_selector(pipeline: str, stage: str) -> dict[str, str]:
    """Service selector of one stage's pods, of every revision: the router tells the
    revisions apart by what each replica reports."""
    return {c.LABEL_PIPELINE: pipeline, c.LABEL_STAGE: stage}


def stage_revision_selector(pipeline: str, stage: str, revision: str) -> dict[str, str]:
    """Immutable Deployment selector of one revision's pods of a stage."""
    return {**stage_selector(pipeline, stage), c.LABEL_REVISION: revision}


def stage_labels(pipeline: str, stage: str, revision: str | None = None) -> dict[str, str]:
    labels = {**common_labels(pipeline, c.COMPONENT_STAGE), c.LABEL_STAGE: stage}
    if revision is not None:
        labels[c.LABEL_REVISION] = revision
    return labels


def stages_selector(pipeline: str) -> dict[str, str]:
    """Every stage pod of the pipeline."""
    return {c.LABEL_PIPELINE: pipeline, c.LABEL_COMPONENT: c.COMPONENT_STAGE}


def router_selector(pipeline: str) -> dict[str, str]:
    return {c.LABEL_PIPELINE: pipeline, c.LABEL_COMPONENT: c.COMPONENT_ROUTER}


def router_labels(pipeline: str) -> dict[str, str]:
    return common_labels(pipeline, c.COMPONENT_ROUTER)


def stage_condition_type(stage: str) -> str:
    """Per-stage condition type, e.g. ``code2wav`` -> ``StageCode2wavReady``."""
    camel = "".join(part[:1].upper() + part[1:] for part in stage.split("-"))
    return f"Stage{camel}Ready"
