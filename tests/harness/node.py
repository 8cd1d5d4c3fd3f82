"""A real single-node Kubernetes for tests: the control plane of cluster.py plus a kubelet
that runs pods for real (containerd + runc, CNI bridge), kube-proxy in iptables mode and
CoreDNS. Pods start from images imported into containerd; nothing is pulled.

Every daemon, and every pod address, lives in one network namespace that the harness
creates and removes (`NETNS`). Inside it: the pod bridge `BRIDGE` (`BRIDGE_IP`/24), a veth
to the host (`HOST_IP` here, `NODE_IP` there) and no default route, so no packet of the
cluster leaves the machine. The host reaches pods and ClusterIPs through routes over the
veth. Daemons are entered with `nsenter --net` (not `ip netns exec`, which remounts /sys
and breaks kubelet's view of the cgroups).

Binaries: hack/build-k8s.sh and hack/build-node.sh, cached under
~/.cache/omnipipe/k8s/<version>/. containerd's image store is kept under
~/.cache/omnipipe/node/, so a re-run imports only images that changed, and of those only
the blobs containerd lacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.harness import oci_layout
from tests.harness.cluster import BIN, Cluster, kubeconfig_text, make_certs

NETNS = "omnipipe-node"
HOST_VETH, NODE_VETH = "opnode-host", "opnode-ns"
HOST_IP, NODE_IP = "10.89.0.1", "10.89.0.2"
BRIDGE, BRIDGE_IP = "opnode-br0", "10.88.0.1"
# Locally administered (02:...), never a real card's.
BRIDGE_MAC = "02:6f:70:6e:6f:01"
POD_CIDR, SERVICE_CIDR = "10.88.0.0/24", "10.96.0.0/24"
NODE_NAME = "realnode"
API_PORT = 6443
STORE = Path(os.environ.get("OMNIPIPE_NODE_STORE", Path.home() / ".cache/omnipipe/node"))
PAUSE_LAYOUT = BIN.parent / "pause-oci"
IMAGE_LAYOUTS = STORE / "images"
CNI_BIN = Path("/usr/lib/cni")
# kubelet rewrites these machine-wide while it runs; they are put back afterwards.
SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
NSENTER = ["nsenter", f"--net=/run/netns/{NETNS}"]


def _run(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def in_node(
    *argv: str, check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run a command inside the node's network namespace."""
    return _run(*NSENTER, *argv, check=check, timeout=timeout)


def missing_prerequisite() -> str | None:
    """Why this machine cannot run a real node, or None when it can."""
    if os.geteuid() != 0:
        return "a real node needs root (network namespaces, cgroups, mounts)"
    for tool in ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make system-deps installs it)"
    for plugin in ("bridge", "host-local", "loopback"):
        if not (CNI_BIN / plugin).exists():
            return f"{CNI_BIN / plugin} is missing (Debian's containernetworking-plugins)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlayfs (containerd's snapshotter)"
    if not os.access("/sys/fs/cgroup", os.W_OK):
        return "/sys/fs/cgroup is not writable"
    probe = "omnipipe-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _run("ip", "netns", "delete", probe, check=False)
    for b in ("kubelet", "kube-proxy", "coredns", "prometheus"):
        if not (BIN / b).exists():
            return f"{BIN / b} is missing: run hack/build-node.sh (make test does)"
    return None


