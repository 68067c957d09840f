"""deploy/kuberay/, checked offline against the schemas Kubernetes and KubeRay would apply.

No cluster runs on this project's machines, so these tests read the manifests: every document
is validated strictly (an unknown or misspelt field fails, as `kubeconform -strict` would
report it) — core kinds against Kubernetes' own schemas (the `kubernetes-validate` package
bundles them), the RayCluster against the `openAPIV3Schema` of KubeRay's CRD (vendored in
tests/fixtures/kuberay/) — and then the pieces against each other and against the service:
the API reaches the RayCluster's head Service with the cluster's token, the workers reach
the API's Service, every Secret named exists in secrets.example.yaml, one image runs
everywhere, and `Settings` accepts the API's environment.
"""

from __future__ import annotations

import copy
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from sqlalchemy.engine import make_url

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kuberay"
KUSTOMIZATION = DEPLOY / "kustomization.yaml"
SECRETS_EXAMPLE = DEPLOY / "secrets.example.yaml"
RAYCLUSTER_CRD = ROOT / "tests" / "fixtures" / "kuberay" / "ray.io_rayclusters.yaml"

# The oldest minor that managed clusters (EKS, GKE, AKS) still offered in 2026, and the newest
# the installed kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.32", "1.37")
RAY_DASHBOARD_DEFAULT_PORT = 8265
PLACEHOLDER = "REPLACE-ME"

ENV_PREFIX = Settings.model_config["env_prefix"]
SETTING_ENV_NAMES = {f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields}

Document = dict[str, Any]


def manifest_files() -> list[Path]:
    return sorted(DEPLOY.glob("*.yaml"))


def load_documents(path: Path) -> list[Document]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kubernetes_documents() -> list[tuple[str, Document]]:
    """(file:kind/name, document) for every Kubernetes object under deploy/kuberay/; the
    Kustomization is kustomize's input, not an object, and has tests of its own."""
    return [
        (f"{path.name}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}", doc)
        for path in manifest_files()
        if path != KUSTOMIZATION
        for doc in load_documents(path)
    ]


DOCUMENTS = kubernetes_documents()
CORE_DOCUMENTS = [(key, doc) for key, doc in DOCUMENTS if doc.get("kind") != "RayCluster"]


def only(kind: str) -> Document:
    """The one object of a kind under deploy/kuberay/."""
    found = [doc for _, doc in DOCUMENTS if doc.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} under {DEPLOY}, found {len(found)}"
    return found[0]


