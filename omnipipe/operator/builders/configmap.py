"""The ConfigMap holding the resolved pipeline that every pod mounts read-only."""

from __future__ import annotations

import yaml

from omnipipe.api import ResolvedPipeline
from omnipipe.api import constants as c
from omnipipe.api.names import common_labels, config_object_name
from omnipipe.operator.builders.common import Manifest, object_meta
from omnipipe.operator.builders.context import BuildContext


def pipeline_yaml(pipeline: ResolvedPipeline) -> str:
    return yaml.safe_dump(pipeline.model_dump(mode="json"), sort_keys=False)


def build_config_map(ctx: BuildContext) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(
            ctx,
            config_object_name(ctx.name, ctx.revision),
            {**common_labels(ctx.name, "config"), c.LABEL_REVISION: ctx.revision},
        ),
        "data": {c.CONFIG_FILE: pipeline_yaml(ctx.pipeline)},
    }
