"""A real Kubernetes control plane on loopback for tests: etcd, kube-apiserver,
kube-controller-manager, and on request kube-scheduler plus kwok for Running pods.

Binaries come from hack/build-k8s.sh (built from the official Go modules and cached
under ~/.cache/omnipipe/k8s/<version>/bin); etcd from Debian's etcd-server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from omnipipe.local.ports import free_port
from tests.harness.kwok_stages import write_config

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = os.environ.get("K8S_VERSION", "v1.34.4")
CACHE = Path(os.environ.get("OMNIPIPE_K8S_CACHE", Path.home() / ".cache/omnipipe/k8s"))
BIN = CACHE / K8S_VERSION / "bin"
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"


def ensure_binaries() -> Path:
    """Build (or find cached) Kubernetes binaries, streaming the build's progress."""
    needed = ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok"]
    if (
        not all((BIN / b).exists() for b in needed)
        or not (BIN.parent / "kwok-stages.yaml").exists()
    ):
        print(f"building Kubernetes {K8S_VERSION} binaries (first run only)", file=sys.stderr)
        subprocess.run(
            ["bash", str(REPO / "hack/build-k8s.sh")],
            check=True,
            stdout=sys.stderr,
            env={**os.environ, "K8S_VERSION": K8S_VERSION},
        )
    etcd = shutil.which("etcd")
    if etcd is None:
        raise RuntimeError("etcd not found: install Debian's etcd-server (make test does)")
    return BIN


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path, extra_ips: tuple[str, ...] = ()) -> None:
    """A CA, the apiserver's serving cert (for loopback, the Service IP and extra_ips), an
    admin client cert and the SA key pair."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-subj",
        "/CN=omnipipe-test-ca",
        cwd=d,
    )
    (d / "san.cnf").write_text(
        "[req]\ndistinguished_name=dn\n[dn]\n[ext]\n"
        "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,"
        + "".join(f"IP:{ip}," for ip in extra_ips)
        + "DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
        "extendedKeyUsage=serverAuth\n"
    )
    for name, subj, ext in (
        ("apiserver", "/CN=kube-apiserver", ["-extfile", "san.cnf", "-extensions", "ext"]),
        ("admin", "/O=system:masters/CN=admin", []),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            subj,
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            f"{name}.crt",
            *ext,
            cwd=d,
        )
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def kubeconfig_text(server: str, ca: Path, user: dict[str, str]) -> str:
    creds = "\n".join(f"    {k}: {v}" for k, v in user.items())
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: test\n  cluster:\n    server: {server}\n"
        f"    certificate-authority: {ca}\n"
        f"users:\n- name: user\n  user:\n{creds}\n"
        "contexts:\n- name: test\n  context: {cluster: test, user: user, namespace: default}\n"
        "current-context: test\n"
    )


@dataclass
class Cluster:
    workdir: Path
    server: str
    kubeconfig: Path
    bin_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, IO[bytes]] = field(default_factory=dict)

    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        return {
            **os.environ,
            # Debian's etcd 3.4 lacks the progress notifications that streaming watch
            # lists need: no client may ask for one (the API server's side: control_plane).
            "KUBE_FEATURE_WatchListClient": "false",
            "KUBECONFIG": str(kubeconfig or self.kubeconfig),
            "PATH": f"{self.bin_dir}:{os.environ['PATH']}",
        }

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        kubeconfig: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.bin_dir / "kubectl"), *args],
            env=self.env(kubeconfig),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{proc.stderr}{proc.stdout}")
        return proc

    def wait_crd_established(self, name: str, timeout: float = 60) -> None:
        """Poll, because `kubectl wait --for=condition=Established` fails outright, not
        waits, when it reads the CRD before the API server has set any condition."""
        query = '{.status.conditions[?(@.type=="Established")].status}'
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.kubectl("get", "crd", name, "-o", f"jsonpath={query}", check=False)
            if got.stdout.strip() == "True":
                return
            time.sleep(0.2)
        raise AssertionError(f"CRD {name} not Established after {timeout:.0f}s")

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.logs[name] = log
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
        )
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.workdir / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )

    def stop(self) -> None:
        try:
            for name in reversed(list(self.procs)):
                proc = self.procs.pop(name)
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            for log in self.logs.values():
                log.close()
            self.logs.clear()

    def add_fake_node(self, name: str = "kwok-node-0", gpus: int = 512) -> None:
        node = f"""apiVersion: v1
kind: Node
metadata:
  name: {name}
  annotations: {{{FAKE_NODE_ANNOTATION}: fake, node.alpha.kubernetes.io/ttl: "0"}}
  labels: {{type: kwok, kubernetes.io/hostname: {name}}}
status:
  allocatable: {{cpu: "1024", memory: 8Ti, pods: "2000", nvidia.com/gpu: "{gpus}"}}
  capacity: {{cpu: "1024", memory: 8Ti, pods: "2000", nvidia.com/gpu: "{gpus}"}}
