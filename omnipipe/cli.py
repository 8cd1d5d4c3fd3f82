"""The `omnipipe` command."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from omnipipe.api import ManifestError, OmniPipeline, load_file
from omnipipe.api.families import FamilyError
from omnipipe.api.yamlio import dump, dump_all

if TYPE_CHECKING:
    from omnipipe.api import ResolvedPipeline

MAX_PORT = 65535


def port_number(text: str) -> int:
    """An argparse type: a TCP port a server can listen on (1 to 65535)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 1 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{port} is not a port: give 1 to {MAX_PORT}")
    return port


def port_list(text: str) -> tuple[int, ...]:
    """An argparse type: ports separated by commas ("8101,8102")."""
    return tuple(port_number(part.strip()) for part in text.split(","))


def otlp_endpoint(text: str) -> str:
    """An argparse type: an OTLP/HTTP collector's base URL, as spec.tracing.endpoint."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an OTLP/HTTP endpoint: give http(s)://HOST:PORT, e.g. "
            "http://127.0.0.1:4318"
        )
    return text


def positive_int(text: str) -> int:
    """An argparse type: a count of one or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def _cmd_crd(args: argparse.Namespace) -> int:
    from omnipipe.api.crd import render_crd_yaml

    sys.stdout.write(render_crd_yaml())
    return 0


def _cmd_families(args: argparse.Namespace) -> int:
    """The installed families (entry point group omnipipe.families), a block each."""
    from omnipipe.api.families import installed_families

    for family in installed_families().values():
        print(f"{family.name}  (from {family.package or 'an unnamed package'})")
        print(f"  {family.description}")
        for p in family.pipelines:
            graph = " -> ".join(f"{s.name} ({s.role.value} on {s.engine.value})" for s in p.stages)
            print(f"  pipeline {p.name}: {graph}")
            if p.checkpoints:
                print(f"    checkpoints: {', '.join(p.checkpoints)}")
            if p.example_models:
                print(f"    e.g. {', '.join(p.example_models)}")
        if family.tiny_models:
            print(f"  tiny models: {', '.join(f'tiny://{n}' for n in family.tiny_models)}")
    return 0


def _is_file(target: str) -> bool:
    return Path(target).expanduser().is_file()


def _manifest_for_model(model: str) -> OmniPipeline:
    """The OmniPipeline for MODEL (a tiny:// name, a local checkpoint or a Hub id), from
    what its checkpoint says it is."""
    from omnipipe.api.from_model import checkpoint_descriptors, manifest_for_model
    from omnipipe.api.resolve import is_tiny
    from omnipipe.checkpoints.tiny import resolve_model_path

    if is_tiny(model):
        try:
            checkpoint = resolve_model_path(model)  # built once, then read like any other
        except ValueError as exc:
            raise ManifestError(str(exc)) from None
    else:
        checkpoint = model
    return manifest_for_model(model, checkpoint_descriptors(checkpoint))


def _manifest_yaml(resource: OmniPipeline) -> str:
    return dump(resource.model_dump(mode="json", by_alias=True, exclude_unset=True))


def _cmd_render(args: argparse.Namespace) -> int:
    from omnipipe.operator.builders import build_children, build_context
    from omnipipe.operator.settings import OperatorSettings

    if not _is_file(args.file):
        manifest = _manifest_yaml(_manifest_for_model(args.file))
        sys.stdout.write(
            f"# The OmniPipeline `omnipipe serve {args.file}` runs: keep it, change it,\n"
            "# `omnipipe serve FILE` or `kubectl apply -f FILE` it.\n" + manifest
        )
        return 0
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
    from omnipipe.api.families import load_installed
    from omnipipe.operator.handlers import run_operator
    from omnipipe.operator.settings import OperatorSettings

    load_installed()
    run_operator(OperatorSettings())
    return 0


def _overrides(args: argparse.Namespace, names: Sequence[str]) -> dict[str, object]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


WORKER_FLAGS = (
    *("stage", "group", "host", "port", "transfer_port", "transfer_ports"),
    *("advertise_host", "threads"),
)


