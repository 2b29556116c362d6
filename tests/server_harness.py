"""Real `mlx_lm.server` subprocesses for the server tests: start one on a model
directory with any flags, wait until it listens, talk to it over HTTP."""

import http.client
import json
import re
import subprocess
import sys
import time

import openai
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint


def write_server_models(root):
    """Tiny checkpoints for server tests: a dense target, a draft that agrees with it
    about half of the time (its weights shrunk), and a hybrid (Gated DeltaNet) target."""
    return {
        "dense": write_checkpoint(root / "dense", TINY_CONFIGS["qwen3"]),
        "draft": write_checkpoint(root / "draft", TINY_CONFIGS["qwen3"], scale=0.45),
        "hybrid": write_checkpoint(root / "hybrid", TINY_CONFIGS["qwen3_next"]),
    }


def start_server(name, model_dir, log_path, draft_dir=None, flags=()):
    """Start `mlx_lm.server` on any free port; call `wait_ready()` on the result."""
    command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", "0", *flags]
    if draft_dir is not None:
        command += ["--draft-model", str(draft_dir)]
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_file)
    return Server(name, process, log_path, model_dir, draft_dir)


def stop_all(servers):
    """Terminate every server, then wait for each (they stop in parallel)."""
    for server in servers:
        server.process.terminate()
    for server in servers:
        server.process.wait(timeout=30)


class Server:
    def __init__(self, name, process, log_path, target_dir, draft_dir):
        self.name, self.process, self.log_path = name, process, log_path
        self.target_dir, self.draft_dir = target_dir, draft_dir
        self.url = None

    def wait_ready(self, timeout=120.0):
        deadline = time.time() + timeout
        while self.url is None:
            match = re.search(r"on (http://[\d.]+:\d+)", self.log())
            if match:
                self.url = match.group(1)
            elif self.process.poll() is not None or time.time() > deadline:
                pytest.fail(f"server {self.name} did not start:\n{self.log()}")
            else:
                time.sleep(0.1)
        return self

    def log(self):
        return self.log_path.read_text()

    @property
    def address(self):
        host, port = self.url[len("http://"):].split(":")
        return host, int(port)

    @property
    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def raw(self, method, path, body=None, headers=None):
        """(status, decoded JSON body) of a request sent as is."""
        connection = http.client.HTTPConnection(*self.address, timeout=60)
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response.status, json.loads(data) if data else None
