"""The Kubernetes and Slurm examples (docs/machines.md): their structure, as the launcher reads it."""

from __future__ import annotations

from pathlib import Path

import yaml

from actors.launchers import from_environment

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_indexed_job_names_its_head_by_the_headless_services_stable_name() -> None:
    service, job = list(yaml.safe_load_all((EXAMPLES / "k8s" / "actorpipe.yaml").read_text()))
    assert (service["kind"], service["spec"]["clusterIP"]) == ("Service", "None")
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    [container] = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    # Pod 0's stable name is <job>-0.<subdomain>; the world is the Job's completions.
    assert env["ACTORPIPE_HEAD_HOST"] == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert int(env["ACTORPIPE_WORLD_SIZE"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    role = from_environment({**env, "JOB_COMPLETION_INDEX": "2"})
    assert role is not None and role.port == service["spec"]["ports"][0]["port"]
    assert container["ports"][0]["containerPort"] == role.port
    assert {v["secret"]["secretName"] for v in pod["volumes"]} == {"actorpipe-keys", "actorpipe-authorized"}


def test_the_manifest_passes_the_kubernetes_api_schema_strictly() -> None:
    """kubernetes-validate (from the package registry): every field known to the API, of its type."""
    import kubernetes_validate

    for resource in yaml.safe_load_all((EXAMPLES / "k8s" / "actorpipe.yaml").read_text()):
        kubernetes_validate.validate(resource, kubernetes_validate.latest_version(), strict=True)
    broken = {**resource, "spec": {**resource["spec"], "completionMode": 3}}
    try:
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError:
        return
    raise AssertionError("a Job whose completionMode is a number passed the schema")


def test_the_slurm_script_starts_every_task_as_a_node_and_stops_them() -> None:
    script = (EXAMPLES / "slurm" / "train.sbatch").read_text()
    assert "srun" in script and "python -m actors.node" in script and "--join" not in script
    assert "ACTORPIPE_KEYS" in script and "kill -TERM" in script
