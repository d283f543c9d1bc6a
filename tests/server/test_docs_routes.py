"""The server's docs name only routes the server has: a documented endpoint that answers 404 sends operators
looking for what is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def app_routes() -> set[str]:
    source = (ROOT / "hicache" / "server" / "app.py").read_text()
    return set(re.findall(r'@app\.(?:get|post|api_route)\("([^"]+)"', source))


def test_every_documented_api_path_is_a_route():
    routes = app_routes()
    assert {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"} <= routes
    for doc in ("docs/server.md", "README.md"):
        named = set(re.findall(r"`(/(?:v1/[a-z0-9_/]+|health|metrics))`", (ROOT / doc).read_text()))
        assert named, doc
        assert named <= routes, f"{doc} names {sorted(named - routes)}, which the server does not serve"
