"""Encoder Jobs: deterministic names, indexed manifests, and reading their status."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from pydantic import ValidationError

from dcr.protocol.records import Attempt, Transition
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.api.volumes import ABSOLUTE_PATH, MOUNT_PATH, PROFILE_DIR
from dcr_operator.api.weightrefit import WeightRefitSpec
from dcr_operator.errors import ApiUnreachable, Conflict, InvalidResource
from dcr_operator.jobs import (
    EncoderJobs,
    encoder_pod,
    job_manifest,
    job_name,
    job_state,
    parse_indexes,
    pod_failures,
    snapshot_job_manifest,
)
from dcr_operator.kube import KubeClient
from dcr_operator.settings import OperatorSettings
from dcr_operator.sites import UID_LABEL, Site

FLEET_SPEC: dict[str, Any] = {
    "selector": {"matchLabels": {"app": "r"}},
    "agent": {"tokenSecretRef": {"name": "tok"}},
    "store": {"uri": "s3://bucket/p", "endpoint": "http://s3:9000", "region": "eu-1",
              "credentialsSecretRef": {"name": "creds"}},
    "initial": {"checkpoint": "/ckpt/v0"}}
FLEET = RolloutFleetSpec.model_validate(FLEET_SPEC)
REFIT = {"apiVersion": "dcr.dev/v1alpha1", "kind": "WeightRefit",
         "metadata": {"name": "policy-v3", "namespace": "ns", "uid": "u-1"}}
SITE = Site(KubeClient(), "ns")  # the refit's own namespace (the client is never called)


def attempt(mode: str = "mixed") -> Attempt:
    return Attempt(transition=Transition(base_version=2, target_version=3), mode=mode,  # type: ignore[arg-type]
                   receivers=("p0",), deadline=time.time() + 600, owners=2, id="a-0123456789ab")


def refit_spec(**encoder: Any) -> WeightRefitSpec:
    return WeightRefitSpec.model_validate({
        "fleet": "f", "baseVersion": 2, "targetVersion": 3,
        "source": {"checkpoint": "/ckpt/v3"}, "encoder": {"owners": 2, **encoder}})


def manifest(fleet: RolloutFleetSpec = FLEET, settings: OperatorSettings | None = None,
             **encoder: Any) -> dict[str, Any]:
    return job_manifest(refit=REFIT, spec=refit_spec(**encoder), fleet=fleet, fleet_name="f",
                        base_checkpoint="/ckpt/v2", attempt=attempt(),
                        settings=settings or OperatorSettings(encoder_image="img:1"),
                        profile="prof", site=SITE)


def with_profiles(*profiles: dict[str, Any]) -> RolloutFleetSpec:
    return RolloutFleetSpec.model_validate({**FLEET_SPEC, "encoderProfiles": list(profiles)})


def test_job_names_are_deterministic_and_fit_a_pod_hostname() -> None:
    assert job_name("policy-v3", "a-0123456789ab") == "policy-v3-a-0123456789ab"
    long = "x" * 200
    a, b = job_name(long, "a-0123456789ab"), job_name(long, "a-0123456789ab")
    assert a == b
    assert len(a) <= 52
    assert job_name(long, "a-0123456789ab") != job_name(long + "y", "a-0123456789ab")


def test_the_encoder_job_is_indexed_owned_and_runs_one_owner_per_index() -> None:
    job = manifest()
    assert job["metadata"]["name"] == "policy-v3-a-0123456789ab"
    assert job["metadata"]["ownerReferences"] == [{
        "apiVersion": "dcr.dev/v1alpha1", "kind": "WeightRefit", "name": "policy-v3",
        "uid": "u-1", "controller": True, "blockOwnerDeletion": True}]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == (
        "Indexed", 2, 2)
    assert spec["backoffLimit"] == 0
    assert 590 <= spec["activeDeadlineSeconds"] <= 600
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "img:1"
    assert c["command"] == ["dcr"]
    assert c["args"] == ["encode", "/ckpt/v2", "/ckpt/v3", "--store", "s3://bucket/p",
                         "--version", "3", "--base-version", "2", "--mode", "mixed",
                         "--bucket-mib", "256", "--min-payloads", "16", "--level", "1",
                         "--owners", "2", "--attempt", "a-0123456789ab",
                         "--profile", "/etc/dcr/profile/profile.json",
                         "--owner", "$(DCR_OWNER)", "--json"]
    env = {e["name"]: e for e in c["env"]}
    assert env["DCR_OWNER"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://s3:9000"
    assert c["envFrom"] == [{"secretRef": {"name": "creds"}}]
    assert pod["volumes"] == [{"name": "profile", "configMap": {"name": "prof"}}]
    assert pod["restartPolicy"] == "Never"


def test_the_fleets_encoder_profile_the_refit_picks_reaches_the_pod() -> None:
    fleet = with_profiles({
        "name": "big", "image": "mine:2", "nodeSelector": {"pool": "train"},
        "resources": {"requests": {"cpu": 4, "memory": "8Gi"}},
        "serviceAccountName": "encoder", "tolerations": [{"key": "gpu", "operator": "Exists"}]})
    job = manifest(fleet, OperatorSettings(encoder_image="img:1", encoder_images="mine:*"),
                   profile="big", bucketMiB=64)
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "mine:2"
    assert c["args"][c["args"].index("--bucket-mib") + 1] == "64"
    assert c["resources"] == {"requests": {"cpu": 4, "memory": "8Gi"}}
    assert c["args"][c["args"].index("--threads") + 1] == "4"  # a thread per CPU requested
    assert pod["nodeSelector"] == {"pool": "train"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert pod["serviceAccountName"] == "encoder"


def test_without_a_default_profile_the_operators_defaults_shape_the_pod() -> None:
    settings = OperatorSettings(encoder_image="img:1", encoder_service_account="enc-sa",
                                encoder_image_pull_policy="Always")
    pod = manifest(with_profiles({"name": "big", "image": "img:1"}), settings)[
        "spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert (c["image"], c["imagePullPolicy"], pod["serviceAccountName"]) == (
        "img:1", "Always", "enc-sa")
    assert "nodeSelector" not in pod
    assert "tolerations" not in pod
    assert "resources" not in c
    assert "--threads" not in c["args"]  # dcr encode counts the cores it may use


@pytest.mark.parametrize(("resources", "threads"), [
    ({"requests": {"cpu": 4}}, 4), ({"requests": {"cpu": "1500m"}}, 2),
    ({"requests": {"cpu": "0.5"}}, 1), ({"limits": {"cpu": "3"}}, 3),
    ({"requests": {"cpu": "2"}, "limits": {"cpu": "8"}}, 2),
    ({"requests": {"memory": "8Gi"}}, None), ({"requests": {"cpu": "2e3"}}, None)])
def test_encoder_threads_follow_the_cpus_the_profile_requests(
        resources: dict[str, Any], threads: int | None) -> None:
    """Fails on edd87f2: every encoder ran 2 diff threads, whatever its profile asked for
    (a 4-CPU encoder pod used half of it)."""
    fleet = with_profiles({"name": "big", "image": "img:1", "resources": resources})
    args = manifest(fleet, OperatorSettings(encoder_image="img:1"), profile="big")[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    got = args[args.index("--threads") + 1] if "--threads" in args else None
    assert got == (None if threads is None else str(threads))


@pytest.mark.parametrize("field", [
    {"image": "attacker/miner:1"}, {"serviceAccountName": "cluster-admin-sa"},
    {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}},
    {"tolerations": [{"operator": "Exists"}]}, {"imagePullPolicy": "Always"},
    {"resources": {"limits": {"nvidia.com/gpu": 8}}}])
def test_a_weightrefit_cannot_shape_the_encoder_pod(field: dict[str, Any]) -> None:
    """Fails on 5b0b0ae: a WeightRefit set the encoder's image, ServiceAccount, node
    selector, tolerations and resources, so creating one amounted to creating any pod
    (with the fleet's Secret in its environment) through the operator's Job rights."""
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        refit_spec(**field)


def test_an_unknown_profile_or_an_image_the_operator_does_not_allow_is_refused() -> None:
    """Fails on 5b0b0ae (no profiles: ``encoder_pod`` did not exist); the fleet, which
    its admin owns, may name only images the operator's settings allow."""
    fleet = with_profiles({"name": "big", "image": "elsewhere/dcr:1"})
    settings = OperatorSettings(encoder_image="img:1", encoder_images="registry/dcr:*, mine:2")
    with pytest.raises(InvalidResource, match=r"asks for encoder profile 'huge', which "
                       r"RolloutFleet f does not define \(its spec.encoderProfiles: big\)"):
        encoder_pod(refit_spec(profile="huge"), fleet, "f", settings)
    with pytest.raises(InvalidResource, match="names image 'elsewhere/dcr:1', which the "
                       "operator does not allow"):
        encoder_pod(refit_spec(profile="big"), fleet, "f", settings)
    for allowed in ("registry/dcr:0.2", "mine:2", "img:1"):
        ok = with_profiles({"name": "big", "image": allowed})
        assert encoder_pod(refit_spec(profile="big"), ok, "f", settings).image == allowed
    assert not settings.allows_image("mine:22")


@pytest.mark.parametrize(("text", "want"), [
    (None, set()), ("", set()), ("0", {0}), ("0,2-4,7", {0, 2, 3, 4, 7})])
def test_completed_indexes_parse(text: str | None, want: set[int]) -> None:
    assert parse_indexes(text) == want


def test_job_state_reads_indexes_and_failure() -> None:
    running = {"status": {"completedIndexes": "1"}}
    assert job_state(running, 0) == "running"
    assert job_state(running, 1) == "done"
    failed = {"status": {"completedIndexes": "1", "conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}
    assert job_state(failed, 1) == "failed"
    complete = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    assert job_state(complete, 5) == "done"


def relay_job(relay: dict[str, Any]) -> dict[str, Any]:
    """The encoder Job of a relay fleet's refit."""
    fleet = RolloutFleetSpec.model_validate({
        "selector": {"matchLabels": {"app": "r"}},
        "agent": {"tokenSecretRef": {"name": "tok"}}, "relay": relay,
        "initial": {"checkpoint": "/ckpt/v0"}})
    spec = WeightRefitSpec.model_validate({
        "fleet": "f", "baseVersion": 2, "targetVersion": 3,
        "source": {"checkpoint": "/ckpt/v3"}})
    return job_manifest(refit=REFIT, spec=spec, fleet=fleet, fleet_name="f",
                        base_checkpoint="/ckpt/v2", attempt=attempt(),
                        settings=OperatorSettings(encoder_image="img:1"), profile=None,
                        site=SITE)


def test_a_relay_fleet_publishes_to_the_root_with_the_token_from_its_secret() -> None:
    job = relay_job({"url": "http://relay-0.rollout:8470",
                     "tokenSecretRef": {"name": "relay-tok"}})
    container = job["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--store") + 1] == "relay+http://relay-0.rollout:8470"
    env = {e["name"]: e for e in container["env"]}
    assert env["DCR_RELAY_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "relay-tok", "key": "token"}}
    assert "AWS_ENDPOINT_URL" not in env
    assert "envFrom" not in container
    assert not any("relay-tok" in a or a == "token" for a in args)


def test_a_tls_relay_is_verified_by_jobs_against_the_ca_from_its_labelled_secret() -> None:
    relay = {"url": "https://relay-0.rollout:8470", "tokenSecretRef": {"name": "relay-tok"},
             "caSecretRef": {"name": "dcr-relay-tls", "key": "ca.crt"},
             "serverName": "peer.dcr.internal"}
    job = relay_job(relay)
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["DCR_TLS_CA_DATA"]["valueFrom"] == {
        "secretKeyRef": {"name": "dcr-relay-tls", "key": "ca.crt"}}  # ca.crt alone, no key
    assert env["DCR_TLS_SERVER_NAME"]["value"] == "peer.dcr.internal"
    assert "volumes" not in job["spec"]["template"]["spec"]
    args = container["args"]
    assert args[args.index("--store") + 1] == "relay+https://relay-0.rollout:8470"
    with pytest.raises(ValidationError, match="is plain http: use an https:// url"):
        relay_job({**relay, "url": "http://relay-0.rollout:8470"})


def _fleet(**where: Any) -> RolloutFleetSpec:
    return RolloutFleetSpec.model_validate({
        "selector": {"matchLabels": {"app": "r"}},
        "agent": {"tokenSecretRef": {"name": "tok"}}, "initial": {"checkpoint": "/c"},
        **where})


RELAY = {"url": "http://relay-0.rollout:8470", "tokenSecretRef": {"name": "relay-tok"}}
STORE = {"uri": "s3://b/p", "credentialsSecretRef": {"name": "weights-s3"}}


def test_a_fleet_names_a_store_a_relay_or_both() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="set store, relay, or both"):
        _fleet()
    both = _fleet(store=STORE, relay=RELAY, retention={"snapshotEvery": 5})
    assert both.store is not None
    assert both.relay is not None


def test_retention_on_a_relay_fleet_without_a_store_is_refused() -> None:
    """Fails before: snapshotEvery on a relay fleet was accepted and did nothing."""
    from pydantic import ValidationError

    for retention in ({"snapshotEvery": 5}, {"keepSnapshots": 2}):
        with pytest.raises(ValidationError, match="retention needs the store"):
            _fleet(relay=RELAY, retention=retention)


def test_a_relay_fleet_with_a_store_writes_every_attempt_through_to_it() -> None:
    """Encoder Jobs publish to the root and through to the fleet's store (with its
    credentials), where the operator keeps the history. Fails before: such a fleet was
    refused, and a relay fleet's Jobs wrote nowhere but the root."""
    spec = WeightRefitSpec.model_validate({
        "fleet": "f", "baseVersion": 2, "targetVersion": 3, "encoder": {"owners": 2},
        "source": {"checkpoint": "/ckpt/v3"}})
    job = job_manifest(refit=REFIT, spec=spec, fleet=_fleet(store=STORE, relay=RELAY),
                       fleet_name="f", base_checkpoint="/ckpt/v2", attempt=attempt(),
                       settings=OperatorSettings(encoder_image="img:1"), profile=None,
                       site=SITE)
    container = job["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--store") + 1] == (
        "relay+http://relay-0.rollout:8470?through=s3://b/p")
    assert container["envFrom"] == [{"secretRef": {"name": "weights-s3"}}]
    assert job["spec"]["completions"] == 2


CHECKPOINTS = {"name": "checkpoints", "mountPath": "/checkpoints",
               "persistentVolumeClaim": {"claimName": "policy-checkpoints"}}


def test_the_profiles_volumes_are_mounted_beside_the_receiver_profile() -> None:
    """Fails on b59354c: encoder pods mounted only the profile ConfigMap, so ``dcr
    encode`` could not read the checkpoints at ``/checkpoints/...`` on a real cluster."""
    fleet = with_profiles({"name": "train", "volumes": [
        CHECKPOINTS,
        {"name": "scratch", "mountPath": "/data/scratch", "readOnly": False,
         "hostPath": {"path": "/mnt/nvme/scratch", "type": "DirectoryOrCreate"}},
        {"name": "archive", "mountPath": "/archive",
         "nfs": {"server": "10.0.0.7", "path": "/exports/ckpt"}}]})
    pod = manifest(fleet, profile="train")["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {"name": "profile", "configMap": {"name": "prof"}},
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "policy-checkpoints",
                                                          "readOnly": True}},
        {"name": "scratch", "hostPath": {"path": "/mnt/nvme/scratch",
                                         "type": "DirectoryOrCreate"}},
        {"name": "archive", "nfs": {"server": "10.0.0.7", "path": "/exports/ckpt",
                                    "readOnly": True}}]
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "profile", "mountPath": "/etc/dcr/profile", "readOnly": True},
        {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True},
        {"name": "scratch", "mountPath": "/data/scratch", "readOnly": False},
        {"name": "archive", "mountPath": "/archive", "readOnly": True}]


