"""Child object names and labels, built in one place so every component agrees."""

from omnipipe.api import constants as c


def stage_object_name(pipeline: str, stage: str) -> str:
    """Name of a stage's Deployment and headless Service."""
    return f"{pipeline}-{stage}"


def router_object_name(pipeline: str) -> str:
    """Name of the router's Deployment and Service."""
    return f"{pipeline}-router"


def config_object_name(pipeline: str) -> str:
    """Name of the ConfigMap holding the resolved pipeline."""
    return f"{pipeline}-config"


def credential_secret_name(pipeline: str) -> str:
    """Name of the Secret holding the pipeline credential (key CREDENTIAL_SECRET_KEY)."""
    return f"{pipeline}-credential"


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
    """Immutable Deployment selector (and Service selector) of one stage's pods."""
    return {c.LABEL_PIPELINE: pipeline, c.LABEL_STAGE: stage}


def stage_labels(pipeline: str, stage: str) -> dict[str, str]:
    return {**common_labels(pipeline, c.COMPONENT_STAGE), c.LABEL_STAGE: stage}


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
