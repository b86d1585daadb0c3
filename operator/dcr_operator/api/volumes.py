"""Volumes of encoder pods: what an encoder profile mounts, typed and checked.

A :class:`ProfileVolume` is a claim, a host path or an NFS export (exactly one), mounted
read-only unless the profile says otherwise. Mount paths are canonical, so that a string
comparison keeps them off :data:`PROFILE_DIR`. Why: docs/fleets.md, "Describe a fleet
and refit it".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from dcr_operator.api.common import SpecModel

PROFILE_DIR = "/etc/dcr/profile"
"""Where encoder pods mount the ConfigMap of the merged receiver profile."""
PROFILE_VOLUME = "profile"
"""That ConfigMap volume's name in the pod: no profile volume may take it."""
MAX_VOLUMES = 16
"""Volumes per encoder profile."""

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# A segment other than '..' (RE2 has no lookahead): '.', or one that starts with
# something other than '.', or '.' then something other than '.', or '..' then more.
_NOT_DOTDOT = r"\.|[^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+"
# A segment other than '', '.' and '..'.
_PLAIN = r"[^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+"
ABSOLUTE_PATH = rf"^(/({_NOT_DOTDOT})?)+$"
"""An absolute path without ``..`` segments (``/`` included): host paths, NFS exports."""
MOUNT_PATH = rf"^(/({_PLAIN}))+$"
"""A canonical absolute path other than ``/``: where a volume is mounted."""
_MAX_PATH = 1024


def _absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path (it must start with '/')")
    if ".." in value.split("/"):
        raise ValueError(f"{value!r} has a '..' segment: name the directory itself")
    return value


def _mount_path(value: str) -> str:
    _absolute(value)
    if value == "/" or any(s in ("", ".") for s in value[1:].split("/")):
        raise ValueError(f"mountPath {value!r} is not canonical: no '.' or empty segments, "
                         "no trailing '/', and not '/' itself")
    if value == PROFILE_DIR or PROFILE_DIR.startswith(value + "/") or value.startswith(
            PROFILE_DIR + "/"):
        raise ValueError(f"mountPath {value!r} would cover or sit inside {PROFILE_DIR}, "
                         "where the operator mounts the receiver profile")
    return value


# A checkpoint path goes into encoder Jobs' args, where the kubelet expands ``$(NAME)``
# from the container's environment (the store credentials): no '$', no control character.
_CHAR = r"[^/$\x00-\x1f\x7f]"
_FIRST = r"[^/.$\x00-\x1f\x7f]"
CHECKPOINT_PATH = rf"^(/({_FIRST}{_CHAR}*|\.{_FIRST}{_CHAR}*|\.\.{_CHAR}+))+$"
"""A canonical absolute path without ``$`` or control characters: a checkpoint."""


def _checkpoint_path(value: str) -> str:
    if "$" in value:
        raise ValueError(f"checkpoint {value!r} holds a '$': the kubelet would expand "
                         "$(NAME) in the encoder's arguments from its environment")
    if any(ord(c) < 0x20 or c == "\x7f" for c in value):
        raise ValueError(f"checkpoint {value!r} holds a control character")
    _absolute(value)
    if value == "/" or any(s in ("", ".") for s in value[1:].split("/")):
        raise ValueError(f"checkpoint {value!r} is not canonical: no '.' or empty segments "
                         "and no trailing '/'")
    return value


CheckpointPath = Annotated[str, AfterValidator(_checkpoint_path), Field(
    min_length=2, max_length=_MAX_PATH, json_schema_extra={"pattern": CHECKPOINT_PATH})]
"""A checkpoint's path, checked by pydantic and the API server."""

AbsolutePath = Annotated[str, AfterValidator(_absolute), Field(
    min_length=1, max_length=_MAX_PATH, json_schema_extra={"pattern": ABSOLUTE_PATH})]
"""An absolute path with no ``..`` segment, checked by pydantic and the API server."""

_OFF_PROFILE = (f"self != '{PROFILE_DIR}' && !'{PROFILE_DIR}'.startsWith(self + '/') && "
                f"!self.startsWith('{PROFILE_DIR}/')")
MountPath = Annotated[str, AfterValidator(_mount_path), Field(
    min_length=2, max_length=_MAX_PATH, json_schema_extra={
        "pattern": MOUNT_PATH, "x-kubernetes-validations": [{
            "rule": _OFF_PROFILE,
            "messageExpression": f"'mountPath ' + self + ' would cover or sit inside "
                                 f"{PROFILE_DIR}, where the operator mounts the receiver "
                                 "profile'"}]})]
"""Where a profile volume is mounted: canonical, absolute, and off :data:`PROFILE_DIR`."""


