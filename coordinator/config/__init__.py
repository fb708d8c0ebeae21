"""Coordinator configuration: one pydantic model per section of the run, loaded from TOML, overridable by CLI flags.

A module per section (as each role reads its own: the learner ``learner``, the verifier ``verification``, the API
``server``, ``limits``, ``registration``, ``trust`` and ``jobs``, the p2p role ``p2p``), and ``run`` for the whole run
and the checks between sections. Every public name is importable from here, so callers need not know which module
holds it. Every model forbids unknown keys, so a typo in a config file is an error that names the key rather than a
silently ignored setting.
"""

from coordinator.config.base import ConfigError, StrictModel, cuda_device
from coordinator.config.jobs import JobsConfig, SamplingConfig
from coordinator.config.learner import LearnerConfig
from coordinator.config.model import ModelConfig
from coordinator.config.p2p import P2PConfig
from coordinator.config.run import CoordinatorConfig, load_config
from coordinator.config.server import LimitsConfig, RegistrationConfig, ServerConfig
from coordinator.config.snapshots import SnapshotConfig
from coordinator.config.store import StoreConfig
from coordinator.config.tasks import (
    ArithmeticTaskConfig,
    DatasetTaskConfig,
    EnvironmentTaskConfig,
    JsonlTaskConfig,
    ReasoningGymTaskConfig,
    RewardConfig,
    TaskConfig,
)
from coordinator.config.trust import RETIRED_MESSAGE, RETIRED_TRUST_KEYS, TrustConfig
from coordinator.config.verification import (
    CHOICE_TOL_LLAMA,
    CHOICE_TOL_TORCH,
    CHOICE_TOL_TORCH_BF16,
    GGUF_PRECISIONS,
    LLAMA_TOLERANCES,
    TORCH_TOLERANCES,
    BackendTolerance,
    VerificationConfig,
)

__all__ = [
    "ConfigError",
    "StrictModel",
    "cuda_device",
    "ModelConfig",
    "ArithmeticTaskConfig",
    "JsonlTaskConfig",
    "RewardConfig",
    "DatasetTaskConfig",
    "ReasoningGymTaskConfig",
    "EnvironmentTaskConfig",
    "TaskConfig",
    "LearnerConfig",
    "SamplingConfig",
    "JobsConfig",
    "BackendTolerance",
    "CHOICE_TOL_TORCH",
    "CHOICE_TOL_LLAMA",
    "GGUF_PRECISIONS",
    "LLAMA_TOLERANCES",
    "CHOICE_TOL_TORCH_BF16",
    "TORCH_TOLERANCES",
    "VerificationConfig",
    "RETIRED_TRUST_KEYS",
    "RETIRED_MESSAGE",
    "TrustConfig",
    "LimitsConfig",
    "RegistrationConfig",
    "ServerConfig",
    "SnapshotConfig",
    "P2PConfig",
    "StoreConfig",
    "CoordinatorConfig",
    "load_config",
]
