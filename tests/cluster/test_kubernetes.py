"""The Kubernetes recipe's manifests (scripts/kubernetes/): the DaskCluster file as shipped and as
train_kubernetes.py renders it validate against the operator's own CRD schema (dask-kubernetes'
helm chart, the schema the API server checks), with no field the schema lacks (what the server
would prune or, with --validate=strict, refuse), and carry our workers' preload and resources.
Without dask-kubernetes skipped with one line, except under CI (.ci/run installs [kubernetes])."""
from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import pytest

from tests.clusters import REPO

CRD = "operator/deployment/helm/dask-kubernetes-operator/crds/daskcluster.yaml"


def _recipe():
    """scripts/kubernetes/train_kubernetes.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "train_kubernetes", REPO / "scripts" / "kubernetes" / "train_kubernetes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _crd_schema() -> dict:
    """The DaskCluster v1 openAPIV3Schema of the installed dask-kubernetes (found, not imported)."""
    import yaml
    found = importlib.util.find_spec("dask_kubernetes")
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("dask-kubernetes is not installed (.ci/run installs the [kubernetes] extra)")
        pytest.skip("dask-kubernetes is not installed (pip install -e '.[kubernetes]') and CI is "
                    "not set")
    crd = yaml.safe_load((Path(found.submodule_search_locations[0]) / CRD).read_text())
    assert crd["spec"]["group"] == "kubernetes.dask.org" and crd["spec"]["names"]["kind"] == "DaskCluster"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Paths in ``value`` that ``schema`` (a structural CRD schema) has no property for.

    >>> unknown_fields({"a": {"b": 1, "c": 2}}, {"properties": {"a": {"properties": {"b": {}}}}})
    ['.a.c']
    """
    if schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("x-kubernetes-int-or-string"):
        return []
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        out = []
        for key, item in value.items():
            if props is not None and key in props:
                out += unknown_fields(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(item, extra, f"{path}.{key}")
            elif props is not None or extra is False:
                out.append(f"{path}.{key}")
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [p for i, item in enumerate(value)
                for p in unknown_fields(item, schema["items"], f"{path}[{i}]")]
    return []


def problems(manifest: dict, schema: dict) -> list[str]:
    """Everything wrong with a DaskCluster manifest: schema errors, unknown fields, and what our
    workers need (the preload, one resource, a GPU limit beside GPU=1)."""
    import jsonschema
    found = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
             for e in jsonschema.Draft7Validator(schema).iter_errors(manifest)]
    top = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata")}
    found += [f"{p}: not in the CRD" for p in unknown_fields(top, schema)]
    if manifest.get("apiVersion") != "kubernetes.dask.org/v1" or manifest.get("kind") != "DaskCluster":
        found.append("not a kubernetes.dask.org/v1 DaskCluster")
    spec = manifest.get("spec", {})
    if not spec.get("scheduler", {}).get("service", {}).get("ports"):
        found.append("spec.scheduler.service has no ports")
    for container in spec.get("worker", {}).get("spec", {}).get("containers", []):
        args = container.get("args", [])
        pairs = set(zip(args, args[1:]))
        if ("--preload", "pipeline.cluster.worker_setup") not in pairs:
            found.append(f"worker {container.get('name')}: no --preload pipeline.cluster.worker_setup")
        resources = [b for a, b in pairs if a == "--resources"]
        if len(resources) != 1 or resources[0].split("=")[0] not in ("GPU", "TRAIN", "CPU"):
            found.append(f"worker {container.get('name')}: --resources {resources}")
        gpu_limit = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if (resources[:1] == ["GPU=1"]) != (gpu_limit == "1"):  # a string: the CRD's type
            found.append(f"worker {container.get('name')}: GPU=1 without nvidia.com/gpu: 1 "
                         f"or the reverse ({resources}, {gpu_limit})")
    return found


@pytest.fixture(scope="module")
def schema() -> dict:
    return _crd_schema()


def test_the_shipped_manifest_validates_and_is_what_the_script_renders(schema):
    import yaml
    recipe = _recipe()
    shipped = yaml.safe_load(recipe.MANIFEST.read_text())
    assert problems(shipped, schema) == []
    assert recipe.render() == shipped  # the file's worker command is worker_args(gpu=True, 1)
    worker = shipped["spec"]["worker"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "GPU=1" in worker["args"]


@pytest.mark.parametrize("changes", [
    dict(image="ghcr.io/me/pipeline:1", workers=4),
    dict(gpu=False, threads=2, memory="4Gi", name="cpu-run"),
])
def test_rendered_manifests_validate(schema, changes):
    recipe = _recipe()
    manifest = recipe.render(**changes)
    assert problems(manifest, schema) == []
    worker = manifest["spec"]["worker"]["spec"]["containers"][0]
    if changes.get("gpu", True):
        assert "nvidia.com/gpu" in worker["resources"]["limits"]
    else:
        assert "nvidia.com/gpu" not in worker["resources"]["limits"]
        assert "TRAIN=2" in worker["args"] and worker["resources"]["requests"]["cpu"] == "2"
        service = manifest["spec"]["scheduler"]["service"]
        assert service["selector"]["dask.org/cluster-name"] == manifest["metadata"]["name"]


def test_the_checks_catch_what_they_check(schema):
    """A typo, a wrong type, a lost preload and a GPU resource without its limit are each found."""
    good = _recipe().render()
    cases = {
        "contaners": lambda m: m["spec"]["worker"]["spec"].__setitem__(
            "contaners", m["spec"]["worker"]["spec"].pop("containers")),
        "replicas": lambda m: m["spec"]["worker"].__setitem__("replicas", "two"),
        "--preload": lambda m: m["spec"]["worker"]["spec"]["containers"][0]["args"].remove(
            "pipeline.cluster.worker_setup"),
        "nvidia.com/gpu": lambda m: m["spec"]["worker"]["spec"]["containers"][0]["resources"][
            "limits"].pop("nvidia.com/gpu"),
        "service": lambda m: m["spec"]["scheduler"].pop("service"),
    }
    for word, damage in cases.items():
        manifest = copy.deepcopy(good)
        damage(manifest)
        found = problems(manifest, schema)
        assert any(word in p for p in found), (word, found)


def test_the_scripts_flags():
    args, rest = _recipe().parse(["--cpu", "--workers", "3", "--", "--epochs", "2"])
    assert (args.cpu, args.workers, rest) == (True, 3, ["--epochs", "2"])
