"""Command-line entry points of echo-swarm (thin: parse, import lazily, call one run())."""
