"""A fake Hugging Face Hub on 127.0.0.1 for tests of ``hub.push_to_hub``: the endpoints ``huggingface_hub``'s
``whoami`` (the start-up check), ``create_repo`` and ``upload_folder`` call, answered as the Hub answers them,
every request recorded.

Every file is answered as a "regular" upload, so its bytes arrive base64-encoded inside the commit (the real Hub
sends large files through LFS / Xet instead); the test can then compare what arrived with the folder on disk.
Point a child process at it with ``HF_ENDPOINT=server.url``.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeHub:
    """``with FakeHub() as hub:`` a server on a free port; ``hub.requests``, ``hub.repos``, ``hub.files``."""

    requests: list[Request] = field(default_factory=list)
    repos: list[dict[str, Any]] = field(default_factory=list)  # create_repo's JSON bodies
    files: dict[str, bytes] = field(default_factory=dict)  # path in repo -> bytes, of every commit
    commits: list[dict[str, Any]] = field(default_factory=list)  # the commits' header values
    branches: list[str] = field(default_factory=list)  # "repo@branch" created
    #: what GET /api/whoami-v2 answers for any token: the Hub's shape (a user "me" whose token may write)
    whoami: dict[str, Any] = field(default_factory=lambda: {
        "type": "user", "name": "me", "orgs": [], "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.requests.append(Request("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                self._reply(*hub.answer(self.path, body))

            def do_GET(self) -> None:
                hub.requests.append(Request("GET", self.path, {k.lower(): v for k, v in self.headers.items()}, b""))
                if self.path == "/api/whoami-v2":
                    self._reply(200, hub.whoami)
                else:
                    self._reply(404, {"error": f"fake hub: no GET {self.path}"})

            def _reply(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if path == "/api/repos/create":
            spec = json.loads(body)
            self.repos.append(spec)
            repo = f"{spec.get('organization') or 'me'}/{spec['name']}"
            return 200, {"url": f"{self.url}/{repo}", "name": repo}
        if m := re.fullmatch(r"/api/models/(.+)/branch/(.+)", path):
            self.branches.append(f"{m.group(1)}@{m.group(2)}")
            return 200, {}
        if path == "/api/validate-yaml":  # upload_folder has the Hub check a README.md's YAML header first
            return 200, {"errors": [], "warnings": []}
        if m := re.fullmatch(r"/api/models/(.+)/preupload/(.+)", path):
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                   for f in files]}
        if m := re.fullmatch(r"/api/models/(.+)/commit/(.+)", path):
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "header":
                    self.commits.append({**item["value"], "repo": m.group(1), "revision": m.group(2)})
                elif item["key"] == "file":
                    self.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return 200, {"commitUrl": f"{self.url}/{m.group(1)}/commit/0123abcd", "commitOid": "0123abcd"}
        return 404, {"error": f"fake hub: no POST {path}"}
