"""Publication: signed, content-addressed policy snapshots (safetensors and GGUF), learner checkpoints and the
publisher thread that writes them off the learner's critical path."""
