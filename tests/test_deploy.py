"""The deployment files (Dockerfile, .dockerignore, deploy/kubernetes.yaml, deploy/vserve.service, docs/deploy.md)
refer only to what exists: vserve subcommands and flags of the typer app, routes of the FastAPI app, one port
throughout; and the Dockerfile's build-time `vserve download` step runs (and fails cleanly offline)."""

import configparser
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from vserve.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
K8S = ROOT / "deploy" / "kubernetes.yaml"
UNIT = ROOT / "deploy" / "vserve.service"
DOCS = ROOT / "docs" / "deploy.md"
VENV_BIN = Path(sys.executable).parent


# ---- the CLI and the server, as they are ------------------------------------------------------------------

CLI = typer.main.get_command(app)


def command(path: list[str]):
    """The click command for `vserve <path...>`, failing the test when a subcommand does not exist."""
    cmd = CLI
    for name in path:
        assert name in getattr(cmd, "commands", {}), f"`vserve {' '.join(path)}`: no such command"
        cmd = cmd.commands[name]
    return cmd


def options(cmd) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")} | {"--help", "-h"}


def check_vserve(argv: list[str], where: str) -> tuple:
    """argv after `vserve`: the subcommand path exists and every option it is given is one of its options.
    Returns the command and its arguments."""
    path, cmd = [], CLI
    while hasattr(cmd, "commands"):  # a group (typer vendors click: no click.Group to test for)
        assert argv[len(path):], f"{where}: `vserve {' '.join(argv)}` names no subcommand"
        path.append(argv[len(path)])
        cmd = command(path)
    args = argv[len(path):]
    known = options(cmd)
    for token in args:
        if token.startswith("-") and not re.fullmatch(r"-\d[\d.]*", token):
            flag = token.split("=", 1)[0]
            assert flag in known, f"{where}: `vserve {' '.join(path)}` has no option {flag}"
    return cmd, args


def flag_value(args: list[str], flag: str) -> str | None:
    for i, token in enumerate(args):
        if token == flag:
            return args[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def default(cmd, flag: str):
    return next(p.default for p in cmd.params if flag in p.opts)


SERVE = command(["serve"])


def serve_port(args: list[str]) -> int:
    """The port `vserve serve args...` listens on."""
    return int(flag_value(args, "--port") or default(SERVE, "--port"))


def drain(args: list[str]) -> float:
    """The seconds `vserve serve args...` drains for after SIGTERM."""
    return float(flag_value(args, "--drain-timeout") or default(SERVE, "--drain-timeout"))


@pytest.fixture(scope="module")
def server_app():
    """The real FastAPI app, without a model: no engine, an API key set (as a deployment would)."""
    from vserve.core.server.app import ServerSettings, build_app

    return build_app(None, ServerSettings(served_model_name="m", api_key="s3cret"))


@pytest.fixture(scope="module")
def routes(server_app) -> set[str]:
    return {r.path for r in server_app.routes if "GET" in (getattr(r, "methods", None) or ())}


def test_health_and_metrics_answer_without_the_api_key(server_app):
    """Probes and Prometheus send no key: those two routes must not ask for one (while /v1 does)."""
    from fastapi.testclient import TestClient

    client = TestClient(server_app)
    assert client.get("/health").status_code == 200
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert client.get("/v1/models").status_code == 401


# ---- Dockerfile -------------------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comment lines dropped, as docker reads it."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.strip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        if buf.strip():
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf.strip(), "the Dockerfile ends inside a continued line"
    return out


def instructions(name: str) -> list[str]:
    return [rest for word, rest in dockerfile() if word == name]


def only(name: str) -> str:
    found = instructions(name)
    assert len(found) == 1, f"expected one {name}, found {found}"
    return found[0]


def arg_defaults() -> dict[str, str]:
    found = {}
    for rest in instructions("ARG"):
        name, _, value = rest.partition("=")
        found[name] = value.strip('"')
    return found


def cmd_args() -> list[str]:
    return json.loads(only("CMD"))


def test_dockerfile_base_image_user_and_entrypoint():
    args = arg_defaults()
    base = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], only("FROM"))
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", base), base
    assert args["MODEL"] == "", "MODEL is empty by default: nothing baked in unless asked"
    assert json.loads(only("ENTRYPOINT")) == ["vserve", "serve"]
    user = only("USER").split(":")[0]
    assert user not in ("root", "0"), "the server must not run as root"
    run = " ".join(instructions("RUN"))
    assert re.search(rf"useradd\b[^&;]*--uid {user}\b", run), "USER names the uid the image creates"
    index = re.search(r"pip install [^&;]*\btorch --index-url \"?\$\{?(\w+)", run)
    assert index and re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args[index.group(1)]), \
        "a CUDA build of torch"
    assert ". /opt/vserve" in instructions("COPY") and "pip install --no-cache-dir /opt/vserve" in run
    # USER comes after the installs (they write to /opt) and before the build-time download (files owned by it).
    order = [word for word, _ in dockerfile()]
    download = next(i for i, (w, r) in enumerate(dockerfile()) if w == "RUN" and "vserve download" in r)
    assert order.index("USER") < download


