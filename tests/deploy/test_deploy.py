"""deploy/: the Kubernetes overlays render, validate and agree with `zllm serve`; the
Dockerfiles lint.

Offline, as CI can run it: `kubectl kustomize` renders each overlay, kubernetes-validate
(--strict: unknown fields are errors) checks the core kinds against Kubernetes' own schemas,
and the checks below hold the manifests to what the server does (its flags, port, /health,
drain, metrics). Building the images needs a Docker daemon and registry access, which CI does
not have: the Dockerfiles are linted (hadolint) and their entry points parsed, not built.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from servers import start_server, stop_server

from zllm.cli import build_parser, serve_config_from_args

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("Dockerfile.*"))
K8S_VERSION = "1.32.0"  # the oldest Kubernetes these manifests are for (preStop `sleep`: GA 1.32)
SUPERVISOR_STOP_S = 5  # zllm/runtime/supervisor.py waits drain_timeout + 5 s for the frontend
LABELS = {"app.kubernetes.io/name": "zllm"}


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):  # the CI image has kubectl; the test extra brings the rest
            pytest.fail(f"{name} not on PATH")
        pytest.skip(f"{name} not on PATH")
    return path


def render(overlay: str) -> list[dict]:
    kubectl = require_tool("kubectl")
    out = subprocess.run(
        [kubectl, "kustomize", str(OVERLAYS / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def the_deployment(docs: list[dict]) -> dict:
    (deployment,) = of_kind(docs, "Deployment")
    return deployment


def the_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def serve_args(args: list[str]):
    """`zllm serve`'s own parser over the manifest's arguments: an unknown or misspelled flag
    fails here (argparse exits), as it would fail the pod."""
    return build_parser().parse_args(["serve", *args])


OVERLAY_NAMES = sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir())
# The overlays of one Deployment of `zllm serve`; multi-node is a LeaderWorkerSet.
DEPLOYMENT_OVERLAYS = ["cpu", "gpu", "multi-replica"]


def test_every_overlay_is_here():
    assert OVERLAY_NAMES == ["cpu", "gpu", "multi-node", "multi-replica"]


@pytest.mark.parametrize("overlay", DEPLOYMENT_OVERLAYS)
def test_core_kinds_pass_strict_schema_validation(overlay):
    kv = pytest.importorskip("kubernetes_validate")
    docs = render(overlay)
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith("inference.networking.k8s.io/"):
            continue  # a custom resource: no published schema (test_inference_pool checks it)
        kv.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 3
    # The validator is strict: a misspelled field in the same Deployment is refused.
    bad = the_deployment(docs)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["perodSeconds"] = 5
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", DEPLOYMENT_OVERLAYS)
def test_the_server_the_manifests_describe(overlay):
    """Flags `zllm serve` accepts; the probes, the Service and the scrape annotations on the
    port it listens on; a grace period that outlasts preStop plus the drain."""
    docs = render(overlay)
    deployment = the_deployment(docs)
    pod = deployment["spec"]["template"]
    container = the_container(deployment)
    args = serve_args(container["args"])
    assert args.host == "0.0.0.0"  # reachable from the Service, not only from the pod
    (port,) = container["ports"]
    assert port["containerPort"] == args.port and port["name"] == "http"

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ("http", args.port), probe
    startup = container["startupProbe"]
    # Room for a first start: the model fetch and, on CPU, the kernel build (~35 s).
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    liveness = container["livenessProbe"]
    # /health is 503 while the supervisor restarts a dead engine: not a reason to kill the pod.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60

    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop_s + args.drain_timeout + SUPERVISOR_STOP_S

    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == args.port
    assert annotations["prometheus.io/path"] == "/metrics"

    (service,) = of_kind(docs, "Service")
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in ("http", args.port)
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == service["spec"]["selector"] == LABELS
    assert LABELS.items() <= pod["metadata"]["labels"].items()

    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e for e in container["env"]}
    assert mounts["model-cache"] == env["ZLLM_CACHE"]["value"]

    resources = container["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys()
    assert "memory" in resources["limits"]
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_overlays_pick_their_image_and_device():
    cpu, gpu = (the_container(the_deployment(render(o))) for o in ("cpu", "gpu"))
    assert cpu["image"] == "zllm:0.1.0-cpu" and gpu["image"] == "zllm:0.1.0-cuda"
    assert serve_args(cpu["args"]).device == "auto"
    assert serve_args(gpu["args"]).device == "cuda"
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # torch's threads follow the CPU limit, not the node's core count.
    threads = cpu["env"][[e["name"] for e in cpu["env"]].index("OMP_NUM_THREADS")]
    assert threads["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    assert cpu["resources"]["limits"]["cpu"] == cpu["resources"]["requests"]["cpu"]


def test_single_replica_overlays_keep_the_model_cache_on_a_claim():
    for overlay in ("cpu", "gpu"):
        docs = render(overlay)
        deployment = the_deployment(docs)
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        (claim,) = of_kind(docs, "PersistentVolumeClaim")
        assert (
            volumes["model-cache"]["persistentVolumeClaim"]["claimName"]
            == claim["metadata"]["name"]
        )
        # ReadWriteOnce: the old pod must let go of the claim before the new one starts.
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert deployment["spec"]["strategy"]["type"] == "Recreate"
        assert deployment["spec"]["replicas"] == 1


def test_multi_replica_scales_on_the_queue():
    docs = render("multi-replica")
    deployment = the_deployment(docs)
    assert deployment["spec"]["replicas"] >= 2
    assert not of_kind(docs, "PersistentVolumeClaim")  # no shared ReadWriteOnce claim
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert set(volumes["model-cache"]) == {"name", "emptyDir"}
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2
    (metric,) = hpa["spec"]["metrics"]
    served_as = metric["pods"]["metric"]["name"]
    # The prometheus-adapter rule beside it serves vllm:num_requests_waiting under that name.
    values = yaml.safe_load(
        (OVERLAYS / "multi-replica" / "prometheus-adapter-values.yaml").read_text()
    )
    (rule,) = values["rules"]["custom"]
    series = re.match(r"([\w:]+)\{", rule["seriesQuery"]).group(1)
    assert series == "vllm:num_requests_waiting"
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert renamed == served_as

    (pdb,) = of_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == LABELS
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def test_inference_pool():
    """No schema for the custom resource is published where kubernetes-validate looks, so
    these are the required fields and bounds of the upstream CRD,
    kubernetes-sigs/gateway-api-inference-extension
    config/crd/bases/inference.networking.k8s.io_inferencepools.yaml (v1): spec.selector with
    matchLabels (1-64 labels), spec.targetPorts (1-8 unique numbers in 1-65535), and
    endpointPickerRef with a name and, for a Service (the default kind), port.number."""
    docs = render("multi-replica")
    (pool,) = of_kind(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "endpointPickerRef", "appProtocol"}
    labels = spec["selector"]["matchLabels"]
    assert 1 <= len(labels) <= 64
    deployment = the_deployment(docs)
    assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert 1 <= len(numbers) <= 8 and len(set(numbers)) == len(numbers)
    assert all(1 <= n <= 65535 for n in numbers)
    assert numbers == [the_container(deployment)["ports"][0]["containerPort"]]
    picker = spec["endpointPickerRef"]
    assert picker["name"]
    if picker.get("kind", "Service") == "Service":
        assert 1 <= picker["port"]["number"] <= 65535
    assert picker.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def test_multi_node_leader_worker_set(smollm2_path):
    """The LeaderWorkerSet is a custom resource (kubernetes-sigs/lws) with no schema where
    kubernetes-validate looks. Its pod templates are checked as Kubernetes' own PodTemplate
    (strict), the Service as a Service, and the set's own fields against the upstream CRD,
    config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml (v1): spec requires
    leaderWorkerTemplate, which requires workerTemplate; size and replicas are integers
    (replicas 0..1000000); restartPolicy is one of Default, RecreateGroupOnPodRestart,
    RecreateGroupAfterStart, None; startupPolicy one of LeaderCreated, LeaderReady. Then the
    leader's command is `zllm serve` with the Ray backend over as many ranks as the group has
    GPUs, and the workers join the leader's Ray head."""
    kv = pytest.importorskip("kubernetes_validate")
    docs = render("multi-node")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert set(spec) <= {
        "replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"
    }  # fmt: skip
    template = spec["leaderWorkerTemplate"]
    assert "workerTemplate" in template
    assert set(template) <= {
        "leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
        "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy",
    }  # fmt: skip
    assert isinstance(template["size"], int) and template["size"] >= 2
    assert isinstance(spec["replicas"], int) and 0 <= spec["replicas"] <= 1_000_000
    assert template["restartPolicy"] in (
        "Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"
    )  # fmt: skip
    # Not LeaderReady: the leader is ready only once the workers have joined.
    assert spec["startupPolicy"] == "LeaderCreated"
    for name in ("leaderTemplate", "workerTemplate"):
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"zllm-{name}"},
            "template": template[name],
        }
        kv.validate(pod_template, K8S_VERSION, strict=True)
    (service,) = of_kind(docs, "Service")
    kv.validate(service, K8S_VERSION, strict=True)

    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    script = leader["args"][0]
    head_port = re.search(r"ray start --head --port=(\d+)", script).group(1)
    args = serve_args(shlex.split(script.split("exec zllm serve", 1)[1]))
    assert args.distributed_executor_backend == "ray" and args.host == "0.0.0.0"
    gpus = [
        int(c["resources"]["limits"]["nvidia.com/gpu"]) for c in (leader, worker)
    ]  # one pod of each kind: the leader, then size - 1 workers
    group_gpus = gpus[0] + gpus[1] * (template["size"] - 1)
    assert args.tensor_parallel_size * args.pipeline_parallel_size == group_gpus
    # The engine takes that split of the model (the parser alone took a TP size that SmolLM2's
    # 9 heads refuse): its config is built as `zllm serve` builds it, from the cached file.
    assert args.model == "smollm2"
    served = argparse.Namespace(**{**vars(args), "model": smollm2_path})
    config = serve_config_from_args(served).engine
    assert config.distributed_executor_backend == "ray" and config.world_size == group_gpus
    assert f'ray start --address="${{LWS_LEADER_ADDRESS}}:{head_port}"' in worker["args"][0]
    assert "--block" in worker["args"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[probe]["httpGet"]["path"] == "/health"
    (http,) = [p for p in leader["ports"] if p["name"] == "http"]
    assert http["containerPort"] == args.port
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    # Every pod holds the model at the same path (a rank on a worker loads it there).
    for container in (leader, worker):
        env = {e["name"]: e["value"] for e in container["env"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert env["ZLLM_CACHE"] == mounts["model-cache"]
    assert "zllm download smollm2" in worker["args"][0] and args.model == "smollm2"
    grace = template["leaderTemplate"]["spec"]["terminationGracePeriodSeconds"]
    pre_stop_s = leader["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert grace > pre_stop_s + args.drain_timeout + SUPERVISOR_STOP_S


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile(dockerfile):
    hadolint = require_tool("hadolint")
    lint = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    text = dockerfile.read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2  # multi-stage
    user = re.findall(r"^USER (\S+)", text, re.M)[-1]
    assert user.split(":")[0].isdigit() and not user.startswith("0")  # numeric, not root
    assert re.search(r'^VOLUME \["/models"\]', text, re.M)
    assert re.search(r"ZLLM_CACHE=/models", text)
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    assert entry == ["zllm", "serve"]
    args = serve_args(cmd)
    assert args.host == "0.0.0.0" and f"EXPOSE {args.port}" in text
    # Every package folder the wheel maps is copied into the build stage.
    for folder in (
        "zllm",
        "core",
        "executor",
        "tokenizer_proc",
        "detokenizer_proc",
        "frontend",
        "csrc",
    ):
        assert f"COPY {folder} {folder}" in text


@pytest.mark.e2e
def test_a_server_started_as_the_manifest_says(tiny_llama_dir, tmp_path):
    """`zllm serve` with the cpu overlay's flags (the tiny model and a loopback port in place
    of the model and 0.0.0.0:8000) answers the probes' path and exports every series the HPA
    rule and the inference gateway's endpoint picker read."""
    container = the_container(the_deployment(render("cpu")))
    args = list(container["args"])
    for flag in ("--host", "--port"):
        i = args.index(flag)
        del args[i : i + 2]
    assert args[0] == "smollm2"
    server = start_server(tiny_llama_dir, tmp_path / "server.log", *args[1:])
    try:
        assert server.get("/health").status_code == 200
        metrics = server.get("/metrics").text
        for series in (
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc",
        ):
            assert re.search(rf"^{re.escape(series)}\{{", metrics, re.M), series
    finally:
        assert stop_server(server) == 0


def documented_commands(path: Path) -> list[list[str]]:
    """The `zllm serve` / `zllm proxy` commands in a Markdown file's code blocks, as argv
    (continuation lines joined, comments, `&` and `&&`-joined commands split off)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                if not part.strip().startswith("zllm "):
                    continue
                words = shlex.split(part, comments=True)
                if words[-1:] == ["&"]:
                    words = words[:-1]
                if words[:2] in (["zllm", "serve"], ["zllm", "proxy"]):
                    commands.append(words[1:])
    return commands


def test_documented_deployment_commands_start_on_smollm2(smollm2_path):
    """Every `zllm serve` command docs/deploy.md shows, and those for SmolLM2 the README and
    the other docs pages show, is one the server takes: parsed by its parser and its config
    built as `zllm serve` builds it, against the cached SmolLM2 (a tensor-parallel size its
    9 heads refuse fails here); `zllm proxy` commands parse."""
    root = ROOT
    deploy = root / "docs" / "deploy.md"
    others = [root / "README.md", *sorted(set((root / "docs").glob("*.md")) - {deploy})]
    commands = documented_commands(deploy) + [
        argv for page in others for argv in documented_commands(page) if "smollm2" in argv
    ]
    served = 0
    for argv in commands:
        args = build_parser().parse_args(argv)
        if argv[0] == "proxy":
            assert args.prefill and args.decode
            continue
        assert args.model == "smollm2", argv
        args.model = smollm2_path
        config = serve_config_from_args(args)
        assert config.engine.world_size == args.tensor_parallel_size * args.pipeline_parallel_size
        served += 1
    assert served >= 12, commands  # the docs' serve commands were all found
