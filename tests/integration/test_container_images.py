"""The operator/router image, built from the Dockerfile with buildah and run: the operator
inside it reconciles an example under the chart's ServiceAccount, the router inside it
answers the openai client in front of local workers, and the image itself runs as UID
10001 with no compiler and nothing secret in it."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from omnipipe.api.constants import CREDENTIAL_ENV
from omnipipe.local.ports import free_port
from tests.e2e.conftest import assert_serves_a_small_image, start_serve
from tests.harness.cluster import BIN, Cluster, control_plane, kubeconfig_text
from tests.integration.conftest import REPO, children, wait_for

# The first test builds the image: about 1-2 min cold, seconds from the layer cache.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
BUILDAH = str(REPO / "hack/buildah")
NAMESPACE = "omnipipe-system"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
KUBE_DIR = "/etc/omnipipe-kube"

# Executables of a C/C++ (or other native) toolchain: none may be in the image.
COMPILER = re.compile(
    r"^(?:x86_64-linux-gnu-)?(?:cc|c\+\+|gcc|g\+\+|cpp|clang|clang\+\+|tcc|gfortran|as|ld"
    r"|ld\.bfd|ld\.gold|cc1|cc1plus|rustc|go)(?:-\d+(?:\.\d+)*)?$"
)
# Names that hold credentials when they exist at all.
SECRET_NAMES = re.compile(
    r"^(?:id_(?:rsa|dsa|ecdsa|ed25519)|\.netrc|\.pypirc|\.git-credentials|\.dockercfg"
    r"|credentials(?:\.json)?|kubeconfig|.*\.kubeconfig|\.env|pip\.conf|\.npmrc|token)$"
)
# A PEM private key with its body, in a file that is not a compiled library: Debian's
# libgnutls carries its self-tests' published keys.
PRIVATE_KEY = re.compile(rb"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----\s*[A-Za-z0-9+/=\s]{64}")


def buildah(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [BUILDAH, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"buildah {' '.join(args)}:\n{proc.stderr}{proc.stdout}"
    return proc.stdout.strip()


def build(target: str, timeout: float) -> str:
    """hack/build-images.sh TARGET; the image's name. Tagged :dev, as `make test`'s set-up
    (hack/node-images.sh) builds it for the real node, so one run builds each image once
    and this build finds every layer cached."""
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(REPO / "hack/build-images.sh"), target],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMNIPIPE_IMAGE_TAG": "dev"},
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print(f"{target} image built in {time.monotonic() - started:.0f} s")
    return f"localhost/omnipipe/{target}:dev"


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("buildah") is None:
        pytest.skip("buildah is not installed (make system-deps installs it)")
    return build("operator", timeout=840)


@contextmanager
def container(image: str) -> Iterator[str]:
    """A working container of `image`, removed afterwards with whatever it ran."""
    name = buildah("from", "--pull-never", image)
    try:
        yield name
    finally:
        buildah("rm", name)


class InContainer:
    """One process run inside a container, as `buildah run` with the host's network."""

    def __init__(
        self, ctr: str, argv: list[str], env: dict[str, str], mounts: dict[Path, str], log: Path
    ) -> None:
        cmd = [BUILDAH, "run", "--isolation", "chroot", "--network", "host"]
        for key, value in env.items():
            cmd += ["--env", f"{key}={value}"]
        for src, dst in mounts.items():
            cmd += ["--volume", f"{src}:{dst}:ro"]
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*cmd, ctr, "--", *argv], stdout=out, stderr=subprocess.STDOUT
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # buildah ends the process it runs
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def test_image_runs_as_uid_10001(image: str) -> None:
    user = buildah("inspect", "--type", "image", "--format", "{{.OCIv1.Config.User}}", image)
    assert user == "10001:10001"
    with container(image) as ctr:
        got = buildah(
            "run", "--isolation", "chroot", ctr, "--",
            "python3", "-c", "import os; print(os.getuid(), os.getgid())",
        )  # fmt: skip
    assert got == "10001 10001"


def _host_only_certificates() -> set[bytes]:
    """PEM blocks of the CA bundle build-images.sh hands pip as a build secret that a
    stock Debian bundle lacks (a proxy's CA, say): none may end up in a layer."""
    bundle = next(
        (
            Path(p)
            for p in (os.environ.get(k, "") for k in ("PIP_CERT", "REQUESTS_CA_BUNDLE"))
            if p and Path(p).is_file()
        ),
        Path("/etc/ssl/certs/ca-certificates.crt"),
    )
    extra = Path("/usr/local/share/ca-certificates")
    blocks = set()
    if bundle.is_file() and extra.is_dir():
        for crt in extra.rglob("*.crt"):
            body = b"".join(crt.read_bytes().split())
            blocks.add(body)
    return blocks


