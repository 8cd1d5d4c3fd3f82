"""Where a pipeline's stage pods find the model weights (spec.weights, issue #18).

Four sources, one field: every pod downloads them (the default, as before), an existing
PersistentVolumeClaim holds them, a claim the operator creates and fills once per model
revision with a fetch Job, or an OCI image mounted as a volume. The CRD's CEL rules
(api/crd.py) mirror the validator below, so `omnipipe serve` and the API server refuse
the same manifests.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from omnipipe.api.spec_base import DnsLabel, Quantity, SpecModel

# A relative path inside a claim or an image: no leading '/', no '..' segment.
RELATIVE_PATH_PATTERN = r"^(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+$"
ACCESS_MODE_PATTERN = r"^(ReadWriteOnce|ReadOnlyMany|ReadWriteMany|ReadWriteOncePod)$"


class WeightsSource(StrEnum):
    DOWNLOAD = "download"
    CLAIM = "claim"
    CACHE = "cache"
    IMAGE = "image"


class HubTokenRef(SpecModel):
    """A Secret key holding a Hugging Face Hub token, in the pipeline's namespace."""

    name: DnsLabel
    """Secret name."""
    key: Annotated[str, Field(min_length=1, max_length=253)] = "token"
    """Key inside the Secret."""


class Weights(SpecModel):
    """Where the stage pods find the model's weights."""

    source: WeightsSource = WeightsSource.DOWNLOAD
    """download: every pod downloads the model into its own emptyDir (the default);
    claim: an existing PersistentVolumeClaim already holds it (claimName, path);
    cache: the operator creates a claim per model and fills it once with a fetch Job,
    and stage pods start only once it is complete; image: an OCI image mounted as a
    volume (needs Kubernetes' ImageVolume feature). Pods mount claim, cache and image
    read-only."""
    claim_name: DnsLabel | None = None
    """source claim: the existing PersistentVolumeClaim holding the weights (filled, for
    example, by `omnipipe fetch MODEL DIR` in a pod that mounts it)."""
    image: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    """source image: reference of the OCI image (artifact) holding the weights."""
    path: Annotated[str, Field(pattern=RELATIVE_PATH_PATTERN, max_length=255)] | None = None
    """source claim or image: directory inside the volume holding the model of
    spec.model; the volume's root when unset. Stages with another model download theirs."""
    size: Quantity | None = None
    """source cache: storage of each model's claim, e.g. 60Gi: the model's size plus 10%."""
    storage_class_name: DnsLabel | None = None
    """source cache: StorageClass of the claims; the cluster's default when unset."""
    access_modes: (
        Annotated[
            list[Annotated[str, Field(pattern=ACCESS_MODE_PATTERN)]],
            Field(min_length=1, max_length=4),
        ]
        | None
    ) = None
    """source cache: access modes of the claims; [ReadWriteOnce] when unset (one node at a
    time: the fetch, then the stage pods, all on one node). Pods on several nodes need
    ReadOnlyMany (with ReadWriteOnce, for the fetch) or ReadWriteMany."""
    revision: Annotated[str, Field(min_length=1, max_length=255)] | None = None
    """source cache: Hub branch, tag or commit to fetch; main when unset. A new revision is
    a new claim, filled beside the old one."""
    hub_token_secret_ref: HubTokenRef | None = None
    """Secret key with a Hugging Face Hub token, given to the fetch Job (cache) or to the
    stage pods (download) as HF_TOKEN. The token never appears in the spec."""

    @model_validator(mode="after")
    def _fields_match_source(self) -> Weights:
        for problem in weights_problems(self):
            raise ValueError(problem)
        return self


# (field, the sources it belongs to): each rule is one CEL rule in the CRD too.
SOURCE_FIELDS: tuple[tuple[str, str, tuple[WeightsSource, ...]], ...] = (
    ("claim_name", "claimName", (WeightsSource.CLAIM,)),
    ("image", "image", (WeightsSource.IMAGE,)),
    ("path", "path", (WeightsSource.CLAIM, WeightsSource.IMAGE)),
    ("size", "size", (WeightsSource.CACHE,)),
    ("storage_class_name", "storageClassName", (WeightsSource.CACHE,)),
    ("access_modes", "accessModes", (WeightsSource.CACHE,)),
    ("revision", "revision", (WeightsSource.CACHE,)),
)
# (source, the field it needs)
REQUIRED_FIELDS: tuple[tuple[WeightsSource, str, str], ...] = (
    (WeightsSource.CLAIM, "claim_name", "claimName"),
    (WeightsSource.IMAGE, "image", "image"),
    (WeightsSource.CACHE, "size", "size"),
)


def weights_problems(weights: Weights) -> list[str]:
    problems = [
        f"weights.{wire} is required when weights.source is {source.value}"
        for source, attr, wire in REQUIRED_FIELDS
        if weights.source is source and getattr(weights, attr) is None
    ]
    problems += [
        f"weights.{wire} applies only to weights.source {' or '.join(s.value for s in sources)}"
        for attr, wire, sources in SOURCE_FIELDS
        if getattr(weights, attr) is not None and weights.source not in sources
    ]
    return problems


def _source_is(sources: tuple[WeightsSource, ...]) -> str:
    """CEL: the (possibly absent, then download) source is one of these."""
    names = ", ".join(f"'{s.value}'" for s in sources)
    if WeightsSource.DOWNLOAD in sources:
        return f"(!has(self.source) || self.source in [{names}])"
    return f"(has(self.source) && self.source in [{names}])"


def weights_cel_rules() -> list[dict[str, str]]:
    """The validator's rules as CEL, for the CRD's spec.weights."""
    rules = [
        {
            "rule": f"!{_source_is((source,))} || has(self.{wire})",
            "message": f"{wire} is required when source is {source.value}",
            "fieldPath": f".{wire}",
            "reason": "FieldValueRequired",
        }
        for source, _, wire in REQUIRED_FIELDS
    ]
    rules += [
        {
            "rule": f"!has(self.{wire}) || {_source_is(sources)}",
            "message": f"{wire} applies only to source {' or '.join(s.value for s in sources)}",
            "fieldPath": f".{wire}",
            "reason": "FieldValueForbidden",
        }
        for _, wire, sources in SOURCE_FIELDS
    ]
    return rules


# Pod-side directory where stage pods mount the weights volume read-only.
WEIGHTS_DIR = "/var/lib/omnipipe/weights"
# Inside an operator-filled claim: the directory `omnipipe fetch` makes (its staging
# directory, .model.partial, sits beside it on the same volume).
CACHE_MODEL_DIR = "model"
# The condition the operator keeps while it fills claims (source cache only).
MODEL_CACHED = "ModelCached"