@dataclass
class RealNode(Cluster):
    """A Cluster whose pods run; `ctr` talks to its containerd."""

    containerd_socket: Path = Path()

    def ctr(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        return in_node(
            "ctr",
            "-a",
            str(self.containerd_socket),
            "-n",
            "k8s.io",
            *args,
            check=check,
            timeout=timeout,
        ).stdout

    def import_image(self, layout: Path, name: str) -> bool:
        """Import an OCI image layout (hack/node-images.sh) as `name` unless containerd
        has that very manifest already; True when it imported. Only the blobs containerd
        lacks are sent (see _ctr_import)."""
        index = json.loads((layout / "index.json").read_text())
        want = str(index["manifests"][0]["digest"])
        held = self.ctr("images", "ls", f"name=={name}", check=False)
        if want in held:
            return False
        started = time.monotonic()
        # Replacing the image under its name lets containerd's garbage collector take the
        # old image's snapshots while the new one, which shares its lower layers, is
        # still unpacking ("parent snapshot ... does not exist"); a second name keeps
        # the old image referenced until the new one is whole.
        keep = f"{name}-replaced"
        if name in held:
            self.ctr("images", "tag", "--force", name, keep, check=False)
        try:
            imported = self._ctr_import(layout, name, only_missing=True)
            if imported.returncode != 0:
                # A blob listed as held and collected since: send every blob.
                print(
                    f"[node] {name}: {imported.stderr.strip()}; importing every blob",
                    file=sys.stderr,
                )
                imported = self._ctr_import(layout, name, only_missing=False)
            if imported.returncode != 0 and "snapshot" in imported.stderr:
                # A store a killed run left half-written: import afresh once.
                print(f"[node] {name}: {imported.stderr.strip()}; importing again", file=sys.stderr)
                self.ctr("images", "rm", name, check=False)
                imported = self._ctr_import(layout, name, only_missing=False)
        finally:
            self.ctr("images", "rm", keep, check=False)
        if imported.returncode != 0 or want not in self.ctr("images", "ls", f"name=={name}"):
            raise RuntimeError(f"importing {layout} as {name} failed: {imported.stderr}")
        print(f"[node] imported {name} in {time.monotonic() - started:.0f} s", file=sys.stderr)
        return True

    def _ctr_import(
        self, layout: Path, name: str, *, only_missing: bool
    ) -> subprocess.CompletedProcess[str]:
        # containerd 1.6's import writes every blob of the tar it reads into its store
        # before it finds it held (it learns a blob's digest only by reading it): given
        # the whole layout after a code change, it wrote the worker's torch and vLLM
        # layer again (6.5 GB uncompressed). Given only the blobs it lacks, it writes
        # omnipipe's small layers; the manifest names the others, which it holds.
        held = self.ctr("content", "ls", "--quiet").split() if only_missing else []
        members = oci_layout.tar_members(layout, held)
        tar = subprocess.Popen(
            ["tar", "-C", str(layout), "-cf", "-", *members], stdout=subprocess.PIPE
        )
        # Unpacked on import, into the snapshotter the CRI uses: a pod's start does not
        # pay for it. A layer whose snapshot exists is not unpacked again.
        imported = subprocess.run(
            [
                *NSENTER,
                "ctr",
                "-a",
                str(self.containerd_socket),
                "-n",
                "k8s.io",
                "images",
                "import",
                "--base-name",
                name.rsplit(":", 1)[0],
                "-",
            ],
            stdin=tar.stdout,
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait()
        return imported


def _start(node: RealNode, name: str, argv: list[str]) -> None:
    node.start(name, [*NSENTER, *argv])


def _wait(node: RealNode, what: str, argv: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = node.procs.get(what)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited:\n{node.log_tail(what)}")
        if in_node(*argv, check=False, timeout=10).returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s:\n{node.log_tail(what)}")


def _clean_leftovers(socket: Path) -> None:
    """What a killed run left: processes in the namespace (daemons, shims), containers
    still in kubelet's cgroups, the namespace itself and the host's veth end."""
    if Path(f"/run/netns/{NETNS}").exists():
        for pid in _run("ip", "netns", "pids", NETNS, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    for top in (Path("/sys/fs/cgroup/pids/kubepods"), Path("/sys/fs/cgroup/kubepods")):
        _kill_cgroup_tree(top)
    time.sleep(0.3)
    _unmount_under(socket.parent)
    # A killed run's pod volumes and container root filesystems stay mounted under its own
    # work dir, a sibling of this one: pytest cannot remove that dir, and its disk stays
    # taken, until they are unmounted.
    for earlier in socket.parent.parent.parent.glob("*/node*"):
        if earlier != socket.parent:
            _unmount_under(earlier / "kubelet")
            _unmount_under(earlier / "containerd-state")
    _run("ip", "link", "delete", HOST_VETH, check=False)
    _run("ip", "netns", "delete", NETNS, check=False)


def _kill_cgroup_tree(top: Path) -> None:
    for procs in top.rglob("cgroup.procs"):
        for pid in procs.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _unmount_under(root: Path) -> None:
    mounts = [
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[1].startswith(f"{root}/")
    ]
    for mount in sorted(mounts, reverse=True):
        _run("umount", "-l", mount, check=False)


def _remove_empty_cgroups() -> None:
    for top in Path("/sys/fs/cgroup").glob("*/kubepods"):
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _network() -> None:
    _run("ip", "netns", "add", NETNS)
    in_node("ip", "link", "set", "lo", "up")
    _run("ip", "link", "add", HOST_VETH, "type", "veth", "peer", "name", NODE_VETH)
    _run("ip", "link", "set", NODE_VETH, "netns", NETNS)
    _run("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_VETH)
    in_node("ip", "addr", "add", f"{NODE_IP}/30", "dev", NODE_VETH)
    _run("ip", "link", "set", HOST_VETH, "up")
    in_node("ip", "link", "set", NODE_VETH, "up")
    # Forwarding between the veth and the bridge, inside the namespace only.
    in_node("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
    in_node("ip", "link", "add", BRIDGE, "type", "bridge")
    # A fixed address: a bridge left to choose takes its lowest port's, and changes it as
    # pods come and go, so the pods' ARP entries for the gateway go stale and their
    # replies to the host vanish until the entries are probed again.
    in_node("ip", "link", "set", BRIDGE, "address", BRIDGE_MAC)
    in_node("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
    in_node("ip", "link", "set", BRIDGE, "up")
    for cidr in (POD_CIDR, SERVICE_CIDR):
        _run("ip", "route", "replace", cidr, "via", NODE_IP, "dev", HOST_VETH)


def _cni_config(workdir: Path) -> Path:
    conf_dir = workdir / "cni"
    conf_dir.mkdir()
    # isGateway false and ipMasq false: with either, the plugin turns on forwarding and NAT
    # on its own; pods route only to the pod subnet, the Services and the host's veth end.
    conf = {
        "cniVersion": "1.0.0",
        "name": "omnipipe-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": False,
                "isDefaultGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(workdir / "ipam"),
                    "ranges": [
                        [
                            {
                                "subnet": POD_CIDR,
                                "rangeStart": "10.88.0.10",
                                "rangeEnd": "10.88.0.250",
                                "gateway": BRIDGE_IP,
                            }
                        ]
                    ],
                    "routes": [
                        {"dst": SERVICE_CIDR, "gw": BRIDGE_IP},
                        {"dst": f"{HOST_IP}/32", "gw": BRIDGE_IP},
                    ],
                },
            },
            {"type": "loopback"},
        ],
    }
    (conf_dir / "10-omnipipe-node.conflist").write_text(json.dumps(conf, indent=2))
    return conf_dir


def _containerd_config(workdir: Path, socket: Path, cni_dir: Path) -> Path:
    root = STORE / "containerd"
    root.mkdir(parents=True, exist_ok=True)
    config = workdir / "containerd.toml"
    # restrict_oom_score_adj: runc cannot raise oom_score_adj without CAP_SYS_RESOURCE,
    # which this machine's root lacks; every pod failed to start without it.
    config.write_text(
        f"""version = 2
root = "{root}"
state = "{workdir / "containerd-state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{socket}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  tolerate_missing_hugetlb_controller = true
  disable_hugetlb_controller = true
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni_dir}"
    max_conf_num = 1
"""
    )
    return config


def _kubelet_config(workdir: Path, socket: Path) -> Path:
    resolv = workdir / "resolv.conf"
    # Pods never see the host's resolv.conf (its nameserver is outside): CoreDNS only.
    resolv.write_text(f"nameserver {BRIDGE_IP}\n")
    config = workdir / "kubelet.yaml"
    config.write_text(
        f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {BRIDGE_IP}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
containerRuntimeEndpoint: unix://{socket}
imageServiceEndpoint: unix://{socket}
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
makeIPTablesUtilChains: false
protectKernelDefaults: false
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {workdir / "ca.crt"}}}
authorization: {{mode: AlwaysAllow}}
clusterDomain: cluster.local
clusterDNS: [{BRIDGE_IP}]
resolvConf: {resolv}
podLogsDir: {workdir / "pod-logs"}
serializeImagePulls: false
rotateCertificates: false
serverTLSBootstrap: false
# Imported images have no registry to come back from: never collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: "100Mi", nodefs.available: "1%", nodefs.inodesFree: "1%",
  imagefs.available: "1%"}}
nodeStatusReportFrequency: 10s
syncFrequency: 10s
fileCheckFrequency: 10s
"""
    )
    return config


def _kube_proxy_config(workdir: Path, kubeconfig: Path) -> Path:
    config = workdir / "kube-proxy.yaml"
    config.write_text(
        f"""apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {{kubeconfig: {kubeconfig}}}
hostnameOverride: {NODE_NAME}
mode: iptables
clusterCIDR: {POD_CIDR}
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: ["{BRIDGE_IP}/32"]
iptables: {{localhostNodePorts: false, masqueradeAll: false}}
# No conntrack sysctl is touched: those are the machine's.
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
"""
    )
    return config


def _corefile(workdir: Path, kubeconfig: Path) -> Path:
    corefile = workdir / "Corefile"
    # cluster.local only, and nothing forwarded: no name a pod looks up leaves the node.
    corefile.write_text(
        f""".:53 {{
    bind {BRIDGE_IP} 127.0.0.1
    errors
    health 127.0.0.1:8080
    ready 127.0.0.1:8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} test
        pods insecure
        ttl 5
    }}
    cache 5
}}
"""
    )
    return corefile


def _save_sysctls() -> dict[str, str]:
    return {k: Path("/proc/sys", k).read_text().strip() for k in SYSCTLS}


def _restore_sysctls(saved: dict[str, str]) -> None:
    for key, value in saved.items():
        with contextlib.suppress(OSError):
            Path("/proc/sys", key).write_text(value)


def _drain_pods(node: RealNode) -> None:
    """Delete every pod through the API and give kubelet a moment to tear the sandboxes
    down itself (CNI DEL frees their addresses and veths); what is left is killed."""
    node.kubectl(
        "delete",
        "pods",
        "--all",
        "--all-namespaces",
        "--grace-period=0",
        "--force",
        "--wait=false",
        check=False,
        timeout=30,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not node.ctr("tasks", "ls", "-q", check=False, timeout=10).strip():
            return
        time.sleep(0.5)


@contextlib.contextmanager
def real_node(workdir: Path) -> Iterator[RealNode]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd, kubelet,
    kube-proxy and CoreDNS, all in the node's network namespace; the API at
    https://NODE_IP:6443 with an admin kubeconfig (`node.kubeconfig`)."""
    reason = missing_prerequisite()
    if reason:
        raise RuntimeError(reason)
    started = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    socket = workdir / "containerd.sock"
    _clean_leftovers(socket)
    saved = _save_sysctls()
    make_certs(workdir, extra_ips=(BRIDGE_IP, NODE_IP))
    server = f"https://{NODE_IP}:{API_PORT}"
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
    # The daemons reach the API on the namespace's own loopback.
    local = workdir / "local.kubeconfig"
    local.write_text(admin.read_text().replace(server, f"https://127.0.0.1:{API_PORT}"))
    node = RealNode(workdir, server, admin, BIN, containerd_socket=socket)
    try:
        _network()
        cni_dir = _cni_config(workdir)
        _start(
            node,
            "containerd",
            ["containerd", "--config", str(_containerd_config(workdir, socket, cni_dir))],
        )
        _wait(node, "containerd", ["ctr", "-a", str(socket), "version"], 30)
        # Containers a killed run left in the kept image store.
        for container in node.ctr("containers", "ls", "-q").split():
            node.ctr("containers", "delete", container, check=False)
        node.import_image(PAUSE_LAYOUT, "registry.k8s.io/pause:3.10")
        _start(
            node,
            "etcd",
            [
                "etcd",
                "--data-dir",
                str(workdir / "etcd"),
                "--name",
                "node",
                "--listen-client-urls",
                "http://127.0.0.1:2379",
                "--advertise-client-urls",
                "http://127.0.0.1:2379",
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "node=http://127.0.0.1:2380",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )
        _wait(node, "etcd", ["curl", "-sf", "http://127.0.0.1:2379/health"], 30)
        _start(
            node,
            "kube-apiserver",
            [
                str(BIN / "kube-apiserver"),
                "--etcd-servers=http://127.0.0.1:2379",
                "--bind-address=0.0.0.0",
                # The `kubernetes` Service's endpoint: pods (the operator) reach the API there.
                f"--advertise-address={BRIDGE_IP}",
                f"--secure-port={API_PORT}",
                f"--cert-dir={workdir / 'apiserver-certs'}",
                f"--tls-cert-file={workdir / 'apiserver.crt'}",
                f"--tls-private-key-file={workdir / 'apiserver.key'}",
                f"--client-ca-file={workdir / 'ca.crt'}",
                f"--service-account-key-file={workdir / 'sa.pub'}",
                f"--service-account-signing-key-file={workdir / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                f"--kubelet-client-certificate={workdir / 'admin.crt'}",
                f"--kubelet-client-key={workdir / 'admin.key'}",
                "--kubelet-preferred-address-types=InternalIP",
                "--allow-privileged=false",
                "--profiling=false",
                # Debian's etcd 3.4 cannot answer watch progress requests (cluster.py says more).
                "--feature-gates=WatchList=false,ImageVolume=true",
            ],
        )
        _wait(node, "kube-apiserver", ["curl", "-sfk", f"https://127.0.0.1:{API_PORT}/livez"], 90)
        common = [
            f"--kubeconfig={local}",
            f"--authentication-kubeconfig={local}",
            f"--authorization-kubeconfig={local}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--profiling=false",
        ]
        _start(
            node,
            "kube-controller-manager",
            [
                str(BIN / "kube-controller-manager"),
                *common,
                "--secure-port=10257",
                f"--service-account-private-key-file={workdir / 'sa.key'}",
                f"--root-ca-file={workdir / 'ca.crt'}",
                "--use-service-account-credentials=true",
                "--controllers=*,-nodeipam,-cloud-node-lifecycle",
            ],
        )
        _start(
            node, "kube-scheduler", [str(BIN / "kube-scheduler"), *common, "--secure-port=10259"]
        )
        _start(
            node,
            "kubelet",
            [
                str(BIN / "kubelet"),
                f"--config={_kubelet_config(workdir, socket)}",
                f"--kubeconfig={local}",
                f"--root-dir={workdir / 'kubelet'}",
                f"--cert-dir={workdir / 'kubelet-pki'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={BRIDGE_IP}",
            ],
        )
        _start(
            node,
            "kube-proxy",
            [str(BIN / "kube-proxy"), f"--config={_kube_proxy_config(workdir, local)}"],
        )
        _start(node, "coredns", [str(BIN / "coredns"), "-conf", str(_corefile(workdir, local))])
        _wait(node, "kube-proxy", ["curl", "-sf", "http://127.0.0.1:10256/healthz"], 60)
        _wait(node, "coredns", ["curl", "-sf", "http://127.0.0.1:8181/ready"], 60)
        deadline = time.monotonic() + 120
        while (
            node.kubectl(
                "wait", "--for=condition=Ready", f"node/{NODE_NAME}", "--timeout=2s", check=False
            ).returncode
            != 0
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"node never Ready:\n{node.log_tail('kubelet')}")
            time.sleep(0.5)
        while node.kubectl("get", "serviceaccount", "default", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "no default ServiceAccount:\n" + node.log_tail("kube-controller-manager")
                )
            time.sleep(0.3)
        print(f"[node] up in {time.monotonic() - started:.1f} s", file=sys.stderr)
        yield node
    finally:
        # Nested so that a teardown cut short (pytest-timeout raises a BaseException)
        # still stops every daemon and closes their logs.
        try:
            with contextlib.suppress(Exception):
                if "kubelet" in node.procs and node.procs["kubelet"].poll() is None:
                    _drain_pods(node)
        finally:
            try:
                node.stop()
            finally:
                _clean_leftovers(socket)
                _remove_empty_cgroups()
                _restore_sysctls(saved)
