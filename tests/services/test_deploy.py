"""Keep docker-compose.yml, the Kubernetes manifests and the Dockerfile honest without a
Docker engine: parse them, check every command, variable, image and port against what the
services really read and run, then run the very same commands with the very same settings
against the embedded stack (broker and S3 addresses substituted) and see the sink work.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.runtime.settings import REQUIRED_ENV, ServiceSettings, is_known_env
from shared.devstack.embedded import EmbeddedStack, SparkStandalone, late_bound_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "k8s"
PROJECT_IMAGE = "shardsink"
SINK_SERVICES = ("mint", "write", "append")


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def project_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The shardsink services (Python commands on the project's image)."""
    return {
        name: svc
        for name, svc in doc["services"].items()
        if ("build" in svc or str(svc.get("image", "")).split(":")[0] == PROJECT_IMAGE)
        and svc["command"][0] != "spark-class"
    }


def spark_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Spark standalone cluster's services (``spark-class`` on the project's image)."""
    return {name: svc for name, svc in doc["services"].items() if svc.get("command", [""])[0] == "spark-class"}


def submit_confs(env: dict[str, Any]) -> dict[str, str]:
    """``--conf k=v`` pairs of a service's PYSPARK_SUBMIT_ARGS (which must end in pyspark-shell)."""
    args = str(env.get("PYSPARK_SUBMIT_ARGS", "pyspark-shell")).split()
    assert args[-1] == "pyspark-shell", f"expected PYSPARK_SUBMIT_ARGS to end with pyspark-shell, found {args}"
    assert len(args[:-1]) % 2 == 0 and all(a == "--conf" for a in args[:-1:2]), args
    return dict(a.split("=", 1) for a in args[1:-1:2])


def size_gib(text: str) -> float:
    """A Spark or worker memory size (``512m``, ``3g``) in GiB."""
    units = {"k": 1 / 1024**2, "m": 1 / 1024, "g": 1.0, "t": 1024.0}
    assert text[-1].lower() in units and text[:-1].isdigit(), f"expected a size like 1g or 512m, found {text!r}"
    return int(text[:-1]) * units[text[-1].lower()]


def dynamic_executors(confs: dict[str, str]) -> int:
    """The most executors of a driver with dynamic allocation (the controller's jobs), after
    checking that it can run without an external shuffle service, holds nothing while idle and
    sizes its jobs by its most executors, not by how many happen to be up."""
    assert confs["spark.dynamicAllocation.enabled"] == "true"
    assert confs["spark.dynamicAllocation.shuffleTracking.enabled"] == "true"  # no shuffle service
    assert confs.get("spark.shuffle.service.enabled", "false") == "false"
    assert int(confs["spark.dynamicAllocation.minExecutors"]) == 0
    most = int(confs["spark.dynamicAllocation.maxExecutors"])
    assert most >= 1
    # Executors holding shuffle files of finished jobs are let go too (the default is never).
    assert confs["spark.dynamicAllocation.shuffleTracking.timeout"].endswith(("s", "min"))
    assert confs["spark.dynamicAllocation.executorIdleTimeout"].endswith(("s", "min"))
    assert int(confs["spark.default.parallelism"]) == most * int(confs["spark.executor.cores"])
    return most


def module_of(command: list[str]) -> str:
    assert command[:2] == ["python", "-m"], f"expected 'python -m <module>', found {command}"
    return command[2]


def assert_runnable_module(module: str) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"expected module {module!r} to exist"
    if spec.submodule_search_locations is not None:  # a package: needs __main__
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"expected {module}.__main__"


#: List items that strategic merge patches match by key (the fields our patches touch).
MERGE_KEYS = {"containers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort"}


