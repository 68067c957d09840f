"""docker-compose.yml, docker/Dockerfile and the Makefile's torch install, checked against
the service they deploy.

No Docker daemon runs on this project's machines (nor `docker compose`), so these tests read
the files: the compose file's structure, that its settings are ones `Settings` knows and
accepts, that the pieces point at each other (addresses, ports, the shared storage path),
that the images pin what the Makefile pins and from the right index (CPU, or CUDA for the
`gpu` profile's node), and that no secret is written into the repository.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from sqlalchemy.engine import make_url

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERIGNORE = ROOT / ".dockerignore"
MAKEFILE = ROOT / "Makefile"

ENV_PREFIX = Settings.model_config["env_prefix"]
SETTING_ENV_NAMES = {f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields}
RAY_DASHBOARD_DEFAULT_PORT = 8265

# Compose interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}.
_INTERPOLATION = re.compile(r"\$\{(?P<name>\w+)(?P<op>:?[-?+])?(?P<arg>[^}]*)\}")
_REQUIRED_VARIABLE = re.compile(r"\$\{\w+:\?[^}]*\}")
_SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|_KEY$", re.IGNORECASE)


def placeholder(name: str) -> str:
    return f"placeholder-{name}"


def interpolate(value: str) -> str:
    """What compose would pass to the container, with every variable a placeholder."""
    value = value.replace("$$", "\0")
    value = _INTERPOLATION.sub(lambda m: placeholder(m["name"]), value)
    return value.replace("\0", "$")


def interpolate_defaults(value: str) -> str:
    """What compose would pass with no variable set: `${VAR:-default}` gives its default."""
    value = value.replace("$$", "\0")
    value = _INTERPOLATION.sub(
        lambda m: m["arg"] if m["op"] in ("-", ":-") else placeholder(m["name"]), value
    )
    return value.replace("\0", "$")


def variables(value: str) -> set[str]:
    return {m["name"] for m in _INTERPOLATION.finditer(value.replace("$$", ""))}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment as written (variables not substituted), list or mapping form."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(a) for a in cmd]


def flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


def named_mounts(service: dict[str, Any], compose: dict[str, Any]) -> dict[str, PurePosixPath]:
    """{named volume: mount path in the container}, short and long syntax; writable only."""
    declared = set(compose.get("volumes") or {})
    mounts = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            source, _, rest = volume.partition(":")
            target, _, mode = rest.partition(":")
            read_only = "ro" in mode.split(",")
        else:
            source, target = volume.get("source", ""), volume.get("target", "")
            read_only = bool(volume.get("read_only"))
        if source in declared and not read_only:
            mounts[source] = PurePosixPath(target)
    return mounts


def healthcheck_text(service: dict[str, Any]) -> str:
    test = (service.get("healthcheck") or {}).get("test") or []
    return test if isinstance(test, str) else " ".join(str(part) for part in test)


@pytest.fixture
def api_settings(services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The api container's Settings, built as `tuneyard serve` builds them there."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in environment(services["api"]).items():
        monkeypatch.setenv(name, interpolate(value))
    args = command(services["api"])
    overrides: dict[str, Any] = {
        key: value
        for key, value in {"host": flag(args, "--host"), "port": flag(args, "--port")}.items()
        if value is not None
    }
    return Settings(**overrides)


class TestServices:
    def test_postgres_ray_head_and_api_exist(self, services: dict[str, Any]) -> None:
        assert {"postgres", "ray-head", "api"} <= set(services)

    def test_every_service_has_a_health_check(self, services: dict[str, Any]) -> None:
        for name in ("postgres", "ray-head", "api"):
            assert healthcheck_text(services[name]), f"{name} has no healthcheck"
        assert "pg_isready" in healthcheck_text(services["postgres"])

    def test_api_waits_for_a_healthy_database_and_ray_head(self, services: dict[str, Any]) -> None:
        depends_on = services["api"].get("depends_on")
        assert isinstance(depends_on, dict), "api.depends_on must name conditions"
        for name in ("postgres", "ray-head"):
            assert depends_on.get(name, {}).get("condition") == "service_healthy", name

    def test_api_runs_the_service_on_all_interfaces(
        self, services: dict[str, Any], api_settings: Settings
    ) -> None:
        assert command(services["api"])[:2] == ["tuneyard", "serve"]
        assert api_settings.host == "0.0.0.0"

    def test_api_health_check_asks_the_service(
        self, services: dict[str, Any], api_settings: Settings
    ) -> None:
        assert f":{api_settings.port}/healthz" in healthcheck_text(services["api"])

    def test_api_port_is_published(self, services: dict[str, Any], api_settings: Settings) -> None:
        targets = set()
        for port in services["api"].get("ports") or []:
            if isinstance(port, dict):
                targets.add(int(port["target"]))
            else:
                targets.add(int(str(port).rsplit(":", 1)[-1].split("/")[0]))
        assert api_settings.port in targets

    def test_ray_head_starts_a_blocking_head_with_a_reachable_dashboard(
        self, services: dict[str, Any]
    ) -> None:
        args = command(services["ray-head"])
        assert args[:2] == ["ray", "start"]
        assert {"--head", "--block"} <= set(args)
        # Bound to loopback, the dashboard (job submission) would be out of the API's reach.
        assert flag(args, "--dashboard-host") == "0.0.0.0"


class TestSettings:
    def test_every_tuneyard_variable_is_a_setting(self, services: dict[str, Any]) -> None:
        for name, service in services.items():
            unknown = {
                var
                for var in environment(service)
                if var.startswith(ENV_PREFIX) and var not in SETTING_ENV_NAMES
            }
            assert not unknown, f"{name} sets {sorted(unknown)}, which Settings does not read"

    def test_api_environment_makes_valid_settings_for_a_cluster(
        self, api_settings: Settings
    ) -> None:
        assert api_settings.auth == "apikey"
        # Without a Ray address the service would start a Ray head of its own in its container.
        assert api_settings.ray_address
        assert api_settings.database_url
        assert api_settings.storage_path

    def test_database_url_points_at_the_postgres_service(
        self, services: dict[str, Any], api_settings: Settings
    ) -> None:
        postgres = environment(services["postgres"])
        url = make_url(api_settings.resolved_database_url)
        assert url.drivername == "postgresql+psycopg"
        assert url.host == "postgres"
        assert url.port in (None, 5432)
        assert url.username == postgres["POSTGRES_USER"]
        assert url.database == postgres["POSTGRES_DB"]
        (password_variable,) = variables(postgres["POSTGRES_PASSWORD"])
        assert url.password == placeholder(password_variable)

    def test_ray_address_is_the_ray_head_dashboard(
        self, services: dict[str, Any], api_settings: Settings
    ) -> None:
        address = urlsplit(api_settings.ray_address or "")
        dashboard_port = flag(command(services["ray-head"]), "--dashboard-port")
        assert address.scheme == "http"
        assert address.hostname == "ray-head"
        assert address.port == int(dashboard_port or RAY_DASHBOARD_DEFAULT_PORT)

    def test_callback_url_is_the_api_service(self, api_settings: Settings) -> None:
        callback = urlsplit(api_settings.resolved_callback_url)
        assert callback.hostname == "api"
        assert callback.port == api_settings.port

    def test_storage_and_inputs_are_shared_at_the_same_path(
        self, compose: dict[str, Any], services: dict[str, Any], api_settings: Settings
    ) -> None:
        """Workers on the Ray head write checkpoints where the API reads them, and read the
        models, datasets and uploads the API checked, under the very same paths."""
        api_mounts = named_mounts(services["api"], compose)
        ray_mounts = named_mounts(services["ray-head"], compose)
        shared_paths = {
            "TUNEYARD_STORAGE_PATH": api_settings.storage.root,
            **{
                f"TUNEYARD_ALLOWED_ROOTS ({root})": root
                for root in api_settings.resolved_allowed_roots
            },
        }
        for what, path in shared_paths.items():
            volumes = [
                name
                for name, target in api_mounts.items()
                if PurePosixPath(path).is_relative_to(target) and ray_mounts.get(name) == target
            ]
            assert volumes, f"{what} is not on a volume the ray-head mounts at the same path"

    def test_ray_token_auth_is_on_with_one_token_on_both_sides(
        self, services: dict[str, Any]
    ) -> None:
        head, api = environment(services["ray-head"]), environment(services["api"])
        assert head.get("RAY_AUTH_MODE") == "token"
        assert api.get("RAY_AUTH_MODE") == "token"
        assert variables(head.get("RAY_AUTH_TOKEN", ""))
        assert variables(head["RAY_AUTH_TOKEN"]) == variables(api.get("RAY_AUTH_TOKEN", ""))


class TestSecrets:
    def test_secrets_come_only_from_required_variables(self, services: dict[str, Any]) -> None:
        for name, service in services.items():
            for var, value in environment(service).items():
                if _SECRET_NAME.search(var):
                    assert _REQUIRED_VARIABLE.fullmatch(value), (
                        f"{name}.{var} must be a required variable like ${{{var}:?...}}, "
                        f"not {value!r}"
                    )
            for var, value in environment(service).items():
                if var.endswith("DATABASE_URL"):
                    password = make_url(interpolate(value)).password
                    assert password is None or password in map(placeholder, variables(value)), (
                        f"{name}.{var} has a literal password"
                    )

    def test_env_example_lists_every_required_variable_without_a_value(self) -> None:
        text = COMPOSE_FILE.read_text()
        required = {m["name"] for m in _INTERPOLATION.finditer(text) if m["op"] == ":?"}
        assert required
        example = dict(
            line.split("=", 1)
            for line in ENV_EXAMPLE.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        )
        for name in required:
            assert name in example, f".env.example does not mention {name}"
            assert example[name].strip() == "", f".env.example gives {name} a value"


# -- the image ----------------------------------------------------------------------------


def dockerfile_stages(
    path: Path, build_args: dict[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """{stage: {"parent": FROM, "steps": [(INSTRUCTION, arguments)]}}, ARGs expanded: a build
    argument where one is given, else the ARG's default."""
    build_args = build_args or {}
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: dict[str, dict[str, Any]] = {}
    args: dict[str, str] = {}
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            parts = [part for part in rest.split() if not part.startswith("--")]
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(stages))
            current = stages[name] = {"parent": parts[0], "steps": []}
            continue
        if instruction == "ARG":
            key, _, value = rest.partition("=")
            key = key.strip()
            args[key] = build_args.get(key, value.strip().strip("\"'"))
        for key, value in args.items():
            rest = re.sub(rf"\$(\{{{key}\}}|{key}\b)", lambda _, v=value: v, rest)
        assert current is not None, f"{path}: {instruction} before FROM"
        current["steps"].append((instruction, rest))
    return stages


