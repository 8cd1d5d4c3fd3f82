"""Rancher's local-path-provisioner on the real node, as kind installs it for its default
StorageClass: the upstream manifest (deploy/local-path-storage.yaml of v0.0.30) with the
image hack/build-node.sh builds from the Go module, the volumes under a folder of the
test's, and the worker image as the helper pod's (it has the /bin/sh the setup script
needs; the node has no registry to pull busybox from)."""

from __future__ import annotations

from pathlib import Path

from tests.harness.cluster import BIN, REPO
from tests.harness.gotools import pinned_default

VERSION = pinned_default(REPO / "hack/build-node.sh", "LOCAL_PATH_VERSION")
IMAGE = f"localhost/local-path-provisioner:{VERSION}"
LAYOUT = BIN.parent / f"local-path-oci-{VERSION}"
NAMESPACE = "local-path-storage"
STORAGE_CLASS = "local-path"
PROVISIONER = "rancher.io/local-path"


def manifest(root: Path, helper_image: str) -> str:
    """Every object of the provisioner: volumes go under `root` on the node."""
    return f"""apiVersion: v1
kind: Namespace
metadata: {{name: {NAMESPACE}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: local-path-provisioner-service-account, namespace: {NAMESPACE}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: local-path-provisioner-role, namespace: {NAMESPACE}}}
rules:
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: local-path-provisioner-role}}
rules:
  - apiGroups: [""]
    resources: ["nodes", "persistentvolumeclaims", "configmaps", "pods", "pods/log"]
    verbs: ["get", "list", "watch"]
  - apiGroups: [""]
    resources: ["persistentvolumes"]
    verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
  - apiGroups: [""]
    resources: ["events"]
    verbs: ["create", "patch"]
  - apiGroups: ["storage.k8s.io"]
    resources: ["storageclasses"]
    verbs: ["get", "list", "watch"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: local-path-provisioner-bind, namespace: {NAMESPACE}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: local-path-provisioner-role}}
subjects:
  - {{kind: ServiceAccount, name: local-path-provisioner-service-account, namespace: {NAMESPACE}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: local-path-provisioner-bind}}
roleRef:
  {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: local-path-provisioner-role}}
subjects:
  - {{kind: ServiceAccount, name: local-path-provisioner-service-account, namespace: {NAMESPACE}}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: local-path-provisioner, namespace: {NAMESPACE}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: local-path-provisioner}}}}
  template:
    metadata: {{labels: {{app: local-path-provisioner}}}}
    spec:
      serviceAccountName: local-path-provisioner-service-account
      containers:
        - name: local-path-provisioner
          image: {IMAGE}
          imagePullPolicy: Never
          command: [/local-path-provisioner, --debug, start, --config, /etc/config/config.json]
          volumeMounts: [{{name: config-volume, mountPath: /etc/config/}}]
          env:
            - name: POD_NAMESPACE
              valueFrom: {{fieldRef: {{fieldPath: metadata.namespace}}}}
            - {{name: CONFIG_MOUNT_PATH, value: /etc/config/}}
      volumes: [{{name: config-volume, configMap: {{name: local-path-config}}}}]
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {{name: {STORAGE_CLASS}}}
provisioner: {PROVISIONER}
volumeBindingMode: WaitForFirstConsumer
reclaimPolicy: Delete
---
apiVersion: v1
kind: ConfigMap
metadata: {{name: local-path-config, namespace: {NAMESPACE}}}
data:
  config.json: |-
    {{"nodePathMap": [{{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": ["{root}"]}}]}}
  setup: |-
    #!/bin/sh
    set -eu
    mkdir -m 0777 -p "$VOL_DIR"
  teardown: |-
    #!/bin/sh
    set -eu
    rm -rf "$VOL_DIR"
  helperPod.yaml: |-
    apiVersion: v1
    kind: Pod
    metadata:
      name: helper-pod
    spec:
      priorityClassName: system-node-critical
      tolerations:
        - key: node.kubernetes.io/disk-pressure
          operator: Exists
          effect: NoSchedule
      containers:
      - name: helper-pod
        image: {helper_image}
        imagePullPolicy: Never
        # The worker image runs as a user of its own: the folders are the node's root's.
        securityContext: {{runAsUser: 0, runAsGroup: 0}}
"""