def test_profile_volumes_without_a_receiver_profile_and_the_default_profile_has_none() -> None:
    fleet = with_profiles({"name": "train", "volumes": [CHECKPOINTS]})
    job = job_manifest(refit=REFIT, spec=refit_spec(profile="train"), fleet=fleet,
                       fleet_name="f", base_checkpoint="/ckpt/v2", attempt=attempt(),
                       settings=OperatorSettings(encoder_image="img:1"), profile=None,
                       site=SITE)
    pod = job["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["checkpoints"]
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True}]
    default = manifest(fleet)["spec"]["template"]["spec"]  # the refit picks "default"
    assert [v["name"] for v in default["volumes"]] == ["profile"]


def profile_volume(**volume: Any) -> RolloutFleetSpec:
    return with_profiles({"name": "p", "volumes": [{**CHECKPOINTS, **volume}]})


@pytest.mark.parametrize(("volume", "error"), [
    ({"mountPath": "checkpoints"}, r"'checkpoints' is not an absolute path"),
    ({"mountPath": "/checkpoints/../etc"}, r"'/checkpoints/\.\./etc' has a '\.\.' segment"),
    ({"mountPath": "/checkpoints/"}, r"mountPath '/checkpoints/' is not canonical"),
    ({"mountPath": "/a//b"}, r"mountPath '/a//b' is not canonical"),
    ({"mountPath": "/"}, r"mountPath '/' is not canonical"),
    ({"mountPath": "/etc/dcr/profile"}, r"mountPath '/etc/dcr/profile' would cover or sit "
     r"inside /etc/dcr/profile"),
    ({"mountPath": "/etc/dcr"}, r"mountPath '/etc/dcr' would cover"),
    ({"mountPath": "/etc/dcr/profile/x"}, r"mountPath '/etc/dcr/profile/x' would cover"),
    ({"hostPath": {"path": "/mnt/ckpt"}}, r"volume 'checkpoints': set exactly one of "
     r"persistentVolumeClaim, hostPath and nfs \(given: persistentVolumeClaim, hostPath\)"),
    ({"persistentVolumeClaim": None}, r"volume 'checkpoints': set exactly one of "
     r"persistentVolumeClaim, hostPath and nfs \(given: none\)"),
    ({"persistentVolumeClaim": None, "hostPath": {"path": "mnt/ckpt"}},
     r"'mnt/ckpt' is not an absolute path"),
    ({"persistentVolumeClaim": None, "nfs": {"server": "nfs", "path": "/a/../b"}},
     r"'/a/\.\./b' has a '\.\.' segment"),
    ({"persistentVolumeClaim": {"claimName": "Policy/Checkpoints"}}, r"claimName"),
    ({"name": "profile"}, r"volume name 'profile' is the operator's own volume"),
    ({"secret": {"secretName": "s"}}, r"secret\s+Extra inputs are not permitted"),
])
def test_a_profile_volume_that_is_not_plainly_a_mount_is_refused(
        volume: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        profile_volume(**volume)


def test_profile_volumes_need_distinct_names_and_mount_paths_and_are_bounded() -> None:
    other = {**CHECKPOINTS, "name": "other"}
    with pytest.raises(ValidationError, match="two volumes have mountPath '/checkpoints'"):
        with_profiles({"name": "p", "volumes": [CHECKPOINTS, other]})
    with pytest.raises(ValidationError, match="two volumes have name 'checkpoints'"):
        with_profiles({"name": "p", "volumes": [
            CHECKPOINTS, {**CHECKPOINTS, "mountPath": "/elsewhere"}]})
    many = [{**CHECKPOINTS, "name": f"v{i}", "mountPath": f"/v{i}"} for i in range(17)]
    with pytest.raises(ValidationError, match="at most 16 items"):
        with_profiles({"name": "p", "volumes": many})
    assert len(with_profiles({"name": "p", "volumes": many[:16]}).encoder_profiles[0]
               .volumes or []) == 16


@pytest.mark.parametrize("path", [
    "/checkpoints", "/a/.b/..c/...", "/a.b", "/", "//", "/a/", "/a/./b", "/a/..", "/..",
    "/a/../b", "a", "", "/.", "/a//b", "/..a/b..", "/etc/dcr/profile"])
def test_the_crd_patterns_accept_what_the_validators_accept(path: str) -> None:
    """The API server checks paths with the schema's patterns, pydantic with validators;
    both must agree on every path."""
    absolute = re.fullmatch(ABSOLUTE_PATH, path) is not None
    mount = re.fullmatch(MOUNT_PATH, path) is not None
    assert absolute == accepts(lambda: profile_volume(
        persistentVolumeClaim=None, hostPath={"path": path}))
    off_profile = path.startswith("/") and not (
        path == PROFILE_DIR or PROFILE_DIR.startswith(path + "/")
        or path.startswith(PROFILE_DIR + "/"))
    assert (mount and off_profile) == accepts(lambda: profile_volume(mountPath=path))


def accepts(build: Any) -> bool:
    try:
        build()
    except ValidationError:
        return False
    return True


def test_a_weightrefit_cannot_add_volumes() -> None:
    """Volumes are pod-shaping: only the fleet's profiles have them."""
    with pytest.raises(ValidationError, match=r"encoder\.volumes\s+Extra inputs are not"):
        refit_spec(volumes=[CHECKPOINTS])
    spec = {"fleet": "f", "baseVersion": 2, "targetVersion": 3,
            "source": {"checkpoint": "/ckpt/v3"}}
    with pytest.raises(ValidationError, match=r"(?m)^volumes\s+Extra inputs are not") as e:
        WeightRefitSpec.model_validate({**spec, "volumes": [CHECKPOINTS]})
    assert e.value.error_count() == 1
    with pytest.raises(ValidationError, match=r"source\.volumes\s+Extra inputs are not"):
        WeightRefitSpec.model_validate({**spec, "source": {
            "checkpoint": "/ckpt/v3", "volumes": [CHECKPOINTS]}})


def test_jobs_in_a_training_cluster_carry_the_refits_uid_instead_of_an_owner_reference(
) -> None:
    """The WeightRefit's uid means nothing in another cluster: an ownerReference to it
    would have that cluster's garbage collector delete the Job at once."""
    local = manifest()
    assert local["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    remote = job_manifest(refit=REFIT, spec=refit_spec(), fleet=FLEET, fleet_name="f",
                          base_checkpoint="/ckpt/v2", attempt=attempt(),
                          settings=OperatorSettings(encoder_image="img:1"), profile="prof",
                          site=Site(KubeClient(), "encoders", cluster="training"))
    meta = remote["metadata"]
    assert meta["namespace"] == "encoders"
    assert meta["ownerReferences"] == []
    for labels in (meta["labels"], remote["spec"]["template"]["metadata"]["labels"]):
        assert labels[UID_LABEL] == "u-1"


@pytest.mark.parametrize(("path", "why"), [
    ("/checkpoints/$(AWS_SECRET_ACCESS_KEY)", "holds a '\\$'"),
    ("/checkpoints/$$x", "holds a '\\$'"),
    ("checkpoints/v3", "not an absolute path"),
    ("/checkpoints/../etc/v3", "'..' segment"),
    ("/checkpoints/./v3", "not canonical"),
    ("/checkpoints//v3", "not canonical"),
    ("/checkpoints/v3/", "not canonical"),
    ("/checkpoints/v3\n--store=s3://elsewhere", "control character"),
])
def test_a_checkpoint_path_the_kubelet_would_expand_or_that_is_not_canonical_is_refused(
        path: str, why: str) -> None:
    """Fails on 0961110: the free-form path went into the encoder's args beside envFrom
    of the store credentials, and the kubelet expands ``$(NAME)`` there."""
    with pytest.raises(ValidationError, match=why):
        WeightRefitSpec.model_validate({"fleet": "f", "baseVersion": 2, "targetVersion": 3,
                                        "source": {"checkpoint": path}})
    with pytest.raises(ValidationError, match=why):
        RolloutFleetSpec.model_validate({**FLEET_SPEC, "initial": {"checkpoint": path}})


def test_every_argument_built_from_a_fleet_reaches_the_encoder_as_written() -> None:
    """A ``$(NAME)`` the fleet's store URI carries (a pattern allows it there) is escaped
    as ``$$(NAME)``, so the kubelet passes it literally instead of the credential's value;
    the one reference the operator means, the owner index, still expands. Fails on
    0961110: the secret came out in ``dcr encode``'s argv."""
    from kubelet import expand

    fleet = RolloutFleetSpec.model_validate({**FLEET_SPEC, "store": {
        **FLEET_SPEC["store"], "uri": "s3://bucket/p$(AWS_SECRET_ACCESS_KEY)"}})
    env = {"AWS_SECRET_ACCESS_KEY": "sk-live-secret", "DCR_OWNER": "1"}
    for job in (manifest(fleet), snapshot_job_manifest(
            refit=REFIT, spec=refit_spec(), fleet=fleet, fleet_name="f",
            settings=OperatorSettings(encoder_image="img:1"), site=SITE)):
        args = [expand(a, env) for a in job["spec"]["template"]["spec"]["containers"][0]["args"]]
        assert "s3://bucket/p$(AWS_SECRET_ACCESS_KEY)" in args
        assert not any("sk-live-secret" in a for a in args)
    encode = [expand(a, env) for a in manifest(fleet)["spec"]["template"]["spec"]
              ["containers"][0]["args"]]
    assert encode[encode.index("--owner") + 1] == "1"


def test_encoder_pods_meet_the_restricted_pod_security_level_and_carry_no_api_token() -> None:
    """Fails on 0961110: encoder Job pods had no security context, and the ServiceAccount
    token was mounted although ``dcr encode`` never calls the API; namespaces enforcing
    the restricted level refused them (the deploy tier runs them in one)."""
    fleet = with_profiles({"name": "train", "volumes": [CHECKPOINTS]})
    for job in (manifest(fleet, profile="train"), snapshot_job_manifest(
            refit=REFIT, spec=refit_spec(profile="train"), fleet=fleet, fleet_name="f",
            settings=OperatorSettings(encoder_image="img:1"), site=SITE)):
        pod = job["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"] == {"runAsNonRoot": True,
                                          "seccompProfile": {"type": "RuntimeDefault"}}
        (c,) = pod["containers"]
        assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}