def test_image_has_no_compilers_and_no_secrets(image: str) -> None:
    env = json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"]["Env"]
    assert not [e for e in env if re.search(r"TOKEN|SECRET|PASSWORD|KEY|CREDENTIAL|CERT", e)], env
    host_only = _host_only_certificates()
    with container(image) as ctr:
        root = Path(buildah("mount", ctr))
        try:
            compilers, secrets, keys, certs, files = [], [], [], [], 0
            for dirpath, _, names in os.walk(root):
                for name in names:
                    path = Path(dirpath, name)
                    st = path.lstat()
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    files += 1
                    rel = "/" + str(path.relative_to(root))
                    if COMPILER.match(name) and st.st_mode & 0o111:
                        compilers.append(rel)
                    if SECRET_NAMES.match(name):
                        secrets.append(rel)
                    if st.st_size < 4 << 20 and not rel.startswith("/usr/share/zoneinfo"):
                        data = path.read_bytes()
                        if not data.startswith(b"\x7fELF") and PRIVATE_KEY.search(data):
                            keys.append(rel)
                        if host_only and b"BEGIN CERTIFICATE" in data:
                            flat = b"".join(data.split())
                            certs += [rel for c in host_only if c in flat]
            assert not list((root / SA_DIR.lstrip("/")).glob("*")), "a token in the image"
        finally:
            buildah("umount", ctr)
    assert files > 1000, f"walked only {files} files: is the image mounted?"
    assert compilers == [], compilers
    assert secrets == [], secrets
    assert keys == [], keys
    assert certs == [], f"the build's CA secret stayed in a layer: {certs}"


CHART = REPO / "charts/omnipipe"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, image: str) -> Iterator[Cluster]:
    """A control plane of its own (no other operator may reconcile here) with the chart
    installed: its ServiceAccount is the one the image's operator runs under."""
    with control_plane(tmp_path_factory.mktemp("image-k8s"), with_pods=True) as c:
        proc = subprocess.run(
            [str(BIN / "helm"), "install", "omnipipe", str(CHART), "-n", NAMESPACE,
             "--create-namespace", "--wait", "--timeout", "120s"],
            capture_output=True, text=True, env=c.env(), timeout=150, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield c


def test_operator_in_the_image_reconciles_the_example_under_the_charts_service_account(
    installed: Cluster, image: str, tmp_path: Path
) -> None:
    # The chart's ServiceAccount's token in a kubeconfig, the only credential the
    # container gets. (In a pod kopf finds the mounted token itself, but then it calls
    # https://kubernetes.default.svc on port 443, which no name resolves to here.)
    kube = tmp_path / "kube"
    kube.mkdir()
    token = installed.kubectl("create", "token", "omnipipe-operator", "-n", NAMESPACE)
    shutil.copy(installed.workdir / "ca.crt", kube / "ca.crt")
    (kube / "config").write_text(
        kubeconfig_text(installed.server, Path(KUBE_DIR, "ca.crt"), {"token": token.stdout.strip()})
    )
    env = {
        "KUBECONFIG": f"{KUBE_DIR}/config",
        "OMNIPIPE_OPERATOR_PEERING": "omnipipe",
        "OMNIPIPE_OPERATOR_METRICS_PORT": str(free_port()),
        "OMNIPIPE_OPERATOR_HEALTH_PORT": str(free_port()),
    }
    with container(image) as ctr:
        op = InContainer(ctr, ["omnipipe", "operator"], env, {kube: KUBE_DIR}, tmp_path / "op.log")
        try:
            installed.kubectl("create", "namespace", "apps")
            installed.kubectl("apply", "-n", "apps", "-f", str(REPO / "examples/qwen-image.yaml"))
            done = installed.kubectl(
                "wait", "-n", "apps", "omnip/qwen-image", "--for=condition=Ready",
                "--timeout=120s", timeout=130, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr + "\noperator:\n" + op.output()[-4000:]
            assert op.proc.poll() is None, op.output()[-4000:]
        finally:
            op.stop()
    assert len(children(installed, "apps", "qwen-image")) == 9
    errors = [line for line in op.output().splitlines() if " ERROR " in line or "forbidden" in line]
    assert errors == [], "\n".join(errors)


def test_router_in_the_image_answers_the_openai_client(image: str, tmp_path: Path) -> None:
    credential = "image-test-" + os.urandom(8).hex()
    manifest = REPO / "examples/tiny-text-to-image.yaml"
    served = start_serve(manifest, env={CREDENTIAL_ENV: credential})
    try:
        replicas: dict[str, list[str]] = {}
        for name, (url, _) in served.workers.items():
            stage, _, index = name.rpartition("-")
            if stage and index.isdigit():
                replicas.setdefault(stage, []).append(url)
        assert set(replicas) == {"encode", "denoise", "decode"}, served.workers
        conf = tmp_path / "conf"
        conf.mkdir()
        shutil.copy(manifest, conf / "pipeline.yaml")
        (conf / "replicas.json").write_text(json.dumps(replicas))
        port = free_port()
        with container(image) as ctr:
            router = InContainer(
                ctr,
                ["omnipipe", "router", "--pipeline", "/etc/omnipipe/pipeline.yaml",
                 "--host", "127.0.0.1", "--port", str(port),
                 "--replicas-file", "/etc/omnipipe/replicas.json"],
                {CREDENTIAL_ENV: credential},
                {conf: "/etc/omnipipe"},
                tmp_path / "router.log",
            )  # fmt: skip
            try:
                base = f"http://127.0.0.1:{port}"
                wait_for("the router in the image", lambda: http_ok(base, router), timeout=60)
                assert_serves_a_small_image(base, "tiny-image")
            finally:
                router.stop()
        assert " ERROR " not in router.output(), router.output()[-4000:]
    finally:
        served.stop()


def http_ok(base: str, served: InContainer) -> bool:
    """`base`/ready answers 200; fails at once if the process in the container exited."""
    import urllib.error
    import urllib.request

    assert served.proc.poll() is None, "it exited:\n" + served.output()[-4000:]
    try:
        with urllib.request.urlopen(f"{base}/ready", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
