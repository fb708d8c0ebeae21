"""Pure decision logic of the coordinator: no I/O, no clocks of their own (``now`` is always passed in).

The server, the learner loop and the store call these; tests drive them directly with injected clocks.
"""