"""
        self.kubectl("apply", "-f", "-", input=node)


def _wait_http(
    url: str,
    ctx: ssl.SSLContext | None,
    deadline: float,
    proc: subprocess.Popen[bytes],
    what: str,
    cluster: Cluster,
) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited:\n{cluster.log_tail(what)}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url, context=ctx, timeout=2) as resp,
        ):
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready at {url}:\n{cluster.log_tail(what)}")


def _component_flags(kubeconfig: Path, api_qps: int | None) -> list[str]:
    """What kube-controller-manager and kube-scheduler share: admin credentials, no
    leader election, their secure port on loopback, and their client rate limit."""
    limits = [f"--kube-api-qps={api_qps}", f"--kube-api-burst={2 * api_qps}"] if api_qps else []
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={free_port()}",
        *limits,
    ]


@contextlib.contextmanager
def control_plane(
    workdir: Path, *, with_pods: bool = False, controller_api_qps: int | None = None
) -> Iterator[Cluster]:
    """etcd + kube-apiserver + kube-controller-manager; with_pods adds kube-scheduler and
    kwok with one fake node, so pods get scheduled and turn Running and Ready.
    controller_api_qps: the controller-manager's and scheduler's client rate limit
    (default: theirs, 20 and 50 requests/s)."""
    bin_dir = ensure_binaries()
    workdir.mkdir(parents=True, exist_ok=True)
    make_certs(workdir)
    etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
    server = f"https://127.0.0.1:{api_port}"
    admin = workdir / "admin.kubeconfig"
    admin.write_text(
        kubeconfig_text(
            server,
            workdir / "ca.crt",
            {
                "client-certificate": str(workdir / "admin.crt"),
                "client-key": str(workdir / "admin.key"),
            },
        )
    )
    cluster = Cluster(workdir, server, admin, bin_dir)
    try:
        etcd = cluster.start(
            "etcd",
            [
                "etcd",
                "--data-dir",
                str(workdir / "etcd"),
                "--name",
                "test",
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
                "--initial-cluster",
                f"test=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )
        _wait_http(
            f"http://127.0.0.1:{etcd_port}/health",
            None,
            time.monotonic() + 30,
            etcd,
            "etcd",
            cluster,
        )
        api = cluster.start(
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={workdir / 'apiserver-certs'}",
                f"--tls-cert-file={workdir / 'apiserver.crt'}",
                f"--tls-private-key-file={workdir / 'apiserver.key'}",
                f"--client-ca-file={workdir / 'ca.crt'}",
                f"--service-account-key-file={workdir / 'sa.pub'}",
                f"--service-account-signing-key-file={workdir / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--authorization-mode=RBAC",
                "--endpoint-reconciler-type=none",
                # Without a node-lifecycle controller nothing would lift the not-ready taint
                # that TaintNodesByCondition puts on the fake node at creation.
                "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
                "--allow-privileged=false",
                # Debian's etcd 3.4.23 cannot answer progress requests, so the API server
                # fails every watch it would turn into a streaming list (any watch from
                # resourceVersion 0, which is how kwok watches pods); kwok then re-lists
                # only after exponential back-off, and pods took up to 40 s to turn Ready.
                # ImageVolume: weights.source image (off by default before 1.35, and the
                # API server drops image volumes from pods while it is off).
                "--feature-gates=WatchList=false,ImageVolume=true",
            ],
        )
        ca = ssl.create_default_context(cafile=str(workdir / "ca.crt"))
        ca.load_cert_chain(str(workdir / "admin.crt"), str(workdir / "admin.key"))
        _wait_http(f"{server}/readyz", ca, time.monotonic() + 90, api, "kube-apiserver", cluster)
        cluster.start(
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                *_component_flags(admin, controller_api_qps),
                f"--service-account-private-key-file={workdir / 'sa.key'}",
                f"--root-ca-file={workdir / 'ca.crt'}",
                "--use-service-account-credentials=false",
                "--controllers=*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle",
                "--concurrent-gc-syncs=5",
            ],
        )
        # The default ServiceAccount appears once the controller-manager is working.
        deadline = time.monotonic() + 60
        while cluster.kubectl("get", "serviceaccount", "default", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "controller-manager never created the default "
                    f"ServiceAccount:\n{cluster.log_tail('kube-controller-manager')}"
                )
            time.sleep(0.3)
        if with_pods:
            cluster.start(
                "kube-scheduler",
                [
                    str(bin_dir / "kube-scheduler"),
                    *_component_flags(admin, controller_api_qps),
                ],
            )
            cluster.start(
                "kwok",
                [
                    str(bin_dir / "kwok"),
                    f"--kubeconfig={admin}",
                    "--manage-all-nodes=false",
                    f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
                    "--config="
                    + str(write_config(BIN.parent / "kwok-stages.yaml", workdir / "kwok.yaml")),
                    "--cidr=10.0.0.1/24",
                    "--node-ip=10.0.0.1",
                    f"--server-address=127.0.0.1:{free_port()}",
                ],
            )
            cluster.add_fake_node()
        yield cluster
    finally:
        cluster.stop()


def service_account_kubeconfig(cluster: Cluster, namespace: str, name: str) -> Path:
    """A kubeconfig that authenticates as a ServiceAccount through a bound token."""
    token = cluster.kubectl("create", "token", name, "-n", namespace, "--duration=6h").stdout
    path = cluster.workdir / f"{namespace}-{name}.kubeconfig"
    path.write_text(
        kubeconfig_text(cluster.server, cluster.workdir / "ca.crt", {"token": token.strip()})
    )
    return path