def _failed_pod(index: int, message: str, code: int = 1) -> dict[str, Any]:
    return {"metadata": {"annotations": {"batch.kubernetes.io/job-completion-index":
                                         str(index)}},
            "status": {"containerStatuses": [{"state": {"terminated": {
                "exitCode": code, "message": message}}}]}}


def test_a_failed_jobs_pods_say_why_once_each_sanitized_and_bounded() -> None:
    """Fails without ``pod_failures``: a failed encoder Job's condition said only
    "BackoffLimitExceeded"; what the pod wrote as it ended is carried now, never trusted."""
    pods = {"items": [
        _failed_pod(1, "StoreError: Store s3://b/p\nunreachable."),
        _failed_pod(0, "StoreError: Store s3://b/p\nunreachable."),
        _failed_pod(2, "\x1b[2J" + "y" * 9000),
        _failed_pod(3, "ok", code=0), _failed_pod(4, "")]}
    said = pod_failures(pods)
    assert said.startswith("owner 0: StoreError: Store s3://b/p unreachable.; owner 2: ?[2J")
    assert len(said) < 2 * 512 + 40
    assert "\n" not in said
    assert "owner 3" not in said
    assert pod_failures({"items": []}) == ""


def test_the_encoder_container_writes_its_termination_message_where_kubernetes_reads() -> None:
    container = manifest()["spec"]["template"]["spec"]["containers"][0]
    assert (container["terminationMessagePath"], container["terminationMessagePolicy"]) == (
        "/dev/termination-log", "File")
    assert {"name": "DCR_TERMINATION_LOG", "value": "/dev/termination-log"} in container["env"]


