"""The chart's examples: valid Kubernetes objects, and rollout pods that keep the
sidecar-engine contract of docs/engines.md.

Every built-in object validates against the Kubernetes schemas (kubernetes-validate,
strict; a LeaderWorkerSet's pod templates as pods), every RolloutFleet and WeightRefit
against the operator's own models, and the real apiserver accepts them all with strict
field validation (a LeaderWorkerSet against LeaderWorkerSet's own CRD). Each rollout pod (vLLM,
SGLang, the reference engine) is checked for what the contract needs: the engine started
with DCR's plugin and told where staging and checkpoints are mounted, the agent told the
engine's loopback URL and its own mount of the same memory-backed staging volume, the
token from the Secret the fleet names, probes on both containers, and every ``dcr``
command line accepted by dcr's own argument parser.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from controlplane import ControlPlane, ControlPlaneError, built, go_available
from k8sutil import CHART, apply, install_crds, path_of, wait_established
from kubelet import expand

from dcr.cli import build_parser
from dcr.drivers.sglang import LOADER
from dcr.errors import ConfigError
from dcr.format.commitfile import COMMIT_FILE_KEY
from dcr.http.admission import CLIENT_ROUTES
from dcr.http.engine_guard import TOKEN_FILE_ENV
from dcr.http.tokens import check_token
from dcr.loop import parser as ranks_parser
from dcr_operator.api.rolloutfleet import LWS_GROUP_KEY, LWS_WORKER_INDEX, RolloutFleetSpec
from dcr_operator.api.weightrefit import WeightRefitSpec
from dcr_operator.commitmap import commit_map_name
from dcr_operator.kube import KubeClient
from dcr_operator.peers import service_name, token_secret_name
from dcr_operator.reconcile import secret_holders

KUBE_VERSION = "1.37.0"  # as test_chart.py: the control plane's release line
EXAMPLES = CHART / "examples"
ROLLOUTS = {"rollout-vllm.yaml": "vllm", "rollout-sglang.yaml": "sglang",
            "rollout-reference.yaml": "vllm"}  # file -> the agent's --engine
CUSTOM = {"RolloutFleet": RolloutFleetSpec, "WeightRefit": WeightRefitSpec}
MULTINODE = "rollout-vllm-multinode.yaml"  # a LeaderWorkerSet: replicas of two pods
GUARDED = ("rollout-vllm.yaml", MULTINODE)  # vLLM with the client guard inside
GUARD = "dcr.http.engine_guard.EngineGuard"
RELAY = "relay.yaml"  # the relay tree, its fleet and that fleet's rollout pods
TRAINER = "trainer-ranks.yaml"  # a training loop whose ranks are the owners


def objects(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def every_example() -> list[str]:
    return sorted(p.name for p in EXAMPLES.glob("*.yaml"))


def test_the_examples_are_the_fleet_the_refit_and_one_rollout_pod_per_engine() -> None:
    assert every_example() == sorted(["rolloutfleet.yaml", "weightrefit.yaml",
                                      "encoder-endpoint.yaml", "training-cluster.yaml",
                                      "mirror.yaml", MULTINODE, RELAY, TRAINER, *ROLLOUTS])


@pytest.mark.parametrize("name", every_example())
def test_example_objects_validate_against_kubernetes_schemas_and_the_operator(
        name: str) -> None:
    for obj in objects(name):
        if obj["kind"] in CUSTOM:
            CUSTOM[obj["kind"]].model_validate(obj["spec"])
        elif obj["kind"] == "LeaderWorkerSet":  # not built in: its pods are
            for role, spec in pod_specs(name).items():
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {
                    "name": role}, "spec": spec}, KUBE_VERSION, strict=True)
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def pod(name: str) -> dict[str, Any]:
    (deployment,) = [o for o in objects(name) if o["kind"] == "Deployment"]
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def pod_specs(name: str) -> dict[str, dict[str, Any]]:
    """The rollout pods of an example, by role: a Deployment's pod, or a LeaderWorkerSet's
    leader and worker."""
    if name == RELAY:  # the tree's nodes and the fleet's rollout pods, both StatefulSets
        sets = {o["metadata"]["name"]: o for o in objects(name) if o["kind"] == "StatefulSet"}
        return {role: sets[name]["spec"]["template"]["spec"]
                for role, name in (("relay", "rollout-relay"), ("rollout", "relay-rollout"))}
    if name != MULTINODE:
        return {"pod": pod(name)}
    (lws,) = [o for o in objects(name) if o["kind"] == "LeaderWorkerSet"]
    t = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": t["leaderTemplate"]["spec"], "worker": t["workerTemplate"]["spec"]}


def arg(container: dict[str, Any], flag: str) -> str:
    """The value of ``--flag=value`` among a container's args (exactly once)."""
    values = [a.split("=", 1)[1] for a in container["args"] if a.startswith(flag + "=")]
    assert len(values) == 1, (container["name"], flag, container["args"])
    return values[0]


