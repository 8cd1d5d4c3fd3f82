"""The few HTTP calls `omnipipe serve` makes to its own processes: readiness, the
router's view of the revisions, and draining a worker."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from omnipipe.api.constants import CREDENTIAL_HEADER

# A drain returns once the worker's in-flight requests are done; the worker bounds that
# wait itself (drain_timeout_seconds), this only guards against a hung worker.
DRAIN_TIMEOUT_SECONDS = 180.0


def is_ready(url: str, stage: str | None = None) -> bool:
    """/ready answers 200, and, given a stage (or a colocated group), from a worker of
    that stage (or group): a port another process took would otherwise pass for it."""
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            if resp.status != 200:
                return False
            raw = resp.read()
    except (urllib.error.URLError, OSError):
        return False
    if stage is None:
        return True
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    return isinstance(body, dict) and stage in (body.get("stage"), body.get("group"))


def router_state(url: str) -> dict[str, object]:
    """The router's /ready body, whether it is ready (200) or not (503); {} if it is
    not answering."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raw = exc.read()
    except (urllib.error.URLError, OSError):
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def drain(url: str, credential: str) -> str:
    """POST /drain: the worker stops taking work and answers once it holds none."""
    request = urllib.request.Request(
        f"{url}/drain", method="POST", headers={CREDENTIAL_HEADER: credential}
    )
    try:
        with urllib.request.urlopen(request, timeout=DRAIN_TIMEOUT_SECONDS) as resp:
            return str(resp.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError) as exc:
        return f"no answer ({exc})"


def drain_all(urls: list[str], credential: str) -> list[str]:
    """Drain every worker at once; their answers, in order."""
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        return list(pool.map(lambda u: drain(u, credential), urls))


# Loading an adapter reads its file and patches each DiT copy: seconds on a real model.
ADAPTERS_TIMEOUT_SECONDS = 300.0


def put_adapters(url: str, adapters: list[dict[str, object]], credential: str) -> str:
    """PUT /adapters: the worker loads and unloads LoRA adapters to match; "" when it
    did, else what it said."""
    request = urllib.request.Request(
        f"{url}/adapters",
        method="PUT",
        data=json.dumps({"adapters": adapters}).encode(),
        headers={CREDENTIAL_HEADER: credential, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=ADAPTERS_TIMEOUT_SECONDS):
            return ""
    except urllib.error.HTTPError as exc:
        return f"{exc.code}: {exc.read().decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as exc:
        return f"no answer ({exc})"
