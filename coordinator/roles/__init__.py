"""The role processes beside the API: the learner, the verifiers and the libp2p peer. Each talks to the others
only through the store and the run's files (run/); the torch work they drive lives in engine/."""