def mounts(container: dict[str, Any]) -> dict[str, str]:
    """mount path -> volume name."""
    return {m["mountPath"]: m["name"] for m in container["volumeMounts"]}


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def engine_checks(name: str, engine: dict[str, Any]) -> None:
    """What each engine needs to run DCR's plugin (docs/engines.md)."""
    if name == "rollout-vllm.yaml":
        assert engine["command"] == ["vllm", "serve"]
        assert arg(engine, "--worker-extension-cls") == "dcr.runtimes.vllm.DcrWorkerExtension"
        assert env(engine)["VLLM_SERVER_DEV_MODE"] == "1"
    elif name == "rollout-sglang.yaml":
        assert arg(engine, "--custom-weight-loader") == LOADER
        assert env(engine)["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    else:
        assert engine["command"] == ["dcr", "serve"]
        assert arg(engine, "--staging-dir") == env_or_arg_staging(engine)


def env_or_arg_staging(engine: dict[str, Any]) -> str:
    return env(engine).get("DCR_STAGING_DIR") or arg(engine, "--staging-dir")


def env_or_arg_root(engine: dict[str, Any]) -> str:
    return env(engine).get("DCR_CHECKPOINT_ROOT") or arg(engine, "--checkpoint-root")


@pytest.mark.parametrize("name", sorted(ROLLOUTS))
def test_rollout_pod_keeps_the_sidecar_engine_contract(name: str) -> None:
    spec = pod(name)
    volumes = {v["name"]: v for v in spec["volumes"]}
    (agent,) = [c for c in spec["containers"] if c["name"] == "agent"]
    (engine,) = [c for c in spec["containers"] if c["name"] != "agent"]
    engine_checks(name, engine)

    # One memory-backed staging volume, where each container says it is mounted.
    staging = env_or_arg_staging(engine)
    volume = mounts(engine)[staging]
    assert volumes[volume]["emptyDir"]["medium"] == "Memory"
    assert "sizeLimit" in volumes[volume]["emptyDir"]
    assert mounts(agent)[arg(agent, "--staging-dir")] == volume

    # The engine starts on what the init container built in the pod's own weights
    # volume (read-only to the engine), where dense loads come from too.
    root = env_or_arg_root(engine)
    weights = mounts(engine)[root]
    assert next(m for m in engine["volumeMounts"] if m["name"] == weights)["readOnly"] is True
    assert "emptyDir" in volumes[weights]
    start = f"{root}/current"
    assert any(a.split("=", 1)[-1] == start for a in engine["args"]), engine["args"]
    (init,) = spec["initContainers"]
    assert init["command"] == ["dcr", "materialize"]
    assert arg(init, "--out") == start == arg(agent, "--canonical")
    assert mounts(init)[root] == weights == mounts(agent)[root]
    assert arg(init, "--store") == arg(agent, "--store")
    seed = arg(init, "--seed")
    (base,) = [m for m in init["volumeMounts"] if seed.startswith(m["mountPath"] + "/")]
    assert base["readOnly"] is True
    assert not any(a.startswith("--model-version") for a in agent["args"])  # recorded

    # The agent drives the engine over loopback, on the engine's port.
    assert arg(agent, "--engine") == ROLLOUTS[name]
    url = arg(agent, "--engine-url")
    assert url.startswith("http://127.0.0.1:")
    if ROLLOUTS[name] == "sglang":  # its admin routes need --admin-api-key
        assert url in [f"http://127.0.0.1:{p['containerPort']}" for p in engine["ports"]]
    elif name in GUARDED:  # its admin routes need the engine admin token: the next test
        assert not any(a.startswith("--client-listen") for a in agent["args"])
    else:
        # vLLM's dev-mode admin routes answer whoever reaches its port: it listens on
        # loopback only, and clients reach the inference routes through the agent.
        port = url.rsplit(":", 1)[1]
        listen = [a for a in engine["args"] if a.endswith(f"127.0.0.1:{port}")
                  or a in ("--host=127.0.0.1", f"--port={port}")]
        assert listen, engine["args"]
        assert not any("0.0.0.0" in a for a in engine["args"]), engine["args"]
        assert "ports" not in engine
        client = arg(agent, "--client-listen")
        assert client.startswith("0.0.0.0:")
        assert int(client.rsplit(":", 1)[1]) in [p["containerPort"] for p in agent["ports"]]

    # Probes on both; the agent's token from the Secret the fleet names (labelled).
    for c in (engine, agent):
        assert {"readinessProbe", "livenessProbe"} <= c.keys(), c["name"]
    assert env(agent)["DCR_AGENT_TOKEN"] == {"secretKeyRef": {"name": "rollout-agent-token",
                                                              "key": "token"}}
    (secret,) = [o for o in objects("rolloutfleet.yaml") if o["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "rollout-agent-token"
    assert secret["metadata"]["labels"] == {"dcr.dev/agent-token": "true"}

    # The fleet selects these pods.
    (fleet,) = [o for o in objects("rolloutfleet.yaml") if o["kind"] == "RolloutFleet"]
    (deployment,) = [o for o in objects(name) if o["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert fleet["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert fleet["spec"]["agent"]["port"] in [p["containerPort"] for p in agent["ports"]]
    if ROLLOUTS[name] == "sglang":  # SGLang has no pause that lets requests finish
        assert arg(agent, "--pause-mode") != "wait"


@pytest.mark.parametrize("name", sorted(ROLLOUTS))
def test_encoders_read_the_training_checkpoints_which_no_rollout_pod_mounts(
        name: str) -> None:
    """``dcr encode`` reads the base (the fleet's initial checkpoint here) and the target
    (the refit's source) from paths on the training side's claim; the rollout pods mount
    no volume of the encoder profiles: two clusters share only the store."""
    (fleet,) = [o for o in objects("rolloutfleet.yaml") if o["kind"] == "RolloutFleet"]
    (refit,) = [o for o in objects("weightrefit.yaml") if o["kind"] == "WeightRefit"]
    profiles = RolloutFleetSpec.model_validate(fleet["spec"]).encoder_profiles
    (profile,) = [p for p in profiles if p.name == refit["spec"]["encoder"]["profile"]]
    for path in (fleet["spec"]["initial"]["checkpoint"], refit["spec"]["source"]["checkpoint"]):
        (volume,) = [v for v in profile.volumes or []
                     if path.startswith(v.mount_path + "/")]
        assert volume.read_only
        assert volume.persistent_volume_claim is not None
    training = {v.persistent_volume_claim.claim_name for p in profiles for v in p.volumes or []
                if v.persistent_volume_claim is not None}
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod(name)["volumes"]
              if "persistentVolumeClaim" in v}
    assert training
    assert not claims & training, claims


@pytest.mark.parametrize("name", [*sorted(ROLLOUTS), "mirror.yaml", MULTINODE])
def test_rollout_pods_are_never_handed_the_stores_write_credentials(name: str) -> None:
    """Fails on b20bcff: every rollout example handed its pods ``weights-s3``, the Secret
    the fleet names for the encoders' writes, so a compromised engine could choose the
    weights of every replica; they hold a read-only key of their own."""
    (fleet,) = [o for o in objects("rolloutfleet.yaml") if o["kind"] == "RolloutFleet"]
    write = fleet["spec"]["store"]["credentialsSecretRef"]["name"]
    pods = [{"metadata": {"name": role}, "spec": spec}
            for role, spec in pod_specs(name).items()]
    assert secret_holders(pods, write) == []
    assert secret_holders(pods, f"{write}-read") == sorted(p["metadata"]["name"] for p in pods)


@pytest.mark.parametrize("name", [*sorted(ROLLOUTS), "mirror.yaml", MULTINODE])
def test_pods_build_the_version_the_fleets_commit_configmap_names(name: str) -> None:
    """``dcr materialize`` and ``dcr mirror`` are given the committed version and history
    digest in the file of the ConfigMap the operator keeps for the fleet, mounted
    read-only as an optional volume (no API token; absent before the fleet's first
    record): a store writer cannot steer them (docs/two-clusters.md)."""
    fleet = "policy-rollout-mn" if name == MULTINODE else "policy-rollout"
    builders = [(spec, c) for spec in pod_specs(name).values()
                for c in spec.get("initContainers", []) + spec["containers"]
                if c["command"][:2] in (["dcr", "materialize"], ["dcr", "mirror"])]
    assert builders
    for spec, c in builders:
        path = Path(arg(c, "--commit-file"))
        assert path.name == COMMIT_FILE_KEY
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
        assert mount["readOnly"] is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"] == {"name": commit_map_name(fleet), "optional": True}


@pytest.mark.parametrize("name", [*sorted(ROLLOUTS), "mirror.yaml", MULTINODE, RELAY])
def test_every_dcr_command_line_of_a_rollout_pod_parses(name: str) -> None:
    for c in [c for spec in pod_specs(name).values()
              for c in spec.get("initContainers", []) + spec["containers"]]:
        if c["command"][0] != "dcr":
            continue
        # As the kubelet expands $(VAR): a field's value stands in for a fieldRef's.
        known = {e["name"]: e.get("value", "1") for e in c.get("env", [])}
        argv = [*c["command"][1:], *(expand(a, known) for a in c["args"])]
        try:
            build_parser(argv[0]).parse_args(argv)
        except SystemExit:
            pytest.fail(f"{name}: {c['name']}: dcr does not take: {shlex.join(argv)}")


def test_the_warm_encoder_example_is_locked_down_and_serves_the_fleets_warm_profile() -> None:
    """examples/encoder-endpoint.yaml: ``dcr encoder`` from the dcr image, non-root
    65532 with a read-only root filesystem, the checkpoint claim read-only, the token a
    file from the labelled Secret (never an argument), the fleet's store, a checkpoint
    root holding both checkpoints a refit reads, and the fleet's "warm" profile calling
    its Service once per owner."""
    objs = {o["kind"]: o for o in objects("encoder-endpoint.yaml")}
    spec = objs["Deployment"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["command"] == ["dcr", "encoder"]
    assert c["image"].startswith("ghcr.io/dcr-dev/dcr:")
    build_parser("encoder").parse_args([*c["command"][1:], *c["args"]])
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsNonRoot"]) == (
        65532, True)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in spec["volumes"]}
    by_path = {m["mountPath"]: m for m in c["volumeMounts"]}
    token_file = arg(c, "--token-file")
    (token_mount,) = [m for p, m in by_path.items() if token_file.startswith(p + "/")]
    assert token_mount["readOnly"] is True
    secret = objs["Secret"]
    assert volumes[token_mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"]
    assert secret["metadata"]["labels"] == {"dcr.dev/encoder-token": "true"}
    assert not any(secret["stringData"]["token"] in a for a in c["args"])
    root = arg(c, "--checkpoint-root")
    (ckpt_mount,) = [m for p, m in by_path.items() if root.startswith(p + "/")]
    assert ckpt_mount["readOnly"] is True
    assert volumes[ckpt_mount["name"]]["persistentVolumeClaim"]["readOnly"] is True
    (fleet,) = [o for o in objects("rolloutfleet.yaml") if o["kind"] == "RolloutFleet"]
    (refit,) = [o for o in objects("weightrefit.yaml") if o["kind"] == "WeightRefit"]
    assert arg(c, "--store") == fleet["spec"]["store"]["uri"]
    for path in (fleet["spec"]["initial"]["checkpoint"], refit["spec"]["source"]["checkpoint"]):
        assert path.startswith(root + "/")
    (warm,) = [p for p in RolloutFleetSpec.model_validate(fleet["spec"]).encoder_profiles
               if p.endpoint is not None]
    assert warm.endpoint is not None
    assert warm.endpoint.token_secret_ref.name == secret["metadata"]["name"]
    service = objs["Service"]
    (port,) = service["spec"]["ports"]
    assert set(warm.endpoint.urls) == {
        f"https://{service['metadata']['name']}.rl.svc:{port['port']}"}
    assert len(warm.endpoint.urls) <= int(arg(c, "--max-publishes"))
    assert objs["Deployment"]["spec"]["replicas"] == 1  # a stop reaches the publisher


def test_the_trainer_example_runs_the_loop_as_ranks_with_only_the_rights_it_needs() -> None:
    """examples/trainer-ranks.yaml: ``python -m dcr.loop`` from the serve image (its
    arguments parse), one pod per rank of an Indexed Job whose index is the rank, meeting at
    rank 0's name on the headless Service (resolvable before the pods are ready); the token
    a file from the labelled Secret; the checkpoint claim read-only; the fleet's store; a
    ServiceAccount that may create and watch WeightRefits and nothing else; the operator
    the only caller of the owners' port."""
    objs = {o["kind"]: o for o in objects(TRAINER)}
    job = objs["Job"]
    spec = job["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["image"].startswith("ghcr.io/dcr-dev/dcr-serve:")
    assert c["command"] == ["python", "-m", "dcr.loop"]
    args = ranks_parser().parse_args(c["args"])
    world = int(env(c)["WORLD_SIZE"])
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == world
    assert env(c)["RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    service = objs["Service"]
    assert spec["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {
        "batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert env(c)["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsNonRoot"]) == (
        65532, True)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    by_path = {m["mountPath"]: m for m in c["volumeMounts"]}
    (token_mount,) = [m for p, m in by_path.items() if str(args.token_file).startswith(p + "/")]
    secret = objs["Secret"]
    assert volumes[token_mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"]
    assert secret["metadata"]["labels"] == {"dcr.dev/encoder-token": "true"}
    (ckpt_mount,) = [m for p, m in by_path.items() if str(args.checkpoint).startswith(p + "/")]
    assert ckpt_mount["readOnly"] is True
    assert volumes[ckpt_mount["name"]]["persistentVolumeClaim"]["readOnly"] is True
    (fleet,) = [o for o in objects("rolloutfleet.yaml") if o["kind"] == "RolloutFleet"]
    assert args.store == fleet["spec"]["store"]["uri"]
    assert args.fleet == fleet["metadata"]["name"]
    assert spec["serviceAccountName"] == objs["ServiceAccount"]["metadata"]["name"]
    assert objs["Role"]["rules"] == [{"apiGroups": ["dcr.dev"], "resources": ["weightrefits"],
                                      "verbs": ["create", "get", "list", "watch"]}]
    assert objs["RoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": objs["ServiceAccount"]["metadata"]["name"]}]
    owner, peers = objs["NetworkPolicy"]["spec"]["ingress"]
    assert owner["ports"] == [{"port": "owner"}]
    assert owner["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "dcr-system"}
    assert peers["from"] == [{"podSelector": {"matchLabels": {"app": "trainer"}}}]


def test_the_multinode_example_drives_each_group_through_its_leader() -> None:
    """rollout-vllm-multinode.yaml: the fleet's groups are the LeaderWorkerSet's (its
    labels, its size); the leader's agent drives vLLM over loopback and names one member
    per worker pod, at the name LeaderWorkerSet gives it, on the fleet's agent port; each
    worker pod's agent is a member; in both pods the agent stages where that pod's ranks
    read (the engine container's DCR_STAGING_DIR), a memory-backed volume, from the
    fleet's store, with the fleet's token."""
    objs = {o["kind"]: o for o in objects(MULTINODE)}
    lws, fleet = objs["LeaderWorkerSet"], objs["RolloutFleet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    spec = RolloutFleetSpec.model_validate(fleet["spec"])
    assert spec.groups is not None
    assert (spec.groups.size, spec.groups.label, spec.groups.leader_label,
            spec.groups.leader_value) == (template["size"], LWS_GROUP_KEY, LWS_WORKER_INDEX,
                                          "0")
    for role in ("leaderTemplate", "workerTemplate"):
        labels = template[role]["metadata"]["labels"]
        assert fleet["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert spec.store is not None
    agents = {}
    for role, pod_spec in pod_specs(MULTINODE).items():
        (agent,) = [c for c in pod_spec["containers"] if c["name"] == "agent"]
        (engine,) = [c for c in pod_spec["containers"] if c["name"] != "agent"]
        volumes = {v["name"]: v for v in pod_spec["volumes"]}
        volume = mounts(engine)[env(engine)["DCR_STAGING_DIR"]]
        assert volumes[volume]["emptyDir"]["medium"] == "Memory"
        assert mounts(agent)[arg(agent, "--staging-dir")] == volume
        assert arg(agent, "--store") == spec.store.uri
        assert env(agent)["DCR_AGENT_TOKEN"] == {"secretKeyRef": {
            "name": spec.agent.token_secret_ref.name, "key": spec.agent.token_secret_ref.key}}
        assert spec.agent.port in [p["containerPort"] for p in agent["ports"]]
        agents[role] = agent
    (serve,) = pod_specs(MULTINODE)["leader"]["containers"][0]["args"]
    assert "--worker-extension-cls=dcr.runtimes.vllm.DcrWorkerExtension" in serve
    assert arg(agents["leader"], "--engine-url") == "http://127.0.0.1:8000"
    name = lws["metadata"]["name"]
    members = [a.split("=", 1)[1] for a in agents["leader"]["args"]
               if a.startswith("--member=")]
    assert members == [f"http://{name}-$(GROUP_INDEX)-{i}.{name}:{spec.agent.port}"
                       for i in range(1, template["size"])]
    assert env(agents["leader"])["GROUP_INDEX"] == {"fieldRef": {
        "fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"}}
    assert arg(agents["worker"], "--role") == "member"
    assert not any(a.startswith(("--engine", "--member", "--client-listen"))
                   for a in agents["worker"]["args"])


def engine_args(engine: dict[str, Any]) -> list[str]:
    """vLLM's arguments, a ``sh -c`` line's words after ``exec`` included."""
    if engine["command"] == ["vllm", "serve"]:
        return list(engine["args"])
    (line,) = engine["args"]
    return shlex.split(line.split("exec ", 1)[1])


def probe_port(container: dict[str, Any], probe: str) -> int:
    port = container[probe]["httpGet"]["port"]
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    return int(named.get(port, port))


@pytest.mark.parametrize("name", GUARDED)
def test_clients_of_a_vllm_pod_reach_the_engine_whose_guard_only_the_agent_passes(
        name: str) -> None:
    """vLLM listens on the pod's client port with the guard inside; the agent calls that
    port on loopback and serves no client door; the engine admin token is a Secret of its
    own (a refused placeholder in the file, not the agent token), mounted read-only as the
    file both containers name in DCR_ENGINE_TOKEN_FILE, never a value or an argument; the
    probes hit /health, a client route, on the engine's port; the NetworkPolicy admits
    clients to that port. The worker pods of a group drive no engine and hold no token."""
    specs = pod_specs(name)
    spec = specs["pod" if name != MULTINODE else "leader"]
    (agent,) = [c for c in spec["containers"] if c["name"] == "agent"]
    (engine,) = [c for c in spec["containers"] if c["name"] != "agent"]
    args = engine_args(engine)
    assert f"--middleware={GUARD}" in args, args
    port = int(next(a for a in args if a.startswith("--port=")).split("=", 1)[1])
    assert "--host=0.0.0.0" in args
    assert port in [p["containerPort"] for p in engine["ports"]]
    assert arg(agent, "--engine-url") == f"http://127.0.0.1:{port}"
    assert not any(a.startswith("--client-listen") for a in agent["args"])
    assert port not in [p["containerPort"] for p in agent["ports"]]
    assert "GET /health" in CLIENT_ROUTES
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"]["path"] == "/health"
        assert probe_port(engine, probe) == port

    (secret,) = [o for o in objects(name) if o["kind"] == "Secret"]
    token = secret["stringData"]["token"]
    assert secret["metadata"]["name"] != "rollout-agent-token"
    with pytest.raises(ConfigError, match="placeholder"):
        check_token(token, "engine admin token")
    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in (engine, agent):
        path = Path(env(c)[TOKEN_FILE_ENV])  # a plain value: a path
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"] == {
            "secretName": secret["metadata"]["name"], "defaultMode": 0o400}
        assert path.name == "token"
    holders = [{"metadata": {"name": role}, "spec": s} for role, s in specs.items()]
    assert secret_holders(holders, secret["metadata"]["name"]) == [
        "pod" if name != MULTINODE else "leader"]
    for c in [c for s in specs.values() for c in s.get("initContainers", []) + s["containers"]]:
        assert not any(token in a for a in c.get("args", [])), c["name"]
        refs = [e.get("valueFrom", {}).get("secretKeyRef", {}) for e in c.get("env", [])]
        refs += [e.get("secretRef", {}) for e in c.get("envFrom", [])]
        assert secret["metadata"]["name"] not in [r.get("name") for r in refs], c["name"]

    (policy,) = [o for o in objects(name) if o["kind"] == "NetworkPolicy"]
    (clients,) = [r for r in policy["spec"]["ingress"]
                  if r["from"] == [{"podSelector": {"matchLabels": {
                      "dcr.dev/rollout-client": "true"}}}]]
    assert clients["ports"] == [{"protocol": "TCP", "port": port}]


def test_the_relay_example_is_a_tree_its_fleet_publishes_to_and_its_pods_read() -> None:
    """relay.yaml: the StatefulSet's members list names each of its pods on the headless
    Service, in ordinal order (the pod's index from its pod-index label), the root first;
    the fleet publishes to the root with the publish token's labelled Secret; the rollout
    pods read through a Service over the nodes with the other (read) token; they start
    from the fleet's initial checkpoint, which engine and agent resolve under the same
    checkpoint root; each node mounts both tokens, each rollout pod only the read one."""
    objs = objects(RELAY)
    kinds = {o["kind"]: o for o in objs if o["kind"] not in ("Secret", "Service", "StatefulSet")}
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    tokens = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    sets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "StatefulSet"}
    sts, fleet = sets["rollout-relay"], kinds["RolloutFleet"]
    spec = RolloutFleetSpec.model_validate(fleet["spec"])
    assert spec.relay is not None
    (relay,) = sts["spec"]["template"]["spec"]["containers"]
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"][
        "labels"].items()
    port = headless["spec"]["ports"][0]["port"]
    name = sts["metadata"]["name"]
    members = arg(relay, "--members").split(",")
    assert members == [f"{name}-{i}.{headless['metadata']['name']}:{port}"
                       for i in range(sts["spec"]["replicas"])]
    assert arg(relay, "--index") == "$(POD_INDEX)"
    assert env(relay)["POD_INDEX"] == {"fieldRef": {
        "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert spec.relay.url == f"https://{members[0]}"
    publish = tokens[spec.relay.token_secret_ref.name]
    assert publish["metadata"]["labels"] == {"dcr.dev/relay-token": "true"}
    read = next(t for n, t in tokens.items() if n != spec.relay.token_secret_ref.name)
    volumes = {v["name"]: v["secret"]["secretName"]
               for v in sts["spec"]["template"]["spec"]["volumes"]}
    by_mount = {m["mountPath"]: volumes[m["name"]] for m in relay["volumeMounts"]}
    assert by_mount[arg(relay, "--token-file").rsplit("/", 1)[0]] == read["metadata"]["name"]
    assert by_mount[arg(relay, "--publish-token-file").rsplit("/", 1)[0]] == (
        publish["metadata"]["name"])

    rollout = sets["relay-rollout"]["spec"]["template"]
    assert fleet["spec"]["selector"]["matchLabels"].items() <= rollout["metadata"][
        "labels"].items()
    (agent,) = [c for c in rollout["spec"]["containers"] if c["name"] == "agent"]
    (engine,) = [c for c in rollout["spec"]["containers"] if c["name"] == "engine"]
    url = arg(agent, "--relay")
    reader = services[url.split("://", 1)[1].split(":", 1)[0]]
    assert reader["spec"]["selector"] == headless["spec"]["selector"]
    assert "clusterIP" not in reader["spec"]
    secrets = {v["name"]: (v.get("secret") or {}).get("secretName")
               for v in rollout["spec"]["volumes"]}
    token_dir = arg(agent, "--relay-token-file").rsplit("/", 1)[0]
    assert secrets[mounts(agent)[token_dir]] == read["metadata"]["name"]
    assert publish["metadata"]["name"] not in secrets.values()
    # The history lives in the fleet's store, which the pods catch up from: they mount
    # nothing of the training side (the encoder profile's checkpoints volume).
    assert spec.store is not None
    assert arg(agent, "--store") == spec.store.uri
    trained = {v["persistentVolumeClaim"]["claimName"] for p in spec.encoder_profiles
               for v in (x.model_dump(by_alias=True) for x in p.volumes)
               if v.get("persistentVolumeClaim")}
    claims = {v["persistentVolumeClaim"]["claimName"] for v in rollout["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert trained
    assert not trained & claims
    # Both start from the run's starting model (version 0, read-only) and dense-load what
    # the agent builds under the pod's own checkpoint root.
    assert arg(engine, "--model") == arg(agent, "--canonical")
    volumes = {v["name"]: v for v in rollout["spec"]["volumes"]}
    base = next(m for m in agent["volumeMounts"]
                if arg(agent, "--canonical").startswith(m["mountPath"] + "/"))
    assert base["readOnly"]
    assert "persistentVolumeClaim" in volumes[base["name"]]
    assert arg(engine, "--checkpoint-root") == arg(agent, "--checkpoint-root")
    assert "emptyDir" in volumes[mounts(agent)[arg(agent, "--checkpoint-root")]]


def test_the_relay_examples_pods_catch_up_from_each_other_by_what_the_operator_makes() -> None:
    """relay.yaml with spec.catchUp.peers: the rollout StatefulSet's pods are named on the
    operator's <fleet>-peers Service (its serviceName), each agent asks its siblings by
    those names, over the fleet's agent scheme and port, with the peer token the operator
    keeps in <fleet>-peer-token mounted as a file (never in argv or env)."""
    (fleet,) = [o for o in objects(RELAY) if o["kind"] == "RolloutFleet"]
    spec = RolloutFleetSpec.model_validate(fleet["spec"])
    name = fleet["metadata"]["name"]
    assert spec.catch_up.peers
    (rollout,) = [o for o in objects(RELAY) if o["kind"] == "StatefulSet"
                  and o["metadata"]["name"] == name]
    assert rollout["spec"]["serviceName"] == service_name(name)
    pod = rollout["spec"]["template"]["spec"]
    (agent,) = [c for c in pod["containers"] if c["name"] == "agent"]
    donors = [a.split("=", 1)[1] for a in agent["args"] if a.startswith("--donor=")]
    assert donors == [f"{spec.agent.scheme}://{name}-{i}.{service_name(name)}:{spec.agent.port}"
                      for i in range(len(donors))]
    assert len(donors) > rollout["spec"]["replicas"]  # one more: a pod added by scaling
    token_dir = arg(agent, "--peer-token-file").rsplit("/", 1)[0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts(agent)[token_dir]]["secret"]["secretName"] == token_secret_name(name)
    assert "DCR_PEER_TOKEN" not in env(agent)
    assert token_secret_name(name) not in str(agent.get("env", []))


@pytest.fixture(scope="session")
def lws_crd(progress: Callable[[str], None]) -> dict[str, Any]:
    """LeaderWorkerSet's CRD, from its Go module (tools/controlplane/build.sh lws-crds)."""
    progress("tests/operator: build.sh lws-crds (cached after the first)")
    try:
        directory = built("lws-crds", progress=progress)["lws-crds"]
    except ControlPlaneError:
        if not go_available():
            pytest.skip("no LeaderWorkerSet CRD and no Go toolchain to fetch it")
        raise
    crd: dict[str, Any] = yaml.safe_load(
        (directory / "leaderworkerset.x-k8s.io_leaderworkersets.yaml").read_text())
    return crd


@pytest.mark.e2e
@pytest.mark.builds("lws-crds")
def test_the_apiserver_accepts_every_example_with_strict_field_validation(
        control_plane: ControlPlane, kube: KubeClient, lws_crd: dict[str, Any],
        tmp_path: Path) -> None:
    install_crds(kube)
    apply(kube, [lws_crd])
    wait_established(kube, [lws_crd])
    ns = "examples"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                       "metadata": {"name": ns}})
    try:
        for name in every_example():
            for obj in objects(name):
                if obj["kind"] in ("Deployment", "Secret", "NetworkPolicy"):
                    renamed = f"{Path(name).stem}-{obj['metadata']['name']}"  # files share
                    obj = {**obj, "metadata": {**obj["metadata"], "name": renamed}}
                path = path_of(obj, ns) if obj["kind"] != "NetworkPolicy" else (
                    f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies")
                kube.create(path + "?fieldValidation=Strict", obj)
    finally:
        control_plane.request("DELETE", f"/api/v1/namespaces/{ns}")


def serves_tls(spec: dict[str, Any], c: dict[str, Any]) -> str:
    """The cert-manager Secret container ``c`` serves HTTPS from (its tls.crt, tls.key and
    ca.crt, mounted read-only), every HTTP probe of it asking HTTPS."""
    e = env(c)
    files = {e[f"DCR_TLS_{k}"] for k in ("CERT", "KEY", "CA")}
    directory = {f.rsplit("/", 1)[0] for f in files}
    assert len(directory) == 1, (c["name"], files)
    (where,) = directory
    assert {f.rsplit("/", 1)[1] for f in files} == {"tls.crt", "tls.key", "ca.crt"}
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == where]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if "httpGet" in c.get(probe, {}):
            assert c[probe]["httpGet"]["scheme"] == "HTTPS", (c["name"], probe)
    name: str = volume["secret"]["secretName"]
    return name


def test_the_cross_cluster_examples_speak_tls_with_cert_manager_secrets() -> None:
    """relay.yaml, encoder-endpoint.yaml and trainer-ranks.yaml: every DCR server serves
    HTTPS from its role's Secret (the chart's tls.certificates names); the relay's nodes
    and the agents check one server name, which the fleet gives its encoder Jobs with the
    relay's CA; the fleet calls its agents, warm encoders and ranks over https."""
    relay = pod_specs(RELAY)
    (node,) = relay["relay"]["containers"]
    (agent,) = [c for c in relay["rollout"]["containers"] if c["name"] == "agent"]
    (engine,) = [c for c in relay["rollout"]["containers"] if c["name"] == "engine"]
    assert serves_tls(relay["relay"], node) == "dcr-relay-tls"
    assert serves_tls(relay["rollout"], agent) == "dcr-agent-tls"
    assert "DCR_TLS_CERT" not in env(engine)  # on loopback, behind the agent's door
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"]["scheme"] == "HTTPS"  # the agent's door, port 8000
    assert arg(agent, "--relay").startswith("https://")
    (fleet,) = [o for o in objects(RELAY) if o["kind"] == "RolloutFleet"]
    spec = RolloutFleetSpec.model_validate(fleet["spec"])
    assert spec.agent.scheme == "https"
    assert spec.relay is not None
    assert spec.relay.ca_secret_ref is not None
    assert (spec.relay.ca_secret_ref.name, spec.relay.ca_secret_ref.key) == (
        "dcr-relay-tls", "ca.crt")
    assert spec.relay.server_name == env(node)["DCR_TLS_SERVER_NAME"] == env(agent)[
        "DCR_TLS_SERVER_NAME"]
    (encoder,) = pod("encoder-endpoint.yaml")["containers"]
    assert serves_tls(pod("encoder-endpoint.yaml"), encoder) == "dcr-encoder-tls"
    (job,) = [o for o in objects(TRAINER) if o["kind"] == "Job"]
    ranks = job["spec"]["template"]["spec"]
    assert serves_tls(ranks, ranks["containers"][0]) == "dcr-encoder-tls"
    (main,) = [o for o in objects("rolloutfleet.yaml") if o["kind"] == "RolloutFleet"]
    for profile in RolloutFleetSpec.model_validate(main["spec"]).encoder_profiles:
        if profile.endpoint is not None:
            assert all(u.startswith("https://") for u in profile.endpoint.urls)
