"""The `omnipipe` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from omnipipe.api import ManifestError, load_file
from omnipipe.api.yamlio import dump_all


def _cmd_crd(args: argparse.Namespace) -> int:
    from omnipipe.api.crd import render_crd_yaml

    sys.stdout.write(render_crd_yaml())
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    from omnipipe.operator.builders import build_children, build_context
    from omnipipe.operator.settings import OperatorSettings

    resource = load_file(args.file)
    if args.namespace:
        meta = resource.metadata.model_copy(update={"namespace": args.namespace})
        resource = resource.model_copy(update={"metadata": meta})
    children = build_children(build_context(resource, OperatorSettings()))
    sys.stdout.write(
        "# Rendered by `omnipipe render`: what the operator applies. It adds\n"
        "# metadata.ownerReferences, which need the live object's uid.\n"
    )
    sys.stdout.write(dump_all(children))
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    from omnipipe.operator.handlers import run_operator
    from omnipipe.operator.settings import OperatorSettings

    run_operator(OperatorSettings())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnipipe",
        description="Serve omni-modality models as independently scaled, streaming stages.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    crd = sub.add_parser("crd", help="print the OmniPipeline CustomResourceDefinition")
    crd.set_defaults(run=_cmd_crd)

    render = sub.add_parser(
        "render", help="print the manifests the operator would apply for FILE (no cluster)"
    )
    render.add_argument("file", metavar="FILE", help="an OmniPipeline manifest")
    render.add_argument("-n", "--namespace", help="namespace to render into")
    render.set_defaults(run=_cmd_render)

    operator = sub.add_parser(
        "operator", help="run the Kubernetes operator (settings: OMNIPIPE_OPERATOR_* env vars)"
    )
    operator.set_defaults(run=_cmd_operator)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except ManifestError as exc:
        print(f"omnipipe: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
