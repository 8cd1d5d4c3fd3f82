"""Debian's prometheus on loopback, scraping targets listed in a file the test edits."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
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

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.log.close()


@contextlib.contextmanager
def prometheus(workdir: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus not found: install Debian's prometheus (make test does)")
    workdir.mkdir(parents=True, exist_ok=True)
    targets = workdir / "targets.json"
    targets.write_text("[]")
    config = workdir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: omnipipe\n"
        "    file_sd_configs: [{files: ['" + str(targets) + "'], refresh_interval: 1s}]\n"
    )
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}", targets, proc, log)
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
