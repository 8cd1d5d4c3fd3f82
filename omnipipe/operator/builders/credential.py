"""The Secret holding a pipeline's credential.

The value comes in from the reconcile layer (builders use no randomness), which creates
the Secret once and never writes it again: see reconcile.ensure_credential."""

from __future__ import annotations

from omnipipe.api import constants as c
from omnipipe.api.names import common_labels, credential_secret_name
from omnipipe.operator.builders.common import Manifest, object_meta
from omnipipe.operator.builders.context import BuildContext

COMPONENT_CREDENTIAL = "credential"


def build_credential_secret(ctx: BuildContext, credential: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(
            ctx,
            credential_secret_name(ctx.name),
            common_labels(ctx.name, COMPONENT_CREDENTIAL),
        ),
        "type": "Opaque",
        "stringData": {c.CREDENTIAL_SECRET_KEY: credential},
    }