def test_dockerfile_cmd_flags_exist_and_bind_every_interface():
    _, args = check_vserve(["serve", *cmd_args()], "Dockerfile CMD")
    assert flag_value(args, "--host") == "0.0.0.0", "inside a container 127.0.0.1 is unreachable from outside"
    assert only("EXPOSE") == str(serve_port(args))


def test_dockerfile_healthcheck_hits_health_on_the_served_port(routes):
    check = only("HEALTHCHECK")
    url = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/\S*?)['\"\s]", check)
    assert url, check
    assert int(url.group(1)) == serve_port(cmd_args())
    assert url.group(2) == "/health" and "/health" in routes
    assert "--start-period=" in check, "model download and load take minutes"


def test_dockerfile_hf_cache_is_under_models():
    env = " ".join(instructions("ENV"))
    home = re.search(r"\bHF_HOME=(\S+)", env)
    assert home and home.group(1).startswith("/models"), env
    assert re.search(r"chown \S+ /models", " ".join(instructions("RUN"))), "/models writable by the server's user"


def download_step() -> str:
    """The shell command of the RUN that downloads MODEL, without its --mount flags."""
    run = next(r for r in instructions("RUN") if "vserve download" in r)
    return re.sub(r"^(--\S+\s+)+", "", run)


def run_download_step(tmp_path, model: str):
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "MODEL": model,
           "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "VSERVE_NO_PROGRESS": "1", "COLUMNS": "200"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(["sh", "-c", download_step()], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def vserve_on_path():
    if not (VENV_BIN / "vserve").exists():
        pytest.skip(f"no vserve script next to {sys.executable}")


def test_dockerfile_download_step_parses_and_fails_cleanly_offline(tmp_path, vserve_on_path):
    """The build's `vserve download "$MODEL"` as written: with no MODEL it does nothing; with a model that is not in
    the (empty) cache and the hub off it exits 2 with one error line naming the model."""
    step = download_step()
    check_vserve(shlex.split(step[step.index("vserve download"):].split(";")[0])[1:], "Dockerfile RUN")
    res = run_download_step(tmp_path, "")
    assert (res.returncode, res.stdout) == (0, ""), res.stderr
    res = run_download_step(tmp_path, "no-such-org/no-such-model")
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no-such-org/no-such-model" in lines[0], lines
    assert "HF_HUB_OFFLINE" in lines[0]


def test_download_help():
    res = CliRunner().invoke(app, ["download", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for flag in ("--revision", "--download-dir", "--gguf-file", "--hf-token", "--tokenizer-only"):
        assert flag in res.output


def dockerignore_patterns() -> list[str]:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    return [line.rstrip("/") for line in lines if line and not line.startswith("#")]


def _glob_regex(pattern: str) -> re.Pattern:
    """Docker's (Go's filepath.Match) glob: * and ? stop at /, **/ spans folders."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
            continue
        if pattern.startswith("**", i):
            out, i = out + ".*", i + 2
            continue
        out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
        i += 1
    return re.compile(out + r"\Z")


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether docker leaves `path` out of the build context: the last pattern matching it, or one of the folders
    above it, decides (a ! pattern keeps it)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    hit = False
    for pattern in patterns:
        regex = _glob_regex(pattern.lstrip("!"))
        if any(regex.match(p) for p in prefixes):
            hit = not pattern.startswith("!")
    return hit


def test_dockerignore_keeps_what_pip_install_needs():
    patterns = dockerignore_patterns()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", cfg["project"]["readme"], "__init__.py", "profiles/h200.yaml"]
    needed += [p.removeprefix("vserve.").replace(".", "/") + "/__init__.py"
               for p in cfg["tool"]["setuptools"]["packages"] if p != "vserve"]
    for path in needed:
        assert not ignored(path, patterns), f".dockerignore drops {path}, which pip install /opt/vserve needs"
    for path in (".venv/bin/python", ".git/HEAD", "tests/test_deploy.py", "cli/__pycache__/main.cpython-312.pyc"):
        assert ignored(path, patterns), f".dockerignore keeps {path} in the build context"


# ---- Kubernetes -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert len(set(kinds)) == len(kinds), kinds
    return {d["kind"]: d for d in docs}


def container(k8s) -> dict:
    (c,) = k8s["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def test_k8s_deployment_shape(k8s):
    dep = k8s["Deployment"]
    assert dep["apiVersion"] == "apps/v1" and dep["spec"]["replicas"] == 1
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert k8s["Service"]["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    c = container(k8s)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "command" not in c, "the image's ENTRYPOINT (vserve serve) runs; args follow it"
    uid = int(only("USER").split(":")[0])
    assert pod["spec"]["securityContext"]["runAsUser"] == uid and pod["spec"]["securityContext"]["runAsNonRoot"]
    token = next(e for e in c["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["optional"] is True


def test_k8s_args_exist_and_drain_fits_the_grace_period(k8s):
    _, args = check_vserve(["serve", *container(k8s)["args"]], "kubernetes.yaml args")
    assert flag_value(args, "--host") == "0.0.0.0"
    grace = k8s["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain(args), "the pod is killed before in-flight requests drain"


def test_k8s_one_port_throughout(k8s):
    c = container(k8s)
    port = serve_port(c["args"])
    assert port == serve_port(cmd_args()), "the same port as the image's CMD"
    (cport,) = c["ports"]
    assert cport["containerPort"] == port
    names = {cport.get("name"): port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c[probe]["httpGet"]["port"]
        assert names.get(p, p) == port, probe
    (sport,) = k8s["Service"]["spec"]["ports"]
    assert sport["port"] == port and names.get(sport["targetPort"], sport["targetPort"]) == port
    annotations = k8s["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)


def test_k8s_probes_and_prometheus_use_real_routes(k8s, routes):
    c = container(k8s)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health" in routes, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model load takes minutes"
    annotations = k8s["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"  # a string: annotations are strings
    assert annotations["prometheus.io/path"] == "/metrics" in routes


def test_k8s_shm_is_memory_and_models_volume_mounted(k8s):
    spec = k8s["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container(k8s)["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    models = volumes[mounts["/models"]]
    claim = models.get("persistentVolumeClaim", {}).get("claimName")
    assert claim is None or claim == k8s["PersistentVolumeClaim"]["metadata"]["name"]


# ---- systemd ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_systemd_unit(unit):
    svc = unit["Service"]
    assert svc["User"] not in ("root", "0")
    argv = shlex.split(svc["ExecStart"])
    assert argv[0] == "/opt/vserve/.venv/bin/vserve"
    _, args = check_vserve(argv[1:], "vserve.service ExecStart")
    assert argv[1] == "serve"
    assert svc["KillSignal"] == "SIGTERM" and svc["Restart"] == "on-failure"
    assert float(svc["TimeoutStopSec"]) > drain(args)
    assert svc["EnvironmentFile"] == "-/etc/vserve/env"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    env = UNIT.read_text()
    assert re.search(r"^Environment=HF_HOME=/\S+", env, re.M) and re.search(r"^Environment=HF_HUB_OFFLINE=1", env, re.M)


# ---- docs/deploy.md ---------------------------------------------------------------------------------------

_SEPARATORS = {"&&", "||", "|", ";", "&"}
_DOCKER_RUN_VALUE_FLAGS = {"-p", "-v", "-e", "--gpus", "--shm-size", "--stop-timeout", "--entrypoint", "--name",
                           "--health-cmd", "--ipc", "--mount", "--env-file", "-u", "--user"}


def doc_commands() -> list[tuple[list[str], str]]:
    """Every command line in docs/deploy.md's bash blocks and inline code, split into simple commands (argv)."""
    text = DOCS.read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")
    lines += re.findall(r"`([^`]+)`", prose)
    found = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            tokens = list(lexer)
        except ValueError:  # prose in backticks with an unpaired quote: not a command
            continue
        argv, redirect = [], False
        for token in [*tokens, ";"]:
            if token in _SEPARATORS:
                if argv:
                    found.append((argv, line.strip()))
                argv = []
            elif set(token) <= set("<>"):
                redirect = True  # the next word is a file name, not an argument
            elif redirect:
                redirect = False
            else:
                argv.append(token)
    return found


def program(argv: list[str]) -> list[str]:
    """argv without leading VAR=value words, `sudo [-u USER]` and `env VAR=value`."""
    while argv:
        if re.fullmatch(r"\w+=.*", argv[0]):
            argv = argv[1:]
        elif argv[0] == "sudo":
            argv = argv[1:]
            while argv and argv[0].startswith("-"):
                argv = argv[2:] if argv[0] == "-u" else argv[1:]
        elif argv[0] == "env":
            argv = argv[1:]
        else:
            break
    return argv


def docker_run_vserve_args(argv: list[str]) -> list[str] | None:
    """`docker run [opts] vserve:TAG args...` -> the vserve argv the image runs; None if no vserve image."""
    i, entrypoint = 2, None
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i].split("=", 1)[0]
        takes = flag in _DOCKER_RUN_VALUE_FLAGS and "=" not in argv[i]
        if flag == "--entrypoint":
            entrypoint = argv[i + 1] if takes else argv[i].split("=", 1)[1]
        i += 2 if takes else 1
    if i >= len(argv) or not argv[i].startswith("vserve:"):
        return None
    rest = argv[i + 1:]
    if entrypoint is None:
        return ["serve", *(rest or cmd_args())]
    assert entrypoint == "vserve", entrypoint
    return rest


def test_docs_commands_exist():
    vserve_lines = docker_lines = 0
    for argv, line in doc_commands():
        argv = program(argv)
        if len(argv) < 2:  # nothing, or a bare word such as the user name `vserve`
            continue
        if Path(argv[0]).name == "vserve":
            check_vserve(argv[1:], f"docs/deploy.md `{line}`")
            vserve_lines += 1
        elif argv[:2] == ["docker", "run"]:
            args = docker_run_vserve_args(argv)
            if args is not None:
                cmd, rest = check_vserve(args, f"docs/deploy.md `{line}`")
                if cmd is SERVE and rest:
                    assert flag_value(rest, "--host") == "0.0.0.0", f"docs/deploy.md `{line}`: unreachable"
                    assert re.search(rf"-p (\S+:)?{serve_port(rest)}\b", line), f"{line}: publishes another port"
                docker_lines += 1
        elif argv[:2] == ["docker", "build"]:
            for value in re.findall(r"--build-arg (\w+)=", line):
                assert value in arg_defaults(), f"docs/deploy.md `{line}`: the Dockerfile has no ARG {value}"
    assert vserve_lines >= 10 and docker_lines >= 4, (vserve_lines, docker_lines)


def test_docs_hub_flag_table():
    """The table of hub flags: each is an option of `vserve download`, and of `vserve serve` unless marked."""
    rows = re.findall(r"^\| `(--[\w-]+)[^`]*`( \(download only\))? \|", DOCS.read_text(), re.M)
    assert len(rows) >= 5, rows
    for flag, download_only in rows:
        assert flag in options(command(["download"])), flag
        assert (flag in options(SERVE)) != bool(download_only), flag


def test_docs_match_the_files(k8s, unit):
    text = " ".join(DOCS.read_text().split())
    assert json.dumps(container(k8s)["args"]) in text, "docs/deploy.md quotes the Deployment's args"
    exec_start = shlex.split(unit["Service"]["ExecStart"])
    assert " ".join(exec_start) in text, "docs/deploy.md quotes the unit's ExecStart"
    assert f"`ENTRYPOINT {json.dumps(json.loads(only('ENTRYPOINT')))}`" in text
    assert f"`CMD {json.dumps(cmd_args())}`" in text
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "VSERVE_API_KEY", "models--"):
        assert name in text


def test_links_into_deploy_md_find_their_heading():
    """README.md's and docs/*.md's links to deploy.md#anchor name one of its headings (GitHub's anchor rule)."""
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+ (.+)$", DOCS.read_text(), re.M)}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for anchor in re.findall(r"deploy\.md#([\w-]+)", page.read_text()):
            assert anchor in slugs, f"{page.name} links deploy.md#{anchor}; headings: {sorted(slugs)}"


def test_environment_variables_are_read_where_documented():
    """The variables the deployment files set are the ones vserve and huggingface_hub read."""
    import huggingface_hub.constants as hf

    src = Path(hf.__file__).read_text()
    for name in ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        assert name in src, name
    assert "VSERVE_API_KEY" in (ROOT / "cli" / "serve.py").read_text()
    assert "VSERVE_CACHE" in (ROOT / "ops" / "assets.py").read_text()
