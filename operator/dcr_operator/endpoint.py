"""Warm encoders: owner handles that call a long-running ``dcr encoder`` per attempt.

When a refit's encoder profile has an ``endpoint``, owner ``k`` is :class:`EndpointOwner`,
which asks ``urls[k]`` to publish with a Job's arguments (:mod:`dcr.protocol.encoder_api`).
The handles are the data plane's (:mod:`dcr.protocol.owner_endpoints`, which a trainer's
own coordinator uses too): the token goes in the Authorization header only, no redirect is
followed, and one owner's failure stops the attempt on every endpoint. docs/publishing.md,
"Warm encoder".
"""

from __future__ import annotations

from collections.abc import Callable

from dcr.format.payload import Mode
from dcr.format.profile import ReceiverProfile
from dcr.protocol.owner_endpoints import EndpointOwner, OwnerEndpoints
from dcr.protocol.records import Attempt
from dcr_operator.api.rolloutfleet import EncoderEndpoint, RolloutFleetSpec
from dcr_operator.api.weightrefit import WeightRefitSpec
from dcr_operator.errors import EncoderEndpointFailed, InvalidResource
from dcr_operator.reconcile import remote_failure


def encoder_endpoint(spec: WeightRefitSpec, fleet: RolloutFleetSpec, fleet_name: str
                     ) -> EncoderEndpoint | None:
    """The warm encoders of the profile the refit names (None: it runs encoder Jobs).

    InvalidResource when the refit's ``spec.encoder.owners`` is not their number: each
    owner index is one URL.
    """
    wanted = spec.encoder.profile
    profile = fleet.encoder_profile(wanted)
    if profile is None or profile.endpoint is None:
        return None
    urls = len(profile.endpoint.urls)
    if spec.encoder.owners != urls:
        raise InvalidResource(f"The WeightRefit asks for {spec.encoder.owners} encoder "
                              f"owners, but encoder profile {wanted!r} of RolloutFleet "
                              f"{fleet_name} has an endpoint with {urls} URLs, one per "
                              f"owner: set spec.encoder.owners to {urls}.")
    return profile.endpoint


def store_of(fleet: RolloutFleetSpec) -> str | None:
    """The store URI the fleet's agents read (None for a relay fleet)."""
    return fleet.store.uri if fleet.store is not None else None


class EncoderEndpoints(OwnerEndpoints):
    """The warm encoders of one WeightRefit run: the data plane's owner endpoints built
    from the refit's spec and its fleet's encoder profile, a failure worded for status
    (:func:`remote_failure`) and raised as :class:`EncoderEndpointFailed`."""

    def __init__(self, *, profile_name: str, endpoint: EncoderEndpoint, token: str,
                 spec: WeightRefitSpec, base_checkpoint: str, base_attempt: str = "",
                 store: str | None, profile: ReceiverProfile | None = None,
                 forced_mode: Mode | None = None,
                 on_started: Callable[[Attempt, str], None] | None = None,
                 on_finished: Callable[[Attempt, str, str | None], None] | None = None
                 ) -> None:
        super().__init__(
            name=profile_name, urls=endpoint.urls, token=token,
            target=spec.source.checkpoint, bucket_mib=spec.encoder.bucket_mib,
            base_checkpoint=base_checkpoint, base_attempt=base_attempt, store=store,
            profile=profile, forced_mode=forced_mode, on_started=on_started,
            on_finished=on_finished, describe=remote_failure, error=EncoderEndpointFailed)


__all__ = ["EncoderEndpoints", "EndpointOwner", "encoder_endpoint", "store_of"]