def _merge(base: Any, patch: Any, key: str = "") -> Any:
    """Kubernetes' strategic merge, for maps and the keyed lists of :data:`MERGE_KEYS`."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        mk = MERGE_KEYS[key]
        out_list = list(base)
        for item in patch:
            i = next((j for j, b in enumerate(out_list) if b.get(mk) == item.get(mk)), None)
            if i is None:
                out_list.append(item)
            else:
                out_list[i] = _merge(out_list[i], item)
        return out_list
    return patch


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` for what our kustomizations use: resources (files and
    directories), patches (strategic merge, matched by kind and name), namespace, images."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for r in k.get("resources", []):
        path = (directory / r).resolve()
        assert path.exists(), f"{directory}: resource {r} does not exist"
        docs += kustomize(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for p in k.get("patches", []):
        for patch in (d for d in yaml.safe_load_all((directory / p["path"]).read_text()) if d):
            idx = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])]
            assert len(idx) == 1, f"{directory}: patch {p['path']} matches {len(idx)} resources"
            docs[idx[0]] = _merge(docs[idx[0]], patch)
    ns = k.get("namespace")
    if ns:
        for d in docs:
            if d["kind"] != "Namespace":
                d["metadata"]["namespace"] = ns
    for img in k.get("images", []):
        for d in docs:
            if d["kind"] == "Deployment":
                for c in d["spec"]["template"]["spec"]["containers"]:
                    if c["image"].split(":")[0] == img["name"]:
                        c["image"] = f"{img.get('newName', img['name'])}:{img['newTag']}"
    return docs


OVERLAYS = ("local", "cluster")


def k8s_docs(overlay: str = "local") -> list[dict[str, Any]]:
    return kustomize(K8S / "overlays" / overlay)


# -- static checks ---------------------------------------------------------------------------


def test_compose_services_run_existing_commands_with_known_settings() -> None:
    doc = compose()
    services = project_services(doc)
    assert set(SINK_SERVICES) | {"controller"} <= set(services), sorted(services)
    for name, svc in services.items():
        assert_runnable_module(module_of(svc["command"]))
        env = svc["environment"]
        unknown = [k for k in env if not is_known_env(k)]
        assert unknown == [], f"{name} sets variables no service reads: {unknown}"
        missing = [k for k in REQUIRED_ENV if k not in env]
        assert missing == [], f"{name} lacks required variables {missing}"
        published = {int(p.split(":")[1]) for p in svc.get("ports", [])}
        assert int(env["SHARDSINK_METRICS_PORT"]) in published, f"{name}: metrics port not published"
        assert str(svc.get("image", PROJECT_IMAGE)).split(":")[0] == PROJECT_IMAGE
    # The addresses the services use are the ones compose's infrastructure provides.
    env = services["mint"]["environment"]
    host, port = env["SHARDSINK_KAFKA_BOOTSTRAP"].split(":")
    assert host in doc["services"] and f"PLAINTEXT://{host}:{port}" in doc["services"][host]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    s3_host = env["SHARDSINK_S3_ENDPOINT"].split("//")[1].split(":")[0]
    assert s3_host in doc["services"]
    assert env["AWS_ACCESS_KEY_ID"] == doc["services"][s3_host]["environment"]["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == doc["services"][s3_host]["environment"]["MINIO_ROOT_PASSWORD"]
    assert env["SHARDSINK_S3_BUCKET"] in " ".join(doc["services"]["minio-init"]["entrypoint"])
    # Every topic the services use by default is created by the topics job.
    defaults = ServiceSettings.from_env_and_args(None, {})
    script = " ".join(doc["services"]["topics"]["entrypoint"])
    for topic in (defaults.descs_topic, defaults.batches_topic, defaults.frontiers_topic, "commands", "responses"):
        assert topic in script, f"topic {topic!r} is not created by the topics job"
    # The Spark cluster: a master, workers that register with it and run executors on the
    # project's image, and the sink drivers in client mode against it.
    spark = spark_services(doc)
    (master_name,) = [n for n, v in spark.items() if v["command"][1] == "org.apache.spark.deploy.master.Master"]
    (worker_name,) = [n for n, v in spark.items() if v["command"][1] == "org.apache.spark.deploy.worker.Worker"]
    master, worker = spark[master_name]["command"], spark[worker_name]["command"]
    master_url = f"spark://{master[master.index('--host') + 1]}:{master[master.index('--port') + 1]}"
    assert master[master.index("--host") + 1] == master_name
    assert worker[-1] == master_url
    assert str(spark[master_name]["image"]).split(":")[0] == PROJECT_IMAGE
    assert str(spark[worker_name]["image"]).split(":")[0] == PROJECT_IMAGE
    assert f"{master[master.index('--webui-port') + 1]}:" in " ".join(spark[master_name]["ports"])
    assert spark[worker_name]["deploy"]["replicas"] >= 2
    replicas = spark[worker_name]["deploy"]["replicas"]
    worker_cores = int(worker[worker.index("--cores") + 1]) * replicas
    worker_gib = size_gib(worker[worker.index("--memory") + 1]) * replicas
    wanted, wanted_gib = 0, 0.0
    for name in SINK_SERVICES:
        env = services[name]["environment"]
        assert env["SHARDSINK_SPARK_MASTER"] == master_url
        confs = submit_confs(env)
        assert confs["spark.driver.host"] == name  # executors call the driver back by its name
        wanted += int(confs["spark.cores.max"])
        wanted_gib += int(confs["spark.cores.max"]) // int(confs["spark.executor.cores"]) * size_gib(confs["spark.executor.memory"])
    # The controller is the driver of its data-heavy jobs on the same master, with executors
    # only while a job runs; the workers keep room for them beside the sink's.
    env = services["controller"]["environment"]
    assert env["SHARDSINK_CONTROLLER_SPARK_MASTER"] == master_url
    confs = submit_confs(env)
    assert confs["spark.driver.host"] == "controller"
    most = dynamic_executors(confs)
    assert int(confs["spark.cores.max"]) == most * int(confs["spark.executor.cores"])
    wanted += int(confs["spark.cores.max"])
    wanted_gib += most * size_gib(confs["spark.executor.memory"])
    assert wanted <= worker_cores, f"the applications want {wanted} cores, the workers have {worker_cores}"
    assert wanted_gib <= worker_gib, f"the applications' executors want {wanted_gib} GiB, the workers have {worker_gib}"
    assert "spark-master" in services["controller"]["depends_on"]
    # Executors write the write service's state into its checkpoint: same volume, same path.
    write_env = services["write"]["environment"]
    write_vol = next(v for v in services["write"]["volumes"] if v.endswith(":" + write_env["SHARDSINK_CHECKPOINT_DIR"]))
    assert write_vol in spark[worker_name]["volumes"]
    assert doc["services"]["kafka"]["image"].startswith("apache/kafka:")
    assert doc["services"]["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_manifests_match_the_services(overlay: str) -> None:
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert set(base["resources"]) == {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    docs = k8s_docs(overlay)
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "shardsink-config")
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert all(is_known_env(k) for k in config["data"]), config["data"]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert {f"shardsink-{s}" for s in (*SINK_SERVICES, "controller")} <= set(deployments)
    assert all(d["metadata"]["namespace"] == "shardsink" for d in docs if d["kind"] != "Namespace")
    kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    images = kustomization.get("images") or base["images"]
    image_names = {f"{i.get('newName', i['name'])}:{i['newTag']}" for i in images}
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]
        (c,) = pod["spec"]["containers"]
        assert c["image"] in image_names
        assert_runnable_module(module_of(c["command"]))
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert all(is_known_env(k) for k in env), env
        assert [r["configMapRef"]["name"] for r in c["envFrom"]] == [config["metadata"]["name"]]
        available = set(env) | set(config["data"])
        assert all(k in available for k in REQUIRED_ENV), f"{name} lacks {REQUIRED_ENV}"
        port = int(env["SHARDSINK_METRICS_PORT"])
        # The metrics port, and in the cluster overlay a driver's two callback ports (the
        # controller is the driver of its Spark jobs there).
        driver_ports = [] if overlay == "local" else [7078, 7079]
        assert [p["containerPort"] for p in c["ports"]] == [port, *driver_ports]
        assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == port
        assert c["readinessProbe"]["httpGet"]["port"] == port
        # Credentials come from the mounted secret, never from plain env values.
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert vols["s3-credentials"]["secret"]["secretName"] == secret["metadata"]["name"]
        for var, key in (("AWS_ACCESS_KEY_ID_FILE", "access-key"), ("AWS_SECRET_ACCESS_KEY_FILE", "secret-key")):
            assert env[var] == f"{mounts['s3-credentials']}/{key}" and key in secret["stringData"]
        assert "AWS_SECRET_ACCESS_KEY" not in env
    if overlay == "local":
        assert config["data"]["SHARDSINK_SPARK_MASTER"].startswith("local[")
        assert not any(d["kind"] in ("Role", "ServiceAccount") for d in docs)
        # The controller does everything in its pod.
        (ctl,) = deployments["shardsink-controller"]["spec"]["template"]["spec"]["containers"]
        assert not {e["name"]: e.get("value") for e in ctl["env"]}.get("SHARDSINK_CONTROLLER_SPARK_MASTER")
        assert "SHARDSINK_CONTROLLER_SPARK_MASTER" not in config["data"]
        return
    # -- cluster: Spark on Kubernetes in client mode ------------------------------------------
    assert config["data"]["SHARDSINK_SPARK_MASTER"] == "k8s://https://kubernetes.default.svc"
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"]}]
    # Exactly what Spark's Kubernetes backend does as a client-mode driver.
    assert {(tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"]} == {
        (("pods",), tuple(sorted(["create", "get", "list", "watch", "delete", "deletecollection"]))),
        (("configmaps",), tuple(sorted(["create", "get", "list", "delete", "deletecollection"]))),
    }
    assert all(r["apiGroups"] == [""] for r in role["rules"])
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    templates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    executor_pods: dict[str, dict[str, Any]] = {}
    for svc_name in (*SINK_SERVICES, "controller"):
        dep = deployments[f"shardsink-{svc_name}"]
        spec = dep["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == sa["metadata"]["name"]
        (c,) = spec["containers"]
        names = [e["name"] for e in c["env"]]
        env_values = {e["name"]: e.get("value") for e in c["env"]}
        confs = submit_confs({"PYSPARK_SUBMIT_ARGS": env_values["PYSPARK_SUBMIT_ARGS"]})
        # $(VAR) expands only variables defined earlier in the list.
        for var in ("POD_NAME", "POD_NAMESPACE"):
            assert names.index(var) < names.index("PYSPARK_SUBMIT_ARGS")
        assert confs["spark.kubernetes.container.image"] == c["image"]
        assert confs["spark.kubernetes.namespace"] == "$(POD_NAMESPACE)"
        assert confs["spark.kubernetes.driver.pod.name"] == "$(POD_NAME)"  # executors die with the driver pod
        # The Role grants nothing on claims or services: the drivers do not touch them (the
        # claims' reuse and cleanup, and deleting the driver Service at stop, are what Spark
        # would otherwise still try).
        assert confs["spark.kubernetes.driver.ownPersistentVolumeClaim"] == "false"
        assert confs["spark.kubernetes.driver.service.deleteOnTermination"] == "false"
        if svc_name == "controller":
            # The controller's data-heavy jobs: executors only while a job runs.
            assert env_values["SHARDSINK_CONTROLLER_SPARK_MASTER"] == "k8s://https://kubernetes.default.svc"
            assert dynamic_executors(confs) >= 1
            assert "spark.executor.instances" not in confs
        else:
            assert int(confs["spark.executor.instances"]) >= 1
        host = confs["spark.driver.host"]
        assert host.endswith(".$(POD_NAMESPACE).svc")
        headless = services[host.split(".")[0]]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        fixed = {int(confs["spark.driver.port"]), int(confs["spark.blockManager.port"])}
        assert {p["port"] for p in headless["spec"]["ports"]} == fixed
        assert fixed <= {p["containerPort"] for p in c["ports"]}
        # The executor pod template is mounted where the conf says.
        tpl_path = Path(confs["spark.kubernetes.executor.podTemplateFile"])
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(tpl_path.parent))
        vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        tpl = yaml.safe_load(templates[vol["configMap"]["name"]]["data"][tpl_path.name])
        assert tpl["kind"] == "Pod"
        executor_pods[svc_name] = tpl
    assert len(services) == len(SINK_SERVICES) + 1  # one headless Service per driver
    for svc_name, tpl in executor_pods.items():
        (ex,) = tpl["spec"]["containers"]
        assert ex["image"] in image_names
        ex_mounts = {m["name"]: m["mountPath"] for m in ex["volumeMounts"]}
        ex_vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
        assert ex_vols["s3-credentials"]["secret"]["secretName"] == secret["metadata"]["name"]
        assert all(is_known_env(e["name"]) for e in ex["env"])
        claimed = [n for n, v in ex_vols.items() if "persistentVolumeClaim" in v]
        if svc_name == "controller":
            assert claimed == []  # its executors read and write data objects on S3 only
            continue
        # The sink's executors write the write service's state: they mount its claim at the
        # drivers' path, and the claim is ReadWriteMany.
        (name,) = claimed
        claim = ex_vols[name]["persistentVolumeClaim"]["claimName"]
        assert ex_mounts[name] == config["data"]["SHARDSINK_CHECKPOINT_DIR"]
        write_vols = deployments["shardsink-write"]["spec"]["template"]["spec"]["volumes"]
        assert any(v.get("persistentVolumeClaim", {}).get("claimName") == claim for v in write_vols)
        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"]


#: Variables Spark sets for the processes it starts (never a deployment's setting).
SET_BY_SPARK = {"PYSPARK_GATEWAY_PORT"}


def test_every_variable_the_controller_reads_is_known() -> None:
    """The deployment checks above know every setting the controller reads: each variable
    named in the project modules a controller process loads (its command loop, its Spark jobs,
    the services' common code, the shard and I/O layers) is in ``services.runtime.settings.ENV_VARS``."""
    probe = (
        "import sys, services.controller.__main__, services.controller.spark_jobs, services.runtime.metrics, services.runtime.jvm;"
        "print('\\n'.join(sorted(m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [Path(f).resolve() for f in out.split()]
    files = [f for f in files if f.is_relative_to(ROOT) and f.relative_to(ROOT).parts[0] in ("services", "shared", "shardsink")]
    assert ROOT / "services" / "controller" / "__main__.py" in files and ROOT / "services" / "runtime" / "jvm.py" in files
    names: dict[str, str] = {}
    for f in files:
        for name in re.findall(r"[\"'`]((?:SHARDSINK|PYSPARK|AWS|POD)_[A-Z0-9_]*[A-Z0-9])[\"'`]", f.read_text()):
            names.setdefault(name, str(f.relative_to(ROOT)))
    assert "SHARDSINK_CONTROLLER_SPARK_MASTER" in names and "SHARDSINK_GC_INTERVAL_MS" in names
    unknown = {n: f for n, f in names.items() if not is_known_env(n) and n not in SET_BY_SPARK}
    assert unknown == {}, f"variables read by the controller and missing from services.runtime.settings.ENV_VARS: {unknown}"


def test_dockerfile_copies_what_the_services_import_and_sets_known_settings() -> None:
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    copied = {ln.split()[1] for ln in lines if ln.startswith("COPY ")}
    for needed in ("shardsink", "shared", "services", "schemas", "pyproject.toml"):
        assert needed in copied, f"Dockerfile does not copy {needed}"
        assert (ROOT / needed).exists()
    env_line = " ".join(ln for ln in lines if ln.startswith("ENV") or ln.startswith("SHARDSINK") or ln.startswith("PYSPARK"))
    names = [tok.split("=")[0] for tok in env_line.replace("ENV", " ").replace("\\", " ").split() if "=" in tok]
    assert names and all(is_known_env(n) for n in names), names
    assert "openjdk-17" in " ".join(lines)


# -- the same commands, run against the embedded stack ---------------------------------------

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}]}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_compose_commands_run_the_sink_against_the_embedded_stack(stack: EmbeddedStack, tmp_path: Path, unique_id: str) -> None:
    from shardsink.cli.catalog import create_collection
    from shared.catalog import SinkDef
    from shared.io.desired_producer import DesiredProducer
    from shared.io.kafka_admin import ensure_topic
    from shared.shard import Shard

    services = project_services(compose())
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ports: dict[str, int] = {}
    logs: dict[str, Path] = {}
    col, topic, sink = f"c-{unique_id}", f"d-{unique_id}", f"s-{unique_id}"
    base_env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    for k in ("SHARDSINK_METRICS_PORT",):
        base_env.pop(k, None)
    settings = ServiceSettings.from_env_and_args(None, {**base_env, **stack.env()})
    create_collection(settings, col, SCHEMA)
    ensure_topic(settings.kafka, topic, 2)
    settings.catalog().create_sink(SinkDef(sink, topic, col))
    for t in ("commands", "responses"):  # compose's topics job creates these
        ensure_topic(settings.kafka, t, 1)
    spark = spark_services(compose())
    cluster_procs: list[subprocess.Popen[bytes]] = []
    master_port, master_ui = late_bound_port(), late_bound_port()
    master_url = f"spark://127.0.0.1:{master_port}"
    spark_class = SparkStandalone.spark_class()

    def local(cmd: list[str], name: str) -> list[str]:
        """A compose Spark command with the hosts, ports and paths of this machine."""
        out = [spark_class if c == "spark-class" else c for c in cmd]
        for flag, value in (("--host", "127.0.0.1"), ("--port", str(master_port)), ("--webui-port", str(master_ui if "Master" in out[1] else late_bound_port())),
                            ("--work-dir", str(tmp_path / f"{name}-work"))):
            if flag in out:
                out[out.index(flag) + 1] = value
        return [master_url if c.startswith("spark://") else c for c in out]

    spark_env = {**base_env, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1"}
    try:
        # The compose cluster: its master and its workers (as many as compose's replicas),
        # from the very same commands.
        for name, svc in sorted(spark.items(), key=lambda kv: "Worker" in kv[1]["command"][1]):
            for i in range(int(svc.get("deploy", {}).get("replicas", 1))):
                log = tmp_path / f"{name}-{i}.log"
                cluster_procs.append(subprocess.Popen(local(svc["command"], f"{name}-{i}"), env=spark_env, stdout=open(log, "wb"),
                                                      stderr=subprocess.STDOUT, start_new_session=True))
            if "Master" in svc["command"][1]:
                deadline = time.monotonic() + 120
                while not _listening(master_port):
                    assert time.monotonic() < deadline, "the Spark master did not start"
                    time.sleep(0.5)
        for name in (*SINK_SERVICES, "controller"):
            svc = services[name]
            env = {**base_env, **{k: str(v) for k, v in svc["environment"].items()}}
            # Substitute only the addresses and the host paths; everything else as deployed.
            env["SHARDSINK_KAFKA_BOOTSTRAP"] = stack.bootstrap_servers
            env["SHARDSINK_S3_ENDPOINT"] = stack.s3_endpoint
            env["SHARDSINK_CHECKPOINT_DIR"] = str(tmp_path / name)
            if name in SINK_SERVICES:
                env["SHARDSINK_SPARK_MASTER"] = master_url
                env["PYSPARK_SUBMIT_ARGS"] = env["PYSPARK_SUBMIT_ARGS"].replace(f"spark.driver.host={name}", "spark.driver.host=127.0.0.1")
            else:
                # The controller's Spark driver (its jobs on the cluster) is run by
                # test_compose_controller_runs_its_jobs_on_a_standalone_cluster: here its work is
                # small and stays in its process.
                env["SHARDSINK_CONTROLLER_SPARK_MASTER"] = ""
            ports[name] = late_bound_port()
            env["SHARDSINK_METRICS_PORT"] = str(ports[name])
            env["SHARDSINK_CATALOG_POLL_MS"] = "300"
            cmd = [sys.executable if c == "python" else c for c in svc["command"]]
            if name != "controller":
                cmd += ["--sink", sink]
            logs[name] = tmp_path / f"{name}.log"
            procs[name] = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(logs[name], "wb"), stderr=subprocess.STDOUT)
        producer = DesiredProducer(settings.kafka, topic, SCHEMA)
        model: collections.Counter[tuple[int, str]] = collections.Counter()
        rng = random.Random(3)
        shard = Shard.open(settings.store(), col)
        for step in range(1, 4):
            for _ in range(40):
                k = rng.randrange(20)
                d = -1 if model[(k, "v")] > 0 and rng.random() < 0.3 else 1
                producer.send({"k": k, "v": "v"}, step * 10, d)
                model[(k, "v")] += d
            producer.advance_to(step * 10 + 1)
            deadline = time.monotonic() + 150
            while (shard.refresh().upper.time or 0) < step * 10 + 1:
                dead = [n for n, p in procs.items() if p.poll() is not None]
                assert not dead, f"services exited: {dead}: {[logs[n].read_text()[-2000:] for n in dead]}"
                assert time.monotonic() < deadline, f"shard upper stuck at {shard.refresh().upper}"
                time.sleep(0.2)
            snap = shard.snapshot(step * 10)
            assert {(r["k"], r["v"]): r["_diff"] for r in snap.to_pylist()} == {kv: c for kv, c in model.items() if c}
        producer.close()
        metrics = {name: _scrape(port) for name, port in ports.items()}
        assert f'shardsink_descriptions_minted_total{{sink="{sink}"}}' in metrics["mint"]
        assert f'shardsink_write_desired_updates_total{{sink="{sink}"}} 120.0' in metrics["write"]
        assert f'shardsink_append_batches_total{{sink="{sink}"}}' in metrics["append"]
        deadline = time.monotonic() + 60
        while f'shardsink_collection_upper{{collection="{col}"}} 31.0' not in _scrape(ports["controller"]):
            assert time.monotonic() < deadline, _scrape(ports["controller"])[-2000:]
            time.sleep(0.5)
        for name, p in procs.items():
            p.send_signal(signal.SIGTERM)
        for name, p in procs.items():
            assert p.wait(timeout=60) == 0, f"{name} did not stop cleanly: {logs[name].read_text()[-2000:]}"
        # Logs are structured JSON and never contain the secret.
        for name, path in logs.items():
            text = path.read_text()
            assert services[name]["environment"]["AWS_SECRET_ACCESS_KEY"] not in text
            if name != "controller":
                assert f'"sink_id": "{sink}"' in text
        # The sink ran on the cluster: each application registered with the master.
        with urllib.request.urlopen(f"http://127.0.0.1:{master_ui}/json/", timeout=5) as r:
            status = json.loads(r.read())
        apps = [a["name"] for a in status["activeapps"] + status["completedapps"]]
        assert len(apps) >= len(SINK_SERVICES), apps
        assert status["aliveworkers"] == spark_workers(spark), status["aliveworkers"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for p in reversed(cluster_procs):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def test_compose_controller_runs_its_jobs_on_a_standalone_cluster(
    stack: EmbeddedStack, standalone_cluster: SparkStandalone, tmp_path: Path, unique_id: str
) -> None:
    """compose's controller, with its very command and Spark settings (master and driver
    address substituted), is the driver of its jobs on a standalone master and workers started
    from the wheel: with the threshold at 0 bytes its peek and its merge below a moved since
    run there (executors started for them by dynamic allocation), and give the model's rows."""
    from shared.io.controller_client import ControllerClient, body_kind
    from shared.io.kafka_admin import ensure_topic
    from shared.shard import DIFF, ERROR, Shard

    svc = project_services(compose())["controller"]
    deployed = {k: str(v) for k, v in svc["environment"].items()}
    assert deployed["SHARDSINK_CONTROLLER_SPARK_MASTER"].startswith("spark://")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, **deployed}
    env.pop("SHARDSINK_CONTROLLER_SPARK_MIN_BYTES", None)
    # The addresses and host paths of this machine; the rest as deployed.
    env.update({
        "SHARDSINK_KAFKA_BOOTSTRAP": stack.bootstrap_servers,
        "SHARDSINK_S3_ENDPOINT": stack.s3_endpoint,
        "SHARDSINK_CHECKPOINT_DIR": str(tmp_path / "controller"),
        "SHARDSINK_CONTROLLER_SPARK_MASTER": standalone_cluster.master_url,
        "PYSPARK_SUBMIT_ARGS": deployed["PYSPARK_SUBMIT_ARGS"].replace("spark.driver.host=controller", "spark.driver.host=127.0.0.1"),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SHARDSINK_METRICS_PORT": str(late_bound_port()),
        # This test's own catalog and command topics on the shared stack; every merge and peek
        # on Spark (compose's threshold keeps small work in the controller's process).
        "SHARDSINK_S3_PREFIX": f"deploy-ctl-{unique_id}",
        "SHARDSINK_TOPIC_COMMANDS": f"commands-{unique_id}",
        "SHARDSINK_TOPIC_RESPONSES": f"responses-{unique_id}",
        "SHARDSINK_CONTROLLER_SPARK_MIN_BYTES": "0",
    })
    assert "spark.driver.host=127.0.0.1" in env["PYSPARK_SUBMIT_ARGS"]
    settings = ServiceSettings.from_env_and_args(None, env)
    for topic in (env["SHARDSINK_TOPIC_COMMANDS"], env["SHARDSINK_TOPIC_RESPONSES"]):
        ensure_topic(settings.kafka, topic, 1)
    log = tmp_path / "controller.log"
    cmd = [sys.executable if c == "python" else c for c in svc["command"]]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    client = ControllerClient(settings.kafka, commands_topic=env["SHARDSINK_TOPIC_COMMANDS"],
                              responses_topic=env["SHARDSINK_TOPIC_RESPONSES"])

    def call(kind: str, body: dict[str, Any]) -> dict[str, Any]:
        assert proc.poll() is None, log.read_text()[-3000:]
        r = client.call(kind, body, timeout_s=180)
        assert body_kind(r) != "Error", f"{r}\n{log.read_text()[-3000:]}"
        return r

    def jobs() -> dict[tuple[str, str], int]:
        text = _scrape(int(env["SHARDSINK_METRICS_PORT"]))
        found = re.findall(r'^shardsink_controller_spark_jobs_total\{kind="(\w+)",outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M)
        return {(k, o): int(float(n)) for k, o, n in found}

    try:
        call("CreateCollection", {"collection_id": "orders", "row_schema": json.dumps(SCHEMA), "initial_since": 0,
                                  "read_policy": None})
        shard = Shard.open(settings.store(), "orders")
        # Inserts, retractions, multiplicities and error rows over three appends of about the
        # same weight: fewer than the tiered policy merges, and a balanced run once since
        # passes two of them (shared.state.plan_since_merge).
        model: collections.Counter[Any] = collections.Counter()
        for t in range(3):
            ups: list[tuple[Any, ...]] = [({"k": t * 10 + i, "v": f"v{i % 3}"}, t, 1 + i % 2) for i in range(10)]
            if t:
                ups += [({"k": (t - 1) * 10 + i, "v": f"v{i % 3}"}, t, -1) for i in range(0, 10, 2)]
            ups.append((None, t, 1, f"bad row at {t % 2}"))
            for u in ups:
                model[("err", u[3]) if u[0] is None else ("ok", u[0]["k"], u[0]["v"])] += u[2]
            shard.compare_and_append(ups, t, t + 1)
        want = {k: v for k, v in model.items() if v}

        def rows(table: Any) -> dict[Any, int]:
            return {(("err", r[ERROR]) if r[ERROR] is not None else ("ok", r["k"], r["v"])): r[DIFF] for r in table.to_pylist()}

        # A peek, answered by a Spark job as a folder of Parquet objects.
        r = call("Peek", {"collection_id": "orders", "as_of": 2, "max_inline_bytes": 0})
        kind, res = r["body"][1]["result"]
        assert kind.endswith("StoredRows") and res["format"] == "parquet-dataset", res
        store = settings.store()
        folder = res["key"][len(settings.s3.prefix) + 1:]
        keys = sorted(i.key for i in store.list(folder))
        assert keys, res
        import pyarrow as pa
        import pyarrow.parquet as pq

        peeked = pa.concat_tables([pq.read_table(pa.BufferReader(store.get(k))) for k in keys])
        assert rows(peeked) == want and res["row_count"] == len(want)
        # since moves to 2: the two batches below it are merged by a Spark job (the only merge).
        call("SetReadPolicy", {"collection_id": "orders", "policy": ("io.shardsink.v1.LagWritesBy", {"lag": 1, "granularity": None})})
        deadline = time.monotonic() + 180
        while True:
            st = shard.refresh()
            below = [b for b in st.batches if b.upper.less_equal(st.since)]
            if st.since.time == 2 and len(below) == 1 and below[0].since == st.since:
                break
            assert proc.poll() is None and time.monotonic() < deadline, (st.since, len(st.batches), log.read_text()[-3000:])
            time.sleep(0.3)
        assert rows(shard.snapshot(2)) == want
        done = jobs()
        assert done.get(("peek", "spark"), 0) >= 1 and done.get(("merge", "spark"), 0) >= 1, done
        assert not any(n for (_, outcome), n in done.items() if outcome == "fallback"), done
        apps = standalone_cluster.status()
        names = [a["name"] for a in apps["activeapps"]]  # type: ignore[attr-defined]
        assert "shardsink-controller" in names, names
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert deployed["AWS_SECRET_ACCESS_KEY"] not in log.read_text()
    finally:
        client.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def spark_workers(spark: dict[str, dict[str, Any]]) -> int:
    return sum(int(v.get("deploy", {}).get("replicas", 1)) for v in spark.values() if "Worker" in v["command"][1])


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.docker
def test_compose_stack_starts_with_docker() -> None:
    """The compose file itself, with a Docker engine (none runs on the CI machines)."""
    import shutil

    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip("no Docker engine on this machine: compose is checked statically and by running its commands above")
    subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], check=True)