def _cmd_worker(args: argparse.Namespace) -> int:
    import os

    from omnipipe.api.loading import load_pipeline
    from omnipipe.worker.settings import WorkerSettings
    from omnipipe.worker.threads import (
        apply_thread_budget,
        group_budget,
        group_teams,
        process_team,
        thread_budget,
    )

    values = _overrides(args, WORKER_FLAGS)
    values["pipeline_file"] = args.pipeline
    if "advertise_host" not in values and os.environ.get("OMNIPIPE_POD_IP"):
        values["advertise_host"] = os.environ["OMNIPIPE_POD_IP"]
    settings = WorkerSettings(**values)  # type: ignore[arg-type]
    pipeline = load_pipeline(settings.pipeline_file)
    if settings.group:
        groups = {g.name: g for g in pipeline.groups}
        if settings.group not in groups:
            known = ", ".join(groups) or "none"
            raise SystemExit(f"omnipipe worker: no group {settings.group!r} (groups: {known})")
        # The process's budget, fixed now: the environment this sets next would else be
        # read back as the budget when the stages split it.
        settings = settings.model_copy(update={"threads": group_budget(settings.threads)})
        assert settings.threads is not None
        teams = group_teams(pipeline, groups[settings.group].stages, settings.threads)
        threads = process_team(pipeline, teams)
    else:
        threads = thread_budget(settings.threads, pipeline.stage(settings.stage).cpu)
    # Before torch loads (run_worker's imports): OpenMP sizes every thread's team from it.
    apply_thread_budget(threads)
    from omnipipe.worker.main import run_worker

    run_worker(settings)
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    from omnipipe.api.families import load_installed
    from omnipipe.router.main import run_router
    from omnipipe.router.settings import RouterSettings

    load_installed()
    values = _overrides(args, ("host", "port", "replicas_file"))
    values["pipeline_file"] = args.pipeline
    run_router(RouterSettings(**values))  # type: ignore[arg-type]
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    if _is_file(args.file):
        return _serve_file(Path(args.file).resolve(), args)
    resource = _manifest_for_model(args.file)
    print(
        f"omnipipe: serving {args.file} as a {resource.spec.pipeline} pipeline named "
        f"{resource.metadata.name!r} (`omnipipe render {args.file}` prints its file)",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="omnipipe-serve-") as directory:
        path = Path(directory) / f"{resource.metadata.name}.yaml"
        path.write_text(_manifest_yaml(resource))
        return _serve_file(path, args)


def _serve_file(path: Path, args: argparse.Namespace) -> int:
    from omnipipe.api.loading import load_pipeline
    from omnipipe.local.serve import serve
    from omnipipe.worker.stage_classes import unimplemented_stages

    def load(path: Path) -> ResolvedPipeline:
        """What serve starts from and what SIGHUP reloads: a pipeline it can run."""
        pipeline = load_pipeline(path)
        missing = unimplemented_stages(pipeline)
        if missing:
            raise ManifestError(
                f"{path}: this omnipipe cannot run these stages yet: {', '.join(missing)}"
            )
        if args.otlp_endpoint:
            tracing = pipeline.tracing.model_copy(update={"endpoint": args.otlp_endpoint})
            pipeline = pipeline.model_copy(update={"tracing": tracing})
        return pipeline

    return serve(load(path), path, args.host, args.port, args.ready_timeout, load)


