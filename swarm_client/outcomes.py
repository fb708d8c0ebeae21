"""What a step of the join loop's turn answers (swarm_client/leasing.py): go on to the turn's next step, start the
next turn, or the exit code to stop with — and NEW_RUN, the coordinator now serving another run to join.

Its own module because the steps live in several collaborators (the gates, the leasing loop, the generation) that
must all speak the loop's vocabulary without importing each other.
"""

from __future__ import annotations

import enum

from shared.exit_codes import ExitCode

EXIT_OK, EXIT_REFUSED, EXIT_RESOURCES = ExitCode.OK, ExitCode.REFUSED, ExitCode.RESOURCES
EXIT_UNREACHABLE, EXIT_NOT_A_COORDINATOR = ExitCode.UNREACHABLE, ExitCode.NOT_A_COORDINATOR
NEW_RUN = -1  # the leasing loop's outcome when the coordinator now serves another run: join it


class Next(enum.Enum):
    """What a step of the loop's turn says when it returns no exit code: go on to the turn's next step, or start
    the next turn."""

    LEASE = "lease"
    AGAIN = "again"
