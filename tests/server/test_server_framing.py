"""HTTP framing from hostile or broken clients, on a raw socket: a client that leaves mid-body costs one quiet
log line, a request with both Content-Length and Transfer-Encoding is refused at once, and a chunked body over
the limit gets its 413 instead of a reset."""

from __future__ import annotations

import socket
import time

import httpx
from server_helpers import wait_for

MODEL = "random:tiny"


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return sock


def status_of(sock: socket.socket) -> int:
    """The status code of the response on sock (reads until the status line is in)."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


def test_a_client_leaving_mid_body_costs_one_quiet_line(server) -> None:
    before = server.log_path.read_text(errors="replace")
    for _ in range(3):
        sock = connect(server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"abc")
        time.sleep(0.1)
        sock.close()
    assert wait_for(lambda: server.log_path.read_text(errors="replace").count(
        "the client disconnected while sending its request") >= before.count(
        "the client disconnected while sending its request") + 3)
    new = server.log_path.read_text(errors="replace")[len(before):]
    assert "Traceback" not in new and "ClientDisconnect" not in new


def test_content_length_and_transfer_encoding_together_are_refused_at_once(server) -> None:
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n")
    sock.settimeout(10)
    assert status_of(sock) == 400
    sock.close()


def test_a_chunked_body_over_the_limit_gets_413(server) -> None:
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * (1 << 20)
    for _ in range(6):  # 6 MiB against the default 4 MiB limit
        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
    sock.sendall(b"0\r\n\r\n")
    assert status_of(sock) == 413
    sock.close()


def test_a_request_whose_headers_or_body_never_finish_is_cut_off(start_server, tmp_path) -> None:
    """Read deadlines of 1 s: half a header line, or the headers and half a body, then silence; the server
    closes both connections (recv gets EOF) and goes on serving."""
    from server_helpers import tiny_config

    srv = start_server("--config", str(tiny_config(tmp_path)), "--set", "server.header_timeout_s=1",
                       "--set", "server.body_timeout_s=1")
    half_header = connect(srv)
    half_header.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    half_body = connect(srv)
    half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\"")
    silent = connect(srv)  # connected, nothing sent
    for sock in (half_header, half_body, silent):
        sock.settimeout(30)
        assert sock.recv(4096) == b""  # EOF: the server closed it (a socket timeout would fail the test)
        sock.close()
    assert wait_for(lambda: srv.log_path.read_text(errors="replace").count("did not arrive within 1 s") >= 3)
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200