# -- schemas ------------------------------------------------------------------------------


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema that refuses unknown fields: `additionalProperties: false`
    wherever properties are listed, unless the node keeps unknown fields on purpose
    (x-kubernetes-preserve-unknown-fields), as kubeconform's strict mode builds it. An
    embedded resource (x-kubernetes-embedded-resource) implicitly has apiVersion, kind
    and metadata."""
    schema = dict(schema)
    if schema.get("x-kubernetes-embedded-resource"):
        implicit = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}}
        schema["properties"] = {
            **implicit,
            "metadata": {"type": "object"},
            **schema.get("properties", {}),
        }
    if "properties" in schema:
        schema["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            schema[key] = strict(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            schema[key] = [strict(sub) for sub in schema[key]]
    return schema


@pytest.fixture(scope="module")
def raycluster_crd() -> Document:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRD is ~1 MB
    crd: Document = yaml.load(RAYCLUSTER_CRD.read_text(), Loader=loader)
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["spec"]["names"]["kind"] == "RayCluster"
    return crd


@pytest.fixture(scope="module")
def raycluster_validator(raycluster_crd: Document) -> jsonschema.protocols.Validator:
    (served,) = [v for v in raycluster_crd["spec"]["versions"] if v["name"] == "v1"]
    assert served["served"], "KubeRay no longer serves ray.io/v1"
    schema = strict(served["schema"]["openAPIV3Schema"])
    return jsonschema.Draft202012Validator(schema)


def schema_errors(validator: jsonschema.protocols.Validator, doc: Document) -> list[str]:
    """Every violation, as `path.to.field: message`, in document order."""
    errors = sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]


def kubernetes_errors(doc: Document, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(str(p) for p in e.path) or '<root>'}: {e.message}"]
    return []


def raycluster_errors(validator: jsonschema.protocols.Validator, doc: Document) -> list[str]:
    errors = schema_errors(validator, doc)
    # The CRD leaves metadata to the API server, which checks it as any object's ObjectMeta:
    # check it with Kubernetes' schema the same way.
    carrier = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata", {})}
    return errors + kubernetes_errors(carrier, KUBERNETES_VERSIONS[-1])


class TestSchemas:
    def test_every_manifest_parses_into_objects(self) -> None:
        kinds = {doc["kind"] for _, doc in DOCUMENTS}
        assert {"RayCluster", "Deployment", "Service", "Secret"} <= kinds
        for key, doc in DOCUMENTS:
            assert doc.get("apiVersion") and doc.get("metadata", {}).get("name"), key

    @pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
    @pytest.mark.parametrize(
        "doc", [doc for _, doc in CORE_DOCUMENTS], ids=[key for key, _ in CORE_DOCUMENTS]
    )
    def test_core_objects_match_the_kubernetes_schema(self, doc: Document, version: str) -> None:
        # A kind without a bundled schema raises SchemaNotFoundError: it must not pass unchecked.
        assert kubernetes_errors(doc, version) == []

    def test_raycluster_matches_kuberays_crd(
        self, raycluster_validator: jsonschema.protocols.Validator
    ) -> None:
        assert raycluster_errors(raycluster_validator, only("RayCluster")) == []


class TestSchemasCatchMistakes:
    """The checks above can fail: the same manifests with one mistake each are refused, and
    the report names the field."""

    def test_a_misspelt_raycluster_field(
        self, raycluster_validator: jsonschema.protocols.Validator
    ) -> None:
        cluster = copy.deepcopy(only("RayCluster"))
        cluster["spec"]["rayVerison"] = cluster["spec"].pop("rayVersion")
        errors = raycluster_errors(raycluster_validator, cluster)
        assert len(errors) == 1 and errors[0].startswith("spec: ")
        assert "'rayVerison' was unexpected" in errors[0]

    def test_a_misspelt_field_in_a_ray_pods_container(
        self, raycluster_validator: jsonschema.protocols.Validator
    ) -> None:
        cluster = copy.deepcopy(only("RayCluster"))
        container = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
        container["volumeMount"] = container.pop("volumeMounts")
        errors = raycluster_errors(raycluster_validator, cluster)
        assert len(errors) == 1, errors
        assert errors[0].startswith("spec.workerGroupSpecs.0.template.spec.containers.0: ")
        assert "'volumeMount' was unexpected" in errors[0]

    def test_a_wrongly_typed_raycluster_value(
        self, raycluster_validator: jsonschema.protocols.Validator
    ) -> None:
        cluster = copy.deepcopy(only("RayCluster"))
        cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
        errors = raycluster_errors(raycluster_validator, cluster)
        assert errors == ["spec.headGroupSpec.rayStartParams.num-cpus: 0 is not of type 'string'"]

    def test_a_misspelt_raycluster_metadata_field(
        self, raycluster_validator: jsonschema.protocols.Validator
    ) -> None:
        cluster = copy.deepcopy(only("RayCluster"))
        cluster["metadata"]["lables"] = cluster["metadata"].pop("labels")
        errors = raycluster_errors(raycluster_validator, cluster)
        assert len(errors) == 1 and "'lables' was unexpected" in errors[0]

    @pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
    def test_a_misspelt_deployment_container_field(self, version: str) -> None:
        deployment = copy.deepcopy(only("Deployment"))
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        container["readinesProbe"] = container.pop("readinessProbe")
        errors = kubernetes_errors(deployment, version)
        assert len(errors) == 1 and "'readinesProbe' was unexpected" in errors[0]

    def test_strict_leaves_preserved_unknown_fields_open(self) -> None:
        schema = strict(
            {
                "type": "object",
                "properties": {
                    "open": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                        "properties": {"known": {"type": "object", "properties": {}}},
                    },
                    "closed": {"type": "object", "properties": {"known": {"type": "string"}}},
                },
            }
        )
        validator = jsonschema.Draft202012Validator(schema)
        assert validator.is_valid({"open": {"anything": 1}, "closed": {"known": "x"}})
        assert not validator.is_valid({"closed": {"unknown": "x"}})
        assert not validator.is_valid({"open": {"known": {"unknown": 1}}})


# -- the pieces against each other ----------------------------------------------------------


def pod_specs() -> dict[str, Document]:
    """Every pod template's spec, by where it is."""
    cluster, deployment = only("RayCluster"), only("Deployment")
    specs = {"ray head": cluster["spec"]["headGroupSpec"]["template"]["spec"]}
    for group in cluster["spec"].get("workerGroupSpecs", []):
        specs[f"ray worker group {group['groupName']}"] = group["template"]["spec"]
    specs[f"deployment {deployment['metadata']['name']}"] = deployment["spec"]["template"]["spec"]
    return specs


