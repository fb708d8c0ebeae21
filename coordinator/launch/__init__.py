"""Start-up and composition, the top layer: the ``echo-swarm coordinator`` entry, the supervisor of the role
processes, the one-process layout and the start of a role's torch.distributed ranks. Only this layer wires the
roles and the API together; nothing imports it (docs/architecture.md)."""
