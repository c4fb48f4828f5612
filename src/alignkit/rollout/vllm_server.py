"""Server mode of ``rollout.engine: vllm`` (as ``trl vllm-serve``): ``alignkit vllm-serve MODEL`` runs one vLLM
engine in its own process (on its own devices), and a training run with ``vllm.server_url`` set sends it its
rollouts and pushes its weights after every optimizer step.

HTTP on the given host (loopback by default), one request at a time (the engine is not thread-safe):

* ``GET /health`` -> ``{"ok": true}``;
* ``POST /weights``: the body is a safetensors file of the policy's weights under Hugging Face names
  (LoRA merged), loaded in place (vLLM's ``reload_weights``);
* ``POST /generate``: ``{"requests": [[ids, n, seed], ...], "params": {...}}`` -> ``{"samples": [[ids,
  finish_reason, logps], ...]}`` (``vllm_engine.run_requests``: the same request building and sampling as
  the colocated engine).

One training process talks to a server (several ranks would push and sample concurrently); a run of several
processes uses the colocated engine.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import torch

from alignkit.rollout.vllm_engine import (
    Request,
    SampledCompletion,
    VLLMConfig,
    build_llm,
    check_cpu_head_size,
    load_weights,
    run_requests,
)


class Client:
    """The trainer's side: weights and generation requests to ``url`` (``http://host:port``)."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout

    def _post(self, path: str, body: bytes, kind: str) -> Any:
        req = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": kind}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:  # the server's reason, not just its status
            raise RuntimeError(f"vLLM server {self.url}{path}: {e.read().decode(errors='replace')}") from e

    def health(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return bool(json.loads(resp.read()).get("ok"))
        except OSError:
            return False

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save

        self._post("/weights", save({n: t.detach().cpu().contiguous() for n, t in weights}), "application/octet-stream")

    def generate(self, requests: list[Request], params: dict[str, Any]) -> list[SampledCompletion]:
        body = json.dumps({"requests": [[r.ids, r.n, r.seed] for r in requests], "params": params}).encode()
        return [(ids, reason, logps) for ids, reason, logps in self._post("/generate", body, "application/json")["samples"]]


def make_server(llm: Any, host: str, port: int) -> HTTPServer:
    """An HTTP server answering the module docstring's endpoints with ``llm``."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, payload: dict[str, Any], status: int = 200) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply({"ok": True} if self.path == "/health" else {"error": f"no such path {self.path}"},
                        200 if self.path == "/health" else 404)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                if self.path == "/weights":
                    from safetensors.torch import load

                    load_weights(llm, list(load(body).items()))
                    self._reply({"ok": True})
                elif self.path == "/generate":
                    msg = json.loads(body)
                    todo = [Request(list(ids), int(n), int(seed)) for ids, n, seed in msg["requests"]]
                    self._reply({"samples": run_requests(llm, todo, msg["params"])})
                else:
                    self._reply({"error": f"no such path {self.path}"}, 404)
            except Exception as e:  # noqa: BLE001  (the trainer gets the reason, the server goes on)
                self._reply({"error": f"{type(e).__name__}: {e}"}, 500)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return HTTPServer((host, port), Handler)


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, dtype: str = "auto", device: str = "auto",
          max_model_len: int = 2048, settings: VLLMConfig | None = None) -> None:
    """Load ``model`` (a Hugging Face model dir) into a vLLM engine and answer until interrupted."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if device == "cpu":
        from transformers import AutoConfig

        check_cpu_head_size(AutoConfig.from_pretrained(model))
    llm = build_llm(model, dtype, device, settings or VLLMConfig(gpu_memory_utilization=0.9), max_model_len)
    server = make_server(llm, host, port)
    print(f"alignkit vllm-serve: {model} on http://{host}:{server.server_port} (vllm.server_url)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