class PersistentVolumeClaimSource(SpecModel):
    """A PersistentVolumeClaim of the fleet's namespace (e.g. the rollout pods' checkpoints)."""

    claim_name: Annotated[str, Field(min_length=1, max_length=253,
                                     pattern=rf"^{_LABEL}(\.{_LABEL})*$")] = Field(
        description="The PersistentVolumeClaim's name, in the fleet's namespace.")


HostPathType = Literal["DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket",
                       "CharDevice", "BlockDevice"]


class HostPathSource(SpecModel):
    """A path on the node the encoder pod runs on (pin the nodes with nodeSelector)."""

    path: AbsolutePath = Field(description="The absolute path on the node, without '..'.")
    type: HostPathType | None = Field(
        default=None, description="What must be at the path; default: no check.")


class NfsSource(SpecModel):
    """An NFS export."""

    server: Annotated[str, Field(min_length=1, max_length=253,
                                 pattern=r"^[A-Za-z0-9]([-A-Za-z0-9.:\[\]]*[A-Za-z0-9\]])?$")
                      ] = Field(description="Host name or IP address of the NFS server.")
    path: AbsolutePath = Field(description="The exported path.")


_SOURCES = ("persistent_volume_claim", "host_path", "nfs")
_ONE_SOURCE = "set exactly one of persistentVolumeClaim, hostPath and nfs"


class ProfileVolume(SpecModel):
    """One volume of an encoder profile, and where the encoder container mounts it."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": " + ".join(f"(has(self.{to_camel(s)}) ? 1 : 0)" for s in _SOURCES) + " == 1",
        "message": _ONE_SOURCE}]})

    name: Annotated[str, Field(min_length=1, max_length=63, pattern=f"^{_LABEL}$",
                               json_schema_extra={"x-kubernetes-validations": [{
                                   "rule": f"self != '{PROFILE_VOLUME}'",
                                   "message": f"{PROFILE_VOLUME!r} is the operator's own "
                                              "volume (the receiver profile)"}]})] = Field(
        description="The pod volume's name (an RFC 1123 label), unique in the profile.")
    mount_path: MountPath = Field(
        description="Where the encoder container sees it: an absolute path, such as the "
        "directory the refits' checkpoints are under.")
    read_only: bool = Field(default=True, description="Mount read-only (the default: an "
                            "encoder only reads checkpoints).")
    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(
        default=None, description="A PersistentVolumeClaim (exactly one source is set).")
    host_path: HostPathSource | None = Field(
        default=None, description="A path on the node (exactly one source is set).")
    nfs: NfsSource | None = Field(
        default=None, description="An NFS export (exactly one source is set).")

    @model_validator(mode="after")
    def _one_source(self) -> ProfileVolume:
        given = [to_camel(s) for s in _SOURCES if getattr(self, s) is not None]
        if len(given) != 1:
            raise ValueError(f"volume {self.name!r}: {_ONE_SOURCE} (given: "
                             f"{', '.join(given) or 'none'})")
        if self.name == PROFILE_VOLUME:
            raise ValueError(f"volume name {self.name!r} is the operator's own volume (the "
                             "receiver profile): choose another")
        return self

    def pod_volume(self) -> dict[str, Any]:
        """The pod's ``volumes[]`` entry."""
        out: dict[str, Any] = {"name": self.name}
        if self.persistent_volume_claim is not None:
            out["persistentVolumeClaim"] = {
                "claimName": self.persistent_volume_claim.claim_name, "readOnly": self.read_only}
        elif self.host_path is not None:
            out["hostPath"] = self.host_path.model_dump(by_alias=True, exclude_none=True)
        elif self.nfs is not None:
            out["nfs"] = {**self.nfs.model_dump(by_alias=True), "readOnly": self.read_only}
        return out

    def volume_mount(self) -> dict[str, Any]:
        """The encoder container's ``volumeMounts[]`` entry."""
        return {"name": self.name, "mountPath": self.mount_path, "readOnly": self.read_only}


_UNIQUE = "self.all(v, self.exists_one(w, w.{0} == v.{0}))"


def _distinct(volumes: list[ProfileVolume]) -> list[ProfileVolume]:
    for field in ("name", "mount_path"):
        seen: set[str] = set()
        for v in volumes:
            value = getattr(v, field)
            if value in seen:
                raise ValueError(f"two volumes have {to_camel(field)} {value!r}: each needs "
                                 "its own")
            seen.add(value)
    return volumes


ProfileVolumes = Annotated[list[ProfileVolume], AfterValidator(_distinct), Field(
    max_length=MAX_VOLUMES, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
        "x-kubernetes-validations": [{"rule": _UNIQUE.format("mountPath"),
                                      "message": "two volumes have the same mountPath"}]})]
"""A profile's volumes: names and mount paths distinct, at most :data:`MAX_VOLUMES`."""

