"""The volunteer client: `echo-swarm join URL` leases signed rollout jobs, generates them on local hardware,
and returns signed results."""
