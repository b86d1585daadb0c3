"""Operator settings parse once from the environment and refuse what they do not know."""

from __future__ import annotations

import pytest

from dcr.errors import ConfigError
from dcr_operator.settings import OperatorSettings


def test_settings_parse_from_the_environment() -> None:
    s = OperatorSettings.from_env({"DCR_OPERATOR_ENCODER_IMAGE": "img:2",
                                   "DCR_OPERATOR_JOB_POLL_SECONDS": "0.5",
                                   "DCR_OPERATOR_ENCODER_TTL_SECONDS": "60",
                                   "DCR_OPERATOR_CLEANUP_STORE": "false", "HOME": "/x"})
    assert (s.encoder_image, s.job_poll_seconds, s.encoder_ttl_seconds, s.cleanup_store) == (
        "img:2", 0.5, 60, False)


def test_an_unknown_setting_is_named() -> None:
    with pytest.raises(ConfigError, match="Unknown setting DCR_OPERATOR_JOB_POLL_SECOND;"):
        OperatorSettings.from_env({"DCR_OPERATOR_JOB_POLL_SECOND": "1"})


def test_a_bad_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"DCR_OPERATOR_RETRY_SECONDS='soon' is not a valid"):
        OperatorSettings.from_env({"DCR_OPERATOR_RETRY_SECONDS": "soon"})
    with pytest.raises(ConfigError, match="PULL_POLICY='Sometimes'"):
        OperatorSettings.from_env({"DCR_OPERATOR_ENCODER_IMAGE_PULL_POLICY": "Sometimes"})


def test_encoder_images_the_admin_allows_parse_as_exact_names_and_prefixes() -> None:
    """What the chart's encoder.allowedImages becomes (joined by commas)."""
    s = OperatorSettings.from_env({"DCR_OPERATOR_ENCODER_IMAGE": "dcr:1",
                                   "DCR_OPERATOR_ENCODER_IMAGES": "reg/dcr:*,mine:2"})
    assert [s.allows_image(i) for i in ("dcr:1", "reg/dcr:0.3", "mine:2", "mine:22",
                                        "reg/dcrx:1", "other:1")] == [
        True, True, True, False, False, False]
    assert not OperatorSettings(encoder_image="dcr:1").allows_image("")
