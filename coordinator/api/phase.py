"""What every phase of a signed call works with (coordinator.api.leasing, coordinator.api.intake): the run's
configuration and files, the API's state, the sign-in, the trust guard, the issuer, the prompts' tokens (and their
codec), the jobs in verification and the clock. Each phase adds only what is its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coordinator.api.guard import Guard
from coordinator.api.issuer import Issuer
from coordinator.api.runstate import ApiState
from coordinator.api.signin import SignIn
from coordinator.api.verdicts import Verifying
from coordinator.config import CoordinatorConfig
from coordinator.run.runfiles import RunFiles
from coordinator.tasks.text import PromptTokens


@dataclass(eq=False)
class Phase:
    """The collaborators a phase is handed (see the module's docstring); ``verifying`` names the jobs whose result
    is being verified, which the intake holds and leasing never reissues meanwhile."""

    config: CoordinatorConfig
    files: RunFiles
    state: ApiState
    signin: SignIn
    guard: Guard
    issuer: Issuer
    prompt_tokens: PromptTokens
    verifying: Verifying
    clock: Callable[[], float]