def containers(pod_spec: Document) -> Iterator[Document]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec["containers"]


def api_container() -> Document:
    (container,) = only("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def env_value(container: Document, name: str) -> Any:
    for item in container.get("env", []):
        if item["name"] == name:
            return item.get("value", item.get("valueFrom"))
    return None


def example_secrets() -> dict[str, dict[str, str]]:
    secrets = {}
    for doc in load_documents(SECRETS_EXAMPLE):
        assert doc["kind"] == "Secret", f"{SECRETS_EXAMPLE.name} holds Secrets only"
        secrets[doc["metadata"]["name"]] = dict(doc.get("stringData", {}))
    return secrets


def secret_references() -> set[tuple[str, str | None]]:
    """(Secret, key) for every key read, (Secret, None) for a Secret read whole."""
    refs: set[tuple[str, str | None]] = set()
    cluster = only("RayCluster")
    auth = cluster["spec"].get("authOptions") or {}
    if auth.get("mode") == "token" and auth.get("secretName"):
        # KubeRay reads the token from the key `auth_token` of this Secret (without
        # secretName it generates a Secret of its own).
        refs.add((auth["secretName"], "auth_token"))
    for pod_spec in pod_specs().values():
        for container in containers(pod_spec):
            for item in container.get("env", []):
                if ref := item.get("valueFrom", {}).get("secretKeyRef"):
                    refs.add((ref["name"], ref["key"]))
            for source in container.get("envFrom", []):
                if ref := source.get("secretRef"):
                    refs.add((ref["name"], None))
        for volume in pod_spec.get("volumes", []):
            if secret := volume.get("secret"):
                refs.add((secret["secretName"], None))
    return refs


def container_environment(container: Document) -> dict[str, str]:
    """A container's environment as the pod would get it, Secrets from secrets.example.yaml."""
    secrets = example_secrets()
    environ: dict[str, str] = {}
    for source in container.get("envFrom", []):
        environ.update(secrets[source["secretRef"]["name"]])
    for item in container.get("env", []):
        if "value" in item:
            environ[item["name"]] = str(item["value"])
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            environ[item["name"]] = secrets[ref["name"]][ref["key"]]
    return environ


def flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


def head_service_name(cluster: Document) -> str:
    # KubeRay's name for a RayCluster's head Service, unless headService names one.
    head_service = cluster["spec"]["headGroupSpec"].get("headService") or {}
    return head_service.get("metadata", {}).get("name") or f"{cluster['metadata']['name']}-head-svc"


def pinned_ray_minor() -> str:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if re.match(r"ray(\[|=)", d)]
    match = re.search(r"==\s*(\d+\.\d+)", pin)
    assert match, f"pyproject.toml pins ray as {pin!r}"
    return match[1]