def _cmd_fetch(args: argparse.Namespace) -> int:
    import logging

    from omnipipe.checkpoints.fetch import FetchError, fetch

    logging.basicConfig(level=logging.INFO, format="omnipipe fetch: %(message)s")
    print(f"omnipipe fetch: {args.model} into {args.dir}", file=sys.stderr)
    try:
        fetch(args.model, Path(args.dir), args.revision)
    except FetchError as exc:
        # The last line names the reason, for whoever runs this (a Job, a script).
        report = f"omnipipe fetch: {exc}\nreason: {exc.reason}"
        print(report, file=sys.stderr)
        if args.termination_log:
            # In a Job: the kubelet hands this file to the operator as the container's
            # termination message, which it shows in the ModelCached condition.
            Path(args.termination_log).write_text(report + "\n")
        return 3
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnipipe",
        description="Serve omni-modality models as independently scaled, streaming stages.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    crd = sub.add_parser("crd", help="print the OmniPipeline CustomResourceDefinition")
    crd.set_defaults(run=_cmd_crd)

    families = sub.add_parser(
        "families",
        help="list the installed model families and the pipeline types each registers",
    )
    families.set_defaults(run=_cmd_families)

    render = sub.add_parser(
        "render",
        help="print the manifests the operator would apply for FILE (no cluster), or the "
        "OmniPipeline that `omnipipe serve MODEL` would run",
    )
    render.add_argument(
        "file", metavar="FILE|MODEL", help="an OmniPipeline manifest, or a model as for serve"
    )
    render.add_argument("-n", "--namespace", help="namespace to render into")
    render.set_defaults(run=_cmd_render)

    operator = sub.add_parser(
        "operator", help="run the Kubernetes operator (settings: OMNIPIPE_OPERATOR_* env vars)"
    )
    operator.set_defaults(run=_cmd_operator)

    serve = sub.add_parser(
        "serve", help="run FILE (or MODEL, with no file) on this machine: router + stage workers"
    )
    serve.add_argument(
        "file",
        metavar="FILE|MODEL",
        help="an OmniPipeline manifest; or a model: a Hugging Face id, a local checkpoint "
        "directory or tiny://NAME, whose checkpoint says which pipeline type it is",
    )
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=8000, help="router port (default 8000)")
    serve.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every process to be ready",
    )
    serve.add_argument(
        "--otlp-endpoint",
        type=otlp_endpoint,
        metavar="URL",
        help="export a trace of every request over OTLP/HTTP to this collector, e.g. "
        "http://127.0.0.1:4318 (overrides the file's spec.tracing.endpoint)",
    )
    serve.set_defaults(run=_cmd_serve)

    fetch = sub.add_parser(
        "fetch",
        help="put MODEL's files into DIR, whole or not at all (a Hub id or tiny://NAME; "
        "HF_TOKEN for gated or private models)",
    )
    fetch.add_argument("model", metavar="MODEL")
    fetch.add_argument("dir", metavar="DIR", help="made by renaming a complete download")
    fetch.add_argument("--revision", help="a Hub branch, tag or commit (default: main)")
    fetch.add_argument(
        "--termination-log",
        metavar="FILE",
        help="on failure, also write the message and reason here (/dev/termination-log)",
    )
    fetch.set_defaults(run=_cmd_fetch)

    worker = sub.add_parser("worker", help="run one stage's worker")
    worker.add_argument("--pipeline", required=True, help="pipeline file")
    runs = worker.add_mutually_exclusive_group(required=True)
    runs.add_argument("--stage", help="stage name")
    runs.add_argument("--group", help="a colocated group's name (spec.placement): its stages")
    worker.add_argument("--host")
    worker.add_argument("--port", type=port_number, help="control API port (default 8100)")
    worker.add_argument("--transfer-port", type=port_number, help="transfer port (default 8101)")
    worker.add_argument(
        "--transfer-ports",
        type=port_list,
        help="a group's transfer ports, one per stage in order (default 8101, 8102, ...)",
    )
    worker.add_argument("--advertise-host", help="host other stages reach this one at")
    worker.add_argument(
        "--threads",
        type=positive_int,
        help="CPU threads of the engine (default: resources.cpu, else the usable CPUs)",
    )
    worker.set_defaults(run=_cmd_worker)

    router = sub.add_parser("router", help="run the OpenAI-compatible router")
    router.add_argument("--pipeline", required=True, help="pipeline file")
    router.add_argument("--host")
    router.add_argument("--port", type=port_number, help="HTTP port (default 8000)")
    router.add_argument("--replicas-file", help="static discovery JSON {stage: [urls]}")
    router.set_defaults(run=_cmd_router)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except (ManifestError, FamilyError) as exc:
        print(f"omnipipe: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        if not exc.title.endswith("Settings"):
            raise
        for line in _settings_problems(exc):
            print(f"omnipipe {args.command}: {line}", file=sys.stderr)
        return 2
    return code


def _settings_problems(exc: ValidationError) -> list[str]:
    """A settings class's refusals, each naming the variable to fix
    (OMNIPIPE_ROUTER_API_KEY for RouterSettings.api_key), without a traceback."""
    prefix = f"OMNIPIPE_{exc.title.removesuffix('Settings').upper()}_"
    lines = []
    for error in exc.errors(include_url=False, include_input=False):
        name = str(error["loc"][0]) if error["loc"] else ""
        variable = name if name.isupper() else prefix + name.upper()
        lines.append(f"{variable}: {error['msg'].removeprefix('Value error, ')}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