class _RestartingApi:
    """A client of an API server that is restarting: its first ``down`` creates get no
    answer (the first of them made the Job all the same, when ``made``)."""

    def __init__(self, down: int, made: bool) -> None:
        self.down, self.made = down, made
        self.jobs: dict[str, dict[str, Any]] = {}

    def create(self, path: str, body: dict[str, Any]) -> Any:
        name = body["metadata"]["name"]
        if self.down:
            self.down -= 1
            if self.made:
                self.jobs[name], self.made = body, False
            raise ApiUnreachable(f"POST {path}: no answer from https://10.0.0.1:443.")
        if name in self.jobs:
            raise Conflict(f"POST {path}: {name} exists", 409)
        self.jobs[name] = body
        return body

    def get(self, path: str) -> Any:
        return self.jobs[path.rsplit("/", 1)[1]]


@pytest.mark.parametrize("made", [False, True])
def test_an_encoder_job_is_created_through_an_api_server_restart(made: bool) -> None:
    """The API server restarting as the attempt creates its Job (connections reset, then
    refused) does not fail the attempt: the create is tried again until it is answered,
    and a create that was made without an answer is found as the attempt's own."""
    api = _RestartingApi(down=3, made=made)
    jobs = EncoderJobs(site=Site(api, "ns"), refit=REFIT, spec=refit_spec(), fleet=FLEET,  # type: ignore[arg-type]
                       fleet_name="f", base_checkpoint="/ckpt/v2",
                       settings=OperatorSettings(encoder_image="img:1", job_poll_seconds=0.01))
    assert jobs.ensure(attempt()) == job_name("policy-v3", "a-0123456789ab")
    assert list(api.jobs) == [job_name("policy-v3", "a-0123456789ab")]


def test_an_api_server_down_past_the_attempts_deadline_fails_the_job_create() -> None:
    api = _RestartingApi(down=10**6, made=False)
    jobs = EncoderJobs(site=Site(api, "ns"), refit=REFIT, spec=refit_spec(), fleet=FLEET,  # type: ignore[arg-type]
                       fleet_name="f", base_checkpoint="/ckpt/v2",
                       settings=OperatorSettings(encoder_image="img:1", job_poll_seconds=0.01))
    late = Attempt(transition=Transition(base_version=2, target_version=3), mode="mixed",
                   receivers=("p0",), deadline=time.time() + 0.2, owners=2, id="a-0123456789ab")
    with pytest.raises(ApiUnreachable, match="no answer"):
        jobs.ensure(late)