@pytest.fixture
def api_settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The API container's Settings, built as `tuneyard serve` builds them there."""
    for name in list(os.environ):
        if name.startswith((ENV_PREFIX, "AWS_", "RAY_")):
            monkeypatch.delenv(name)
    for name, value in container_environment(api_container()).items():
        monkeypatch.setenv(name, value)
    args = api_container()["command"]
    return Settings(host=flag(args, "--host"), port=int(flag(args, "--port") or 8000))


class TestTheService:
    def test_api_runs_the_service_on_all_interfaces(self) -> None:
        assert api_container()["command"][:2] == ["tuneyard", "serve"]
        assert flag(api_container()["command"], "--host") == "0.0.0.0"

    def test_every_tuneyard_variable_is_a_setting(self) -> None:
        for where, pod_spec in pod_specs().items():
            for container in containers(pod_spec):
                names = {item["name"] for item in container.get("env", [])}
                unknown = {n for n in names if n.startswith(ENV_PREFIX)} - SETTING_ENV_NAMES
                assert not unknown, f"{where} sets {sorted(unknown)}, which Settings does not read"

    def test_api_environment_makes_valid_settings_for_a_cluster(
        self, api_settings: Settings
    ) -> None:
        assert api_settings.auth == "apikey"
        # Without a Ray address the service would start a Ray head of its own in its pod.
        assert api_settings.ray_address
        assert make_url(api_settings.resolved_database_url).drivername == "postgresql+psycopg"
        # A folder would be the API pod's own: the Ray pods could not read what it holds.
        assert api_settings.storage.remote, "storage must be an object store all pods reach"

    def test_probes_ask_the_service_on_its_port(self, api_settings: Settings) -> None:
        container = api_container()
        ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert api_settings.port in ports.values()
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == "/healthz", probe
            assert ports.get(get["port"], get["port"]) == api_settings.port, probe


class TestRayCluster:
    def test_ray_version_is_the_one_pyproject_pins(self) -> None:
        ray_version = only("RayCluster")["spec"]["rayVersion"]
        assert ray_version.rsplit(".", 1)[0] == pinned_ray_minor()

    def test_token_authentication_is_on(self) -> None:
        auth = only("RayCluster")["spec"].get("authOptions") or {}
        assert auth.get("mode") == "token"

    def test_worker_groups_ask_for_gpus(self) -> None:
        groups = only("RayCluster")["spec"]["workerGroupSpecs"]
        assert groups
        for group in groups:
            assert group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]
            (ray,) = group["template"]["spec"]["containers"][:1]
            assert int(ray["resources"]["limits"]["nvidia.com/gpu"]) > 0, group["groupName"]

    @pytest.mark.parametrize("where", [w for w in pod_specs() if w.startswith("ray")])
    def test_ray_pods_have_dev_shm_in_memory(self, where: str) -> None:
        pod_spec = pod_specs()[where]
        memory_volumes = {
            v["name"]
            for v in pod_spec.get("volumes", [])
            if v.get("emptyDir", {}).get("medium") == "Memory"
        }
        mounts = {
            m["mountPath"]: m["name"] for m in pod_spec["containers"][0].get("volumeMounts", [])
        }
        assert mounts.get("/dev/shm") in memory_volumes, where


