"""The ``[trust]`` section: quarantine and the selective-reporting rule the API applies per identity."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from coordinator.config.base import StrictModel

#: What an old config may still name from the spot-check era, and why it is refused rather than ignored: a key
#: that no longer does anything must not look like it still protects the run.
RETIRED_TRUST_KEYS = ("trusted_after", "min_replication_rate", "spot_checks", "hold_s", "active_window_s",
                      "replica_min_agreement", "replicator_min_valid", "registration_burst_s")
RETIRED_MESSAGE = ("spot-checks were retired: every token is now checked by the keyed sampler (docs/security.md); "
                   "delete this key from the config")


class TrustConfig(StrictModel):
    """Trust and quarantine per identity (coordinator.core.trust), and the reporting rule
    (coordinator.core.reporting) for what the keyed sampler cannot see."""

    quarantine_after: int = Field(3, ge=1, le=1000, description="Invalid results in a row that quarantine a client.")
    quarantine_s: float = Field(600.0, ge=0, description="Seconds of the first quarantine; the n-th lasts n times "
                                "as long.")
    reporting_min_leases: int = Field(40, ge=1, le=1_000_000, description="Leases an identity must have been "
                                      "granted before its reporting is judged (coordinator.core.reporting).")
    reporting_max_unreturned: float = Field(0.25, ge=0.0, lt=1.0, description="Share of an identity's leases that "
                                            "may end without a result (released, or run out) before the rewards "
                                            "of what it returns are compared with the expectation.")
    reporting_min_results: int = Field(20, ge=1, le=1_000_000, description="Results of its own, at versions where "
                                       "others returned results too, before that comparison counts.")
    reporting_reward_z: float = Field(4.0, gt=0, description="Standard errors above the other volunteers' rewards "
                                      "at the same versions that, with the unreturned share past its threshold, "
                                      "flag the identity (selective reporting): its trust resets, and every "
                                      "quarantine_after-th flag quarantines it.")
    reporting_dropped_z: float = Field(6.0, gt=0, description="Standard errors by which the rewards an identity "
                                       "returned may exceed those of the jobs it dropped (as the next client "
                                       "computed them: the same key, the same tokens) before, with the unreturned "
                                       "share past its threshold, it is flagged the same way.")
    reporting_cooldown_s: float = Field(600.0, ge=0, description="Seconds between two such lowerings of one "
                                        "identity's trust (the same evidence is counted once per period).")

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            named = [k for k in RETIRED_TRUST_KEYS if k in data]
            if named:
                raise ValueError(f"trust.{', trust.'.join(named)}: {RETIRED_MESSAGE}")
        return data
