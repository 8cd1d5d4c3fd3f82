"""The ConfigMap holding the resolved pipeline that every pod mounts read-only."""

from __future__ import annotations

from omnipipe.api import constants as c
from omnipipe.api.loading import pipeline_yaml
from omnipipe.api.names import common_labels, config_object_name
from omnipipe.operator.builders.common import Manifest, object_meta
from omnipipe.operator.builders.context import BuildContext


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