class TestCrossReferences:
    def test_ray_address_is_the_head_services_dashboard(self, api_settings: Settings) -> None:
        cluster = only("RayCluster")
        head = cluster["spec"]["headGroupSpec"]
        ports = {
            p.get("name"): p["containerPort"]
            for p in head["template"]["spec"]["containers"][0].get("ports", [])
        }
        dashboard_port = int(
            head.get("rayStartParams", {}).get("dashboard-port")
            or ports.get("dashboard", RAY_DASHBOARD_DEFAULT_PORT)
        )
        address = urlsplit(api_settings.ray_address or "")
        assert address.scheme == "http"
        assert address.hostname == head_service_name(cluster)
        assert address.port == dashboard_port
        # Bound to the pod's loopback, the dashboard would be out of the API's reach.
        assert head.get("rayStartParams", {}).get("dashboard-host", "0.0.0.0") == "0.0.0.0"

    def test_callback_url_is_the_api_service(self, api_settings: Settings) -> None:
        service, deployment = only("Service"), only("Deployment")
        callback = urlsplit(api_settings.resolved_callback_url)
        assert callback.hostname == service["metadata"]["name"]
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == callback.port]
        # The Service selects the API's pods, and its callback port reaches the one serve binds.
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        named = {p.get("name"): p["containerPort"] for p in api_container()["ports"]}
        target = port.get("targetPort", port["port"])
        assert named.get(target, target) == api_settings.port

    def test_api_and_ray_share_the_clusters_token(self) -> None:
        auth = only("RayCluster")["spec"]["authOptions"]
        assert env_value(api_container(), "RAY_AUTH_MODE") == "token"
        token = env_value(api_container(), "RAY_AUTH_TOKEN")
        assert token == {"secretKeyRef": {"name": auth["secretName"], "key": "auth_token"}}

    def test_every_secret_named_is_in_the_example(self) -> None:
        secrets = example_secrets()
        for name, key in sorted(secret_references(), key=str):
            assert name in secrets, f"Secret {name} is not in {SECRETS_EXAMPLE.name}"
            assert key is None or key in secrets[name], f"Secret {name} has no key {key}"

    def test_object_store_settings_reach_every_pod(self) -> None:
        """Ray Train on the Ray pods writes to the object store the API was given."""
        api_sources = [s["secretRef"]["name"] for s in api_container().get("envFrom", [])]
        assert api_sources
        for where, pod_spec in pod_specs().items():
            sources = [
                s.get("secretRef", {}).get("name")
                for s in pod_spec["containers"][0].get("envFrom", [])
            ]
            assert set(api_sources) <= set(sources), where

    def test_one_image_everywhere(self) -> None:
        images = {
            f"{where}/{c['name']}": c["image"]
            for where, pod_spec in pod_specs().items()
            for c in containers(pod_spec)
        }
        assert len(set(images.values())) == 1, images


class TestSecretsExample:
    def test_every_value_is_a_marked_placeholder(self) -> None:
        for doc in load_documents(SECRETS_EXAMPLE):
            # Base64 `data` would hide what it holds from a reviewer.
            assert "data" not in doc, f"{doc['metadata']['name']}: use stringData"
            for key, value in doc["stringData"].items():
                assert PLACEHOLDER in str(value), f"{doc['metadata']['name']}.{key}"


class TestKustomization:
    @pytest.fixture(scope="class")
    def kustomization(self) -> Document:
        (doc,) = load_documents(KUSTOMIZATION)
        assert doc["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
        assert doc["kind"] == "Kustomization"
        assert set(doc) <= {"apiVersion", "kind", "resources", "images"}, sorted(doc)
        return doc

    def test_it_applies_every_manifest_but_the_secrets_example(
        self, kustomization: Document
    ) -> None:
        expected = {p.name for p in manifest_files()} - {KUSTOMIZATION.name, SECRETS_EXAMPLE.name}
        assert sorted(kustomization["resources"]) == sorted(expected)
        # Real Secrets are applied apart, so that an apply never resets them to placeholders.
        for name in kustomization["resources"]:
            assert "Secret" not in {doc["kind"] for doc in load_documents(DEPLOY / name)}, name

    def test_its_image_rewrite_names_the_manifests_image(self, kustomization: Document) -> None:
        (image,) = {c["image"] for spec in pod_specs().values() for c in containers(spec)}
        (rewrite,) = kustomization["images"]
        assert set(rewrite) <= {"name", "newName", "newTag", "digest"}
        assert image.rsplit(":", 1)[0] == rewrite["name"]