def stage_steps(stages: dict[str, dict[str, Any]], target: str) -> list[tuple[str, str]]:
    """Every step that builds `target`, its parent stages' first."""
    chain = []
    name: str | None = target
    while name in stages:
        chain.append(stages[name])
        name = stages[name]["parent"]
    return [step for stage in reversed(chain) for step in stage["steps"]]


def installs_project(run: str) -> bool:
    if "pip install" not in run:
        return False
    tokens = shlex.split(run.split("pip install", 1)[1].split("&&")[0])
    return "." in tokens


def build_args(service: dict[str, Any]) -> dict[str, str]:
    """A service's build arguments as compose passes them with no variable set."""
    args = (service.get("build") or {}).get("args") or {}
    if isinstance(args, list):
        args = dict(item.split("=", 1) for item in args if "=" in item)
    return {str(k): interpolate_defaults(str(v)) for k, v in args.items()}


def declared_args(path: Path) -> set[str]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return {
        line.split(None, 1)[1].split("=", 1)[0].strip()
        for line in text.splitlines()
        if line.strip().upper().startswith("ARG ")
    }


def requests_gpus(service: dict[str, Any]) -> bool:
    """`gpus: all` (or a count or device list), or a device reservation with the gpu
    capability (deploy.resources.reservations.devices)."""
    if service.get("gpus"):
        return True
    devices = (
        ((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
    ).get("devices") or []
    return any("gpu" in (device.get("capabilities") or []) for device in devices)


def torch_installs(steps: list[tuple[str, str]]) -> list[str]:
    """The RUN steps that pip install torch."""
    return [
        rest
        for instruction, rest in steps
        if instruction == "RUN" and "pip install" in rest and re.search(r"\btorch\b", rest)
    ]


@pytest.fixture(scope="module")
def builds(services: dict[str, Any]) -> dict[str, list[tuple[str, str]]]:
    """{service: the Dockerfile steps of its image} for the services built from this repo,
    with the service's build arguments in place of the ARG defaults."""
    result = {}
    for name, service in services.items():
        build = service.get("build")
        if not build:
            continue
        context = ROOT / build.get("context", ".")
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: no {dockerfile}"
        stages = dockerfile_stages(dockerfile, build_args(service))
        target = build.get("target") or list(stages)[-1]
        assert target in stages, f"{name}: {dockerfile.name} has no stage {target!r}"
        result[name] = stage_steps(stages, target)
    return result


class TestImage:
    def test_ray_head_and_api_are_built_from_this_repository(
        self, builds: dict[str, list[tuple[str, str]]]
    ) -> None:
        assert {"ray-head", "api"} <= set(builds)

    def test_torch_is_the_makefiles_pin_from_the_cpu_or_a_cuda_index(
        self, services: dict[str, Any], builds: dict[str, list[tuple[str, str]]]
    ) -> None:
        """The pin names a version, the index the build: PyPI's torch==2.13.0 is the CUDA
        build on Linux, so the CPU images say the CPU index and the GPU node a CUDA one."""
        match = re.search(r"^TORCH\s*\?=\s*(\S+)\s*$", MAKEFILE.read_text(), re.MULTILINE)
        assert match, "the Makefile has no TORCH ?= line"
        torch = match[1]
        for name, steps in builds.items():
            runs = [rest for instruction, rest in steps if instruction == "RUN"]
            pins = {pin for run in runs for pin in re.findall(r"torch==[\w.+]+", run)}
            assert pins == {torch}, f"{name}: torch pinned as {pins}, the Makefile says {torch}"
            index = (
                r"download\.pytorch\.org/whl/cu\d+"
                if requests_gpus(services[name])
                else r"download\.pytorch\.org/whl/cpu"
            )
            installs = torch_installs(steps)
            assert installs, f"{name}: the image does not pip install torch"
            assert all(
                torch in run and re.search(rf"--index-url[ =]\S*{index}", run) for run in installs
            ), f"{name}: torch is not installed from {index}: {installs}"

    def test_images_install_the_project_and_its_dependencies(
        self, builds: dict[str, list[tuple[str, str]]]
    ) -> None:
        """The Ray image gets Ray, DeepSpeed and transformers at pyproject's versions; the API
        image also carries the migrations it applies at start (see app/storage/migrate.py)."""
        for name, steps in builds.items():
            copied = " ".join(rest for instruction, rest in steps if instruction == "COPY")
            for needed in (
                "pyproject.toml",
                "app",
                "worker",
                "contract",
                "alembic.ini",
                "migrations",
            ):
                assert re.search(rf"(^|\s|/){re.escape(needed)}(\s|/|$)", copied), (
                    f"{name}: the image does not copy {needed}"
                )
            runs = [rest for instruction, rest in steps if instruction == "RUN"]
            project = [i for i, run in enumerate(runs) if installs_project(run)]
            assert project, f"{name}: the image does not pip install the project"
            if "--no-deps" in runs[project[-1]]:
                assert any(
                    "pyproject.toml" in run and "dependencies" in run and "pip install -r" in run
                    for run in runs[: project[-1]]
                ), f"{name}: the project is installed --no-deps, its dependencies never"

    def test_dockerignore_keeps_local_state_and_secrets_out(self) -> None:
        ignored = {
            line.strip().rstrip("/")
            for line in DOCKERIGNORE.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        }
        assert {".venv", ".tuneyard", ".env", "tests"} <= ignored


# -- GPUs: the compose profile and the Makefile's torch -----------------------------------


def profiles(service: dict[str, Any]) -> set[str]:
    return set(service.get("profiles") or [])


@pytest.fixture(scope="module")
def gpu_nodes(services: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: service for name, service in services.items() if "gpu" in profiles(service)}


class TestGpuProfile:
    def test_the_default_deployment_has_no_profile_and_no_gpu(
        self, services: dict[str, Any]
    ) -> None:
        """`docker compose up` starts exactly the CPU deployment, on hosts without GPUs."""
        default = {name for name, service in services.items() if not profiles(service)}
        assert default == {"postgres", "ray-head", "api"}
        assert not any(requests_gpus(services[name]) for name in default)

    def test_the_gpu_profile_adds_a_ray_node_that_requests_the_gpus(
        self, gpu_nodes: dict[str, dict[str, Any]]
    ) -> None:
        assert gpu_nodes, "no service in the gpu profile"
        for name, service in gpu_nodes.items():
            assert requests_gpus(service), f"{name} does not request GPUs"
            assert command(service)[:2] == ["ray", "start"], name

    def test_the_gpu_node_joins_the_head_with_its_token(
        self, services: dict[str, Any], gpu_nodes: dict[str, dict[str, Any]]
    ) -> None:
        head = services["ray-head"]
        gcs_port = flag(command(head), "--port") or "6379"
        head_token = variables(environment(head)["RAY_AUTH_TOKEN"])
        for name, service in gpu_nodes.items():
            args = command(service)
            assert "--head" not in args, name
            assert "--block" in args, f"{name}: without --block the container exits"
            assert flag(args, "--address") == f"ray-head:{gcs_port}", name
            env = environment(service)
            assert env.get("RAY_AUTH_MODE") == "token", name
            assert variables(env.get("RAY_AUTH_TOKEN", "")) == head_token, name
            depends_on = service.get("depends_on") or {}
            assert depends_on.get("ray-head", {}).get("condition") == "service_healthy", name

    def test_the_gpu_node_shares_the_heads_storage_at_the_same_path(
        self, compose: dict[str, Any], services: dict[str, Any], gpu_nodes: dict[str, Any]
    ) -> None:
        """Its training workers write checkpoints where the API reads them."""
        head_mounts = named_mounts(services["ray-head"], compose)
        for name, service in gpu_nodes.items():
            assert named_mounts(service, compose) == head_mounts, name

    def test_the_build_argument_reaches_the_torch_install(
        self,
        services: dict[str, Any],
        gpu_nodes: dict[str, dict[str, Any]],
        builds: dict[str, list[tuple[str, str]]],
    ) -> None:
        """The GPU node is the head's image but for one build argument, which the Dockerfile
        declares and its torch install uses: the installs differ in the index only."""
        cpu_install = torch_installs(builds["ray-head"])
        for name, service in gpu_nodes.items():
            build = service.get("build") or {}
            assert build.get("target") == services["ray-head"]["build"]["target"], name
            dockerfile = ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
            args = build_args(service)
            assert args, f"{name} passes no build argument"
            assert set(args) <= declared_args(dockerfile), f"{name}: {set(args)} not ARGs"
            gpu_install = torch_installs(builds[name])
            assert gpu_install != cpu_install, f"{name}: its torch install is the head's"
            assert [re.sub(r"https://\S+", "URL", run) for run in gpu_install] == [
                re.sub(r"https://\S+", "URL", run) for run in cpu_install
            ], f"{name}: the installs differ in more than the index"

    def test_the_gpu_node_checks_that_torch_sees_a_gpu(
        self, gpu_nodes: dict[str, dict[str, Any]]
    ) -> None:
        for name, service in gpu_nodes.items():
            assert "torch.cuda" in healthcheck_text(service), name


def make_dry_run(tmp_path: Path, *variables: str) -> list[str]:
    """The torch install `make setup` would run, as the shell splits it, without running it
    (-n: print only; -B: as if nothing were built; a venv path of its own)."""
    done = subprocess.run(
        ["make", "-n", "-B", "setup", f"VENV={tmp_path / 'venv'}", *variables],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    installs = [line for line in done.stdout.splitlines() if "pip install" in line]
    assert installs, done.stdout
    words = shlex.split(installs[0])
    return words[words.index("install") + 1 :]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
class TestMakefileTorch:
    CUDA = "https://download.pytorch.org/whl/cu128"

    def test_by_default_torch_comes_from_pips_own_configuration(self, tmp_path: Path) -> None:
        """Unchanged for this project's machines and CI: pip finds the CPU build on disk."""
        assert make_dry_run(tmp_path) == ["--quiet", "torch==2.13.0"]

    def test_torch_index_picks_the_build(self, tmp_path: Path) -> None:
        assert make_dry_run(tmp_path, f"TORCH_INDEX={self.CUDA}") == [
            "--quiet",
            "torch==2.13.0",
            "--index-url",
            self.CUDA,
        ]

    def test_torch_may_carry_the_index_url_itself(self, tmp_path: Path) -> None:
        torch = f"torch==2.13.0 --index-url {self.CUDA}"
        assert make_dry_run(tmp_path, f"TORCH={torch}") == [
            "--quiet",
            "torch==2.13.0",
            "--index-url",
            self.CUDA,
        ]

    def test_a_version_range_stays_one_argument(self, tmp_path: Path) -> None:
        """Unquoted, `>` would be a shell redirection."""
        assert make_dry_run(tmp_path, "TORCH=torch>=2.13,<2.14") == ["--quiet", "torch>=2.13,<2.14"]
