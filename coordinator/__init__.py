"""The coordinator: hosts the GRPO learner, leases signed rollout jobs, publishes signed weight snapshots, and
verifies every returned trajectory before it may reach the learner."""
