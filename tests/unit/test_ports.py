"""Ports for local children come from outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from omnipipe.cli import main
from omnipipe.local import ports


def test_a_picked_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low = ports._ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken, taken + 1 if taken < 65535 else taken - 1])
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(picks))
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65536)
        assert ports.free_port() != taken


def test_without_a_range_to_pick_from_the_kernel_picks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", narrow)
    port = ports.free_port()
    assert 1024 <= port <= 65535


def test_a_range_given_is_the_one_picked_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """OMNIPIPE_PORT_RANGE: what the e2e tier gives each pytest-xdist worker, so that two
    workers' serves never pick the same port (tests/e2e/conftest.py)."""
    monkeypatch.setenv(ports.PORT_RANGE_ENV, "20000-20049")
    assert ports.port_range() == (20000, 20049)
    picked = {ports.free_port() for _ in range(40)}
    assert picked <= set(range(20000, 20050))
    assert len(picked) > 1


def test_a_range_with_no_free_port_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setenv(ports.PORT_RANGE_ENV, f"{taken}-{taken}")
        with pytest.raises(OSError, match=f"in OMNIPIPE_PORT_RANGE={taken}-{taken}"):
            ports.free_port()


@pytest.mark.parametrize("given", ["20000", "20000-", "-20000", "a-b", "0-10", "30000-20000"])
def test_a_range_that_is_no_range_is_refused_naming_the_variable(
    given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ports.PORT_RANGE_ENV, given)
    with pytest.raises(OSError, match=r"OMNIPIPE_PORT_RANGE=.*give LOW-HIGH"):
        ports.free_port()


def test_a_port_already_handed_out_is_not_picked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in CI: two children of one `omnipipe serve` given the same port (a worker's
    and the router's), since neither had bound it yet; the router answered the worker's
    /ready and the worker never got work."""
    picks = iter([20001, 20001, 20002])
    monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(picks))
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65536)
    assert ports.free_port(avoid={20001}) == 20002


def test_a_ready_answer_from_another_stage_is_not_that_workers() -> None:
    import http.server
    import json
    import threading

    from omnipipe.local import control

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"stage": "encode", "ready": True}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/ready"
        assert control.is_ready(url, "encode")
        assert not control.is_ready(url, "denoise")
        assert control.is_ready(url)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("port", ["0", "-5", "65536", "99999", "http", "80.5"])
@pytest.mark.parametrize("command", ["serve", "router", "worker"])
def test_a_port_out_of_range_is_refused_before_anything_starts(
    command: str,
    port: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from omnipipe.local import serve

    def started(*_args: Any, **_kwargs: Any) -> int:
        raise AssertionError("serve started")

    monkeypatch.setattr(serve, "serve", started)
    required = {"serve": ["tiny://qwen-image"], "router": ["--pipeline", "p.yaml"]}
    argv = [command, *required.get(command, ["--pipeline", "p.yaml", "--stage", "s"])]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, f"--port={port}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port" in err
    assert "1 to 65535" in err or "not a number" in err


def test_a_port_in_range_is_taken() -> None:
    from omnipipe.cli import build_parser

    args = build_parser().parse_args(["serve", "x.yaml", "--port", "65535"])
    assert args.port == 65535


def test_a_taken_port_is_refused_before_any_worker_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from omnipipe.local import supervisor

    spawned: list[object] = []
    monkeypatch.setattr(
        supervisor.Supervisor, "_popen", lambda self, *a, **k: spawned.append(a) or None
    )
    manifest = Path(__file__).resolve().parents[2] / "examples/tiny-text-to-image.yaml"
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as held:
            held.bind((host, 0))
            held.listen()
            port = held.getsockname()[1]
            assert main(["serve", str(manifest), "--host", "127.0.0.1", "--port", str(port)]) == 1
        err = capsys.readouterr().err
        assert f"port {port} on 127.0.0.1 is already in use" in err
    assert spawned == []


def test_a_port_held_only_by_closing_connections_is_free() -> None:
    """A port whose server just stopped (connections in TIME_WAIT) is bound as uvicorn
    binds it, so it is not refused."""
    from omnipipe.local.ports import check_port_free

    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end waits in TIME_WAIT
        client.close()
    check_port_free("127.0.0.1", port)
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.raises(OSError, match="already in use"):
            check_port_free("127.0.0.1", port)
