#!/usr/bin/env bash
# Debian packages the tests need: etcd (the API server's store), openssl (test certs),
# prometheus and promtool (autoscaling and alert tests), curl (a test client), and the benchmarks' anchors and
# load generator: ucx_perftest (ucx-utils) and wrk; buildah and mmdebstrap build the
# container images from a local Debian base (hack/build-images.sh, hack/debian-base.sh)
# and skopeo writes them as the real node's OCI layouts (hack/node-images.sh);
# containerd, runc, the CNI plugins, iptables and conntrack run the test tier's real node
# (tests/harness/node.py: kubelet's runtime, pod networking, kube-proxy's rules); redis-server
# keeps the video jobs that router replicas share (tests/e2e/test_videos.py).
# Go itself (>= 1.24, for hack/build-k8s.sh) must already be installed.
# Installs only what is missing; uses sudo when not root.
set -euo pipefail
need=()
command -v etcd >/dev/null || need+=(etcd-server)
command -v openssl >/dev/null || need+=(openssl)
# promtool too (the alert rules' unit tests): a prometheus on PATH from elsewhere may lack it.
{ command -v prometheus && command -v promtool; } >/dev/null || need+=(prometheus)
command -v curl >/dev/null || need+=(curl)
command -v ucx_perftest >/dev/null || need+=(ucx-utils)
command -v wrk >/dev/null || need+=(wrk)
command -v buildah >/dev/null || need+=(buildah)
command -v skopeo >/dev/null || need+=(skopeo)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[[ -x /usr/lib/cni/bridge ]] || need+=(containernetworking-plugins)
command -v iptables >/dev/null || need+=(iptables)
command -v conntrack >/dev/null || need+=(conntrack)
command -v gcc >/dev/null || need+=(gcc libc6-dev)
command -v redis-server >/dev/null || need+=(redis-server)
if ((${#need[@]} == 0)); then exit 0; fi
SUDO=""
[[ $(id -u) == 0 ]] || SUDO="sudo"
echo "installing Debian packages: ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
