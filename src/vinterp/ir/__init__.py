"""The intervention graph: nodes, whitelisted ops, wire format, forward-order planning."""
