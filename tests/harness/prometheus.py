"""Debian's prometheus, by default on loopback scraping targets listed in a file the test
edits; the real node runs it inside its network namespace with Kubernetes service
discovery instead."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from omnipipe.local.ports import free_port


@dataclass
class Prometheus:
    url: str
    targets_file: Path
    proc: subprocess.Popen[bytes]
    log: IO[bytes]

    def set_targets(self, groups: list[dict[str, Any]]) -> None:
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.rename(self.targets_file)

    def query(self, expr: str) -> Any:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=5) as r:
            return json.loads(r.read())["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> Any:
        """The matrix /api/v1/query_range answers (a list of {metric, values}); a query
        Prometheus rejects raises with its reason, not a bare HTTP 400."""
        return self._get(
            "/api/v1/query_range",
            {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"},
        )["result"]

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts the rules hold now, pending or firing (/api/v1/alerts)."""
        alerts: list[dict[str, Any]] = self._get("/api/v1/alerts", {})["alerts"]
        return alerts

    def _get(self, path: str, params: dict[str, str]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return json.loads(r.read())["data"]
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path} {params}: {exc.code} {exc.read().decode()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.log.close()


@contextlib.contextmanager
def prometheus(
    workdir: Path,
    *,
    scrape_configs: str | None = None,
    listen: str | None = None,
    wrapper: Sequence[str] = (),
    binary: str | None = None,
    rule_files: Sequence[Path] = (),
) -> Iterator[Prometheus]:
    """scrape_configs: YAML of the `scrape_configs:` list (default: one job over the
    targets file); listen: host:port (default: a free loopback port); wrapper: argv that
    runs the server (nsenter into a network namespace); binary: default Debian's;
    rule_files: alerting and recording rule files, copied into workdir and loaded
    (evaluated every second, as targets are scraped)."""
    binary = binary or shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus not found: install Debian's prometheus (make test does)")
    workdir.mkdir(parents=True, exist_ok=True)
    targets = workdir / "targets.json"
    targets.write_text("[]")
    if scrape_configs is None:
        scrape_configs = (
            "  - job_name: omnipipe\n"
            "    file_sd_configs: [{files: ['" + str(targets) + "'], refresh_interval: 1s}]\n"
        )
    rules = []
    for i, source in enumerate(rule_files):
        rules.append(workdir / f"rules-{i}-{source.name}")
        shutil.copyfile(source, rules[-1])
    config = workdir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        + (f"rule_files: {json.dumps([str(r) for r in rules])}\n" if rules else "")
        + "scrape_configs:\n"
        + scrape_configs
    )
    listen = listen or f"127.0.0.1:{free_port()}"
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            *wrapper,
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address={listen}",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://{listen}", targets, proc, log)
    try:
        deadline = time.monotonic() + 30
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{prom.url}/-/ready", timeout=1) as r,
            ):
                if r.status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((workdir / "prometheus.log").read_text()[-2000:])
            time.sleep(0.2)
        yield prom
    finally:
        prom.stop()
